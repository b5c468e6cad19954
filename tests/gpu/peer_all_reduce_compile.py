"""Compile the fused peer all-reduce for sm_90 without a GPU (Triton bundles ptxas) and count
its 16-byte accesses: a check that runs on the CPU with Triton 3.6, the GPU machine's.

    pip download triton==3.6.0 --no-deps -d /tmp/w && unzip -q /tmp/w/*.whl -d /tmp/t36
    PYTHONPATH=/tmp/t36 python tests/gpu/peer_all_reduce_compile.py
"""

import importlib.util
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("par", os.path.join(HERE, "../../atom/distributed/peer_all_reduce.py"))
par = importlib.util.module_from_spec(spec)
spec.loader.exec_module(par)
ALIGNED = [["tt.divisibility", 16]]
for world, double in ((2, False), (2, True), (3, False), (4, False), (8, True)):
    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "bufs": ("*bf16",) * world, "pad_ptrs": "*u64", "epochs": "*i32",
           "numel": "i32", "half": "i32", "RANK": "constexpr", "W": "constexpr", "WP": "constexpr",
           "BLOCK": "constexpr", "DOUBLE": "constexpr"}
    attrs = {(0,): ALIGNED, (1,): ALIGNED, (4,): ALIGNED, (5,): ALIGNED, (6,): ALIGNED}
    attrs |= {(2, r): ALIGNED for r in range(world)}
    consts = {"RANK": 1, "W": world, "WP": triton.next_power_of_2(world), "BLOCK": 4096, "DOUBLE": double}
    src = ASTSource(par._peer_all_reduce_kernel, sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
    ptx = k.asm["ptx"]
    print(f"world {world}, double buffer {double}: 16-byte loads {ptx.count('ld.global.v4')} of "
          f"{ptx.count('ld.global')}, 16-byte stores {ptx.count('st.global.v4')}, "
          f"system-scope atomics {ptx.count('.sys.')}, shared bytes {k.metadata.shared}")
