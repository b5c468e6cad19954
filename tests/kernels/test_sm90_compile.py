import os
import subprocess
import sys


def test_kernels_compile_for_hopper():
    # the compiler's front end and back end for sm_90, in a process of its own (this session's Triton
    # runs interpreted); no GPU needed
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "sm90_compile.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    proc = subprocess.run([sys.executable, script], env=dict(env, PYTHONPATH=root), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 29  # every variant of sm90_compile.py
