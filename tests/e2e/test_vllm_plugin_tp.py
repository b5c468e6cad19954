"""atom's vLLM plugin under vLLM's own tensor parallelism (``tensor_parallel_size=2``), on the
CPU build of vLLM: two worker processes per ``vllm.LLM``, atom's layers sharded and reduced
through vLLM's process groups (its CPU communicator). Greedy float32 output must equal atom's
own one-rank ``LLMEngine`` token for token: Qwen3; Qwen3-MoE with every expert sliced over both
ranks; Qwen3-MoE with ``enable_expert_parallel=True`` (three whole experts per rank). Each
rank reports the shapes of its shards, so a run that silently kept the whole model on every
rank fails too. (vLLM's own ``-tp 2``, plugin off, gives the same Qwen3 tokens: docs/plugin.md;
it is not rerun here to keep the file's runtime down.)

vLLM's automatic OpenMP binding wants one NUMA node per rank; this machine (and CI) has one, so
the runs set ``VLLM_CPU_OMP_THREADS_BIND=nobind``.

    .venv-vllm/bin/python -m pytest tests/e2e/test_vllm_plugin_tp.py
"""

from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest
from test_vllm_plugin import (  # noqa: F401 (ckpts, engines: fixtures)
    MAX_TOKENS,
    OFFLINE_PROMPTS,
    START_TIMEOUT_S,
    Proc,
    _engine_greedy,
    _env,
    ckpts,
    engines,
    needs_vllm,
)

pytestmark = needs_vllm
# the engine core in the script's process (one process start less); the two ranks are its workers
TP_ENV = dict(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")

# One process, one vllm.LLM per (checkpoint, expert parallel) in turn; each rank reports how
# atom's layers were cut.
SCRIPT = textwrap.dedent("""
    import gc, json, sys
    from vllm import LLM, SamplingParams

    def shards(worker):  # runs on each rank (collective_rpc sends it by value)
        model = worker.get_model()
        layer = model.model.layers[0]
        experts = getattr(layer.mlp, "experts", None)
        return {"class": type(model).__name__, "rank": layer.self_attn.qkv_proj.tp.rank,
                "qkv": list(layer.self_attn.qkv_proj.weight.shape),
                "experts": None if experts is None else [experts.local_experts.start, experts.local_experts.stop],
                "w13": None if experts is None else list(experts.w13_weight.shape)}

    def main():
        out_path, prompts, max_tokens, *runs = sys.argv[1:]
        sp = SamplingParams(temperature=0, max_tokens=int(max_tokens))
        result = {}
        for run in runs:
            model, ep = run.split("|")
            llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8,
                      max_num_batched_tokens=128, kv_cache_memory_bytes=1 << 26, tensor_parallel_size=2,
                      enable_expert_parallel=ep == "ep")
            outs = llm.generate(json.loads(prompts), sp, use_tqdm=False)
            result[run] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                           "shards": llm.collective_rpc(shards)}
            del llm
            gc.collect()
        with open(out_path, "w") as f:
            json.dump(result, f)

    if __name__ == "__main__":
        main()
""")


@pytest.fixture(scope="module")
def tp_run(ckpts, tmp_path_factory):  # noqa: F811
    """The vLLM process, started at once: the tests build their LLMEngine references meanwhile."""
    logs = tmp_path_factory.mktemp("vllm-plugin-tp-logs")
    proc = Proc("tp2_atom", [sys.executable, "-c", SCRIPT, str(logs / "tp2_atom.json"), json.dumps(OFFLINE_PROMPTS),
                             str(MAX_TOKENS), f"{ckpts['qwen3']}|tp", f"{ckpts['qwen3_moe']}|tp",
                             f"{ckpts['qwen3_moe']}|ep"], _env(**TP_ENV), logs)
    proc.deadline = time.time() + START_TIMEOUT_S
    yield proc
    proc.stop()


def _result(proc: Proc, run: str) -> dict:
    proc.wait_exit(proc.deadline)
    with open(proc.log_path.with_suffix(".json")) as f:
        return json.load(f)[run]


def test_qwen3_tp2_matches_llm_engine(tp_run, ckpts, engines):  # noqa: F811
    reference = _engine_greedy(engines("qwen3"), OFFLINE_PROMPTS)
    assert all(reference)
    ours = _result(tp_run, f"{ckpts['qwen3']}|tp")
    assert ours["tokens"] == reference
    # atom's layers really are split: 6 query + 2 KV heads of 32 become 3 + 1 per rank
    assert [(s["class"], s["rank"], s["qkv"]) for s in ours["shards"]] == [
        ("ATOMQwen3ForCausalLM", rank, [(3 + 1 + 1) * 32, 72]) for rank in (0, 1)]


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_qwen3_moe_tp2_matches_llm_engine(tp_run, ckpts, engines, mode):  # noqa: F811
    reference = _engine_greedy(engines("qwen3_moe"), OFFLINE_PROMPTS)
    ours = _result(tp_run, f"{ckpts['qwen3_moe']}|{mode}")
    assert ours["tokens"] == reference
    # 6 experts of intermediate size 40: sliced in halves over both ranks, or 3 whole ones per rank
    expected = {"tp": [([0, 6], [6, 40, 72])] * 2, "ep": [([0, 3], [3, 80, 72]), ([3, 6], [3, 80, 72])]}[mode]
    assert [(s["experts"], s["w13"]) for s in ours["shards"]] == expected
    assert "atom model ATOMQwen3MoeForCausalLM (atom.models.qwen3_moe) built for vLLM" in tp_run.log()


def vllm_config_stub(parallel, hf_config=None, max_model_len: int = 512):
    """The parts of a ``VllmConfig`` that ``check_supported`` reads."""
    from types import SimpleNamespace

    model = SimpleNamespace(hf_config=hf_config or SimpleNamespace(), quantization=None, max_model_len=max_model_len)
    return SimpleNamespace(model_config=model, parallel_config=parallel, quant_config=None, lora_config=None)


@pytest.mark.parametrize("max_model_len", [4096, 4097])
def test_sliding_window_within_the_window_only(max_model_len):
    """A Mistral-style window: atom's full attention serves up to the window's length, and
    says why it refuses beyond it."""
    from types import SimpleNamespace

    from transformers import MistralConfig

    from atom.plugin.vllm.model_wrapper import check_supported

    parallel = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1)
    config = vllm_config_stub(parallel, MistralConfig(sliding_window=4096), max_model_len)
    if max_model_len == 4096:
        check_supported(config, "MistralForCausalLM")
        return
    with pytest.raises(NotImplementedError, match="sliding-window attention beyond its 4096-token window"):
        check_supported(config, "MistralForCausalLM")


@pytest.mark.parametrize("data_parallel_size", [1, 2])
def test_expert_parallel_with_data_parallel_warns(data_parallel_size):
    """atom's expert group is the tensor-parallel group: with -dp 2 as well that differs from
    vLLM's placement over all DP x TP ranks, and the log says so."""
    import logging
    from types import SimpleNamespace

    from atom.plugin.vllm.model_wrapper import check_supported

    parallel = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=2, data_parallel_size=data_parallel_size,
                               enable_expert_parallel=True)
    config = vllm_config_stub(parallel)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger("vllm.atom_plugin")
    log.addHandler(handler)
    try:
        check_supported(config, "Qwen3MoeForCausalLM")
    finally:
        log.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    if data_parallel_size == 1:
        assert messages == []
    else:
        assert messages == ["atom's Qwen3MoeForCausalLM places experts over each data-parallel replica's "
                            "tensor-parallel group (vLLM's own MoE layers would spread them over all 4 ranks)"]
