"""``import atom`` and plain generation need no xgrammar: on a machine where it is missing, or where
its build fails while importing, only a structured-output request fails, with a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    if sys.argv[2] == "missing":
        sys.modules["xgrammar"] = None  # `import xgrammar` raises ImportError
    import atom
    from atom import LLMEngine, SamplingParams, StructuredOutputsParams

    assert sys.modules.get("xgrammar") is None, "import atom imported xgrammar"
    engine = LLMEngine(sys.argv[1], dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=8 << 20)
    out = engine.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out["num_tokens_output"] == 4, out
    constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    try:
        engine.generate(["hello"], constrained, use_tqdm=False)
    except ValueError as error:
        print("REFUSED:", error)
    again = engine.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert again["token_ids"] == out["token_ids"], (again, out)  # the engine keeps serving
    """
)


@pytest.mark.parametrize("how", ["missing", "broken"])
def test_plain_generation_without_xgrammar(tiny_model, tmp_path, how):
    env = dict(os.environ)
    if how == "broken":  # an xgrammar whose import fails as a build against another torch does
        (tmp_path / "xgrammar").mkdir()
        (tmp_path / "xgrammar" / "__init__.py").write_text("raise OSError('libxgrammar.so: undefined symbol')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_model("qwen3"), how], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    refused = [line for line in run.stdout.splitlines() if line.startswith("REFUSED:")]
    assert len(refused) == 1, run.stdout
    assert "Structured output needs the xgrammar package" in refused[0]
    assert ("ModuleNotFoundError" if how == "missing" else "OSError: libxgrammar.so") in refused[0]
