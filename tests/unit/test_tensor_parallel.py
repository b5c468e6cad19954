"""Tensor and expert parallelism on the CPU with 2 real gloo ranks: every rank loads only its
shards, and the logits of a prefill plus a decode step over the paged KV cache equal one
rank's (float32). The executor that owns the rank processes leaves no orphans when a rank
dies or its parent is killed (SIGKILL, SIGTERM)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from executor_workers import EchoWorker
from transformers import AutoConfig

from atom import ops
from atom.config import ModelConfig
from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.forward_context import AttentionMetadata, set_forward_context
from atom.layers.attention import Attention
from atom.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from atom.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from atom.layers.moe import FusedMoE
from atom.model_loader.checkpoint_slice import CheckpointSlice
from atom.model_loader.loader import load_model
from atom.testing.tiny_checkpoint import build
from atom.worker.executor import MultiprocExecutor, RankFailure

BLOCK = 16
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 70)), [11, 12]]
RPC_TIMEOUT_S = 120


class ModelWorker:
    """What each rank runs in these tests: load a checkpoint (its shards only), then prefill
    and decode a batch over its own slice of the KV cache."""

    def __init__(self, tp: TPInfo):
        self.tp = tp
        self.model = None

    def load(self, path: str, expert_parallel: bool = False) -> dict[str, tuple[int, ...]]:
        torch.manual_seed(0)
        ops.init_device_ops(torch.device("cpu"))
        hf = AutoConfig.from_pretrained(path)
        mc = ModelConfig(path, hf, torch.float32, 256, path)
        self.model = load_model(mc, torch.device("cpu"), dataclasses.replace(self.tp, expert_parallel=expert_parallel))
        return {name: tuple(p.shape) for name, p in self.model.named_parameters()}

    def kv_heads(self) -> list[int]:
        return [m.num_kv_heads for m in self.model.modules() if isinstance(m, Attention)]

    def prefill_decode(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Also whether every rank got bitwise the same logits (so every rank may sample)."""
        prefill, decode = run_prefill_decode(self.model, prompts)
        everyone = self.tp.all_gather(torch.cat([prefill, decode])[None], dim=0)
        return prefill, decode, bool((everyone == everyone[0]).all())

    def vocab_parallel(self, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_outputs(self.tp, vocab, dim)


@torch.inference_mode()
def run_prefill_decode(model, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """All prompts in one prefill batch (logits of every token), then one greedy decode step
    per sequence (its logits), the way the model runner fills the forward context."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    blocks_per_seq = -(-(max(map(len, prompts)) + 1) // BLOCK)
    for layer in layers:  # per-rank cache: [num_blocks, num_kv_heads on this rank, block, head_dim]
        shape = (len(prompts) * blocks_per_seq, layer.num_kv_heads, BLOCK, layer.head_dim)
        layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
    tables = torch.arange(len(prompts) * blocks_per_seq, dtype=torch.int32).view(len(prompts), blocks_per_seq)
    layer_map = {m.prefix: m for m in layers}

    def step(ids: list[int], pos: list[int], q_lens: list[int], seq_lens: list[int], decode: bool):
        positions = torch.tensor(pos)
        seq_of = [i for i, n in enumerate(q_lens) for _ in range(n)]
        slots = torch.tensor([int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK for s, p in zip(seq_of, pos)])
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        meta = AttentionMetadata(slots, cu, torch.tensor(seq_lens, dtype=torch.int32), tables, max(q_lens),
                                 max(seq_lens), len(q_lens) if decode else 0)
        with set_forward_context(meta, positions, layer_map):
            return model.compute_logits(model(torch.tensor(ids), positions))

    lens = [len(p) for p in prompts]
    prefill = step([t for p in prompts for t in p], [i for n in lens for i in range(n)], lens, lens, False)
    last = torch.tensor(lens).cumsum(0) - 1
    next_ids = prefill[last].argmax(-1).tolist()
    decode = step(next_ids, lens, [1] * len(prompts), [n + 1 for n in lens], True)
    return prefill, decode


def vocab_outputs(tp: TPInfo, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0))
    embed, head = VocabParallelEmbedding(vocab, dim, tp), ParallelLMHead(vocab, dim, tp)
    embed.weight_loader(embed.weight, table)
    head.weight_loader(head.weight, table)
    ids = torch.arange(vocab).flip(0)
    return embed(ids), head(torch.randn(3, dim, generator=torch.Generator().manual_seed(1)))


@pytest.fixture(scope="module")
def tp2():
    with MultiprocExecutor(2, ModelWorker, backend="gloo") as ex:
        yield ex


@pytest.fixture(scope="module")
def kv1_model(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("tiny-qwen3-kv1")), "qwen3", num_layers=2, num_kv_heads=1)


def one_rank(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    worker = ModelWorker(SINGLE)
    worker.load(path)
    return run_prefill_decode(worker.model, PROMPTS)


def check_same_logits(tp2, path: str) -> None:
    ref_prefill, ref_decode = one_rank(path)
    prefill, decode, same_on_all_ranks = tp2.collective_rpc("prefill_decode", PROMPTS, timeout_s=RPC_TIMEOUT_S)
    assert same_on_all_ranks
    for got, ref in ((prefill, ref_prefill), (decode, ref_decode)):
        # the all-reduce sums partial products in another order: float32 rounding only
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert prefill.shape[-1] == AutoConfig.from_pretrained(path).vocab_size


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_dense_tp2_matches_one_rank_and_loads_shards(tp2, tiny_model, arch):
    full = ModelWorker(SINGLE).load(tiny_model(arch))
    shapes = tp2.collective_rpc("load", tiny_model(arch), timeout_s=RPC_TIMEOUT_S)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert shapes[qkv][0] * 2 == full[qkv][0]  # 6 q heads, 2 kv heads -> 3 q + 1 kv per rank
    assert shapes["model.layers.0.self_attn.o_proj.weight"][1] * 2 == full["model.layers.0.self_attn.o_proj.weight"][1]
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"][0] * 2 == full["model.layers.0.mlp.gate_up_proj.weight"][0]
    assert shapes["model.embed_tokens.weight"][0] * 2 == full["model.embed_tokens.weight"][0]
    assert tp2.collective_rpc("kv_heads") == [1] * 3  # each of 3 layers caches 1 of the 2 KV heads
    check_same_logits(tp2, tiny_model(arch))


def test_fewer_kv_heads_than_ranks_replicates_them(tp2, kv1_model):
    shapes = tp2.collective_rpc("load", kv1_model, timeout_s=RPC_TIMEOUT_S)
    head_dim = 24
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"][0] == (3 + 2 * 1) * head_dim
    assert tp2.collective_rpc("kv_heads") == [1] * 2  # per layer: the one KV head, on both ranks
    check_same_logits(tp2, kv1_model)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_tp2_and_expert_parallel_match_one_rank(tp2, tiny_model, expert_parallel):
    shapes = tp2.collective_rpc("load", tiny_model("qwen3_moe"), expert_parallel, timeout_s=RPC_TIMEOUT_S)
    w13 = shapes["model.layers.0.mlp.experts.w13_weight"]
    # 6 experts, moe_intermediate_size 40, hidden 72: EP keeps 3 whole experts, TP halves all 6
    assert w13 == ((3, 80, 72) if expert_parallel else (6, 40, 72))
    check_same_logits(tp2, tiny_model("qwen3_moe"))


@pytest.mark.parametrize("vocab", [7, 8])
def test_vocab_parallel_embedding_and_head_uneven_split(tp2, vocab):
    embedded, logits = tp2.collective_rpc("vocab_parallel", vocab, 4)
    ref_embedded, ref_logits = vocab_outputs(SINGLE, vocab, 4)
    assert logits.shape == (3, vocab)
    torch.testing.assert_close(embedded, ref_embedded, rtol=0, atol=0)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-6)


class RecordingSource:
    """A stand-in for a safetensors slice handle that records what is read."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.reads = tensor, []

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        self.reads.append(index)
        return self.tensor[index]


def test_ranks_read_only_their_shards_of_the_checkpoint():
    tp = TPInfo(1, 2, expert_parallel=True)  # rank 1 of 2: no collective runs here
    moe = FusedMoE(4, 2, hidden_size=6, intermediate_size=8, renormalize=True, tp=tp)
    other, mine = RecordingSource(torch.randn(8, 6)), RecordingSource(torch.randn(8, 6))
    moe.weight_loader(moe.w13_weight, CheckpointSlice(other), "w1", expert_id=0)
    moe.weight_loader(moe.w13_weight, CheckpointSlice(mine), "w1", expert_id=3)
    assert other.reads == []  # rank 0's expert: never read
    assert torch.equal(moe.w13_weight[1, :8], mine.tensor)
    row = RowParallelLinear(8, 5, tp=tp)
    source = RecordingSource(torch.randn(5, 8))
    row.weight_loader(row.weight, CheckpointSlice(source))
    assert source.reads == [(slice(0, 5), slice(4, 8))]
    assert torch.equal(row.weight, source.tensor[:, 4:])
    embed = VocabParallelEmbedding(7, 3, tp)
    source = RecordingSource(torch.randn(7, 3))
    embed.weight_loader(embed.weight, CheckpointSlice(source))
    assert source.reads == [(slice(4, 7), slice(0, 3))]
    assert torch.equal(embed.weight[:3], source.tensor[4:]) and not embed.weight[3].any()


# executor lifetime
def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_rank_crash_raises_and_stops_every_rank():
    ex = MultiprocExecutor(2, EchoWorker, backend="gloo")
    pids = ex.pids
    assert ex.collective_rpc("pid") == pids[0]  # rank 0's answer
    os.kill(pids[1], signal.SIGKILL)
    assert wait_gone(pids[1:]) == []  # dead (a zombie until the executor reaps it)
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) died with exit code -9"):
        ex.collective_rpc("pid", timeout_s=RPC_TIMEOUT_S)
    assert wait_gone(pids) == []
    with pytest.raises(RankFailure, match="shut down"):
        ex.collective_rpc("pid")


def test_a_dead_rank_is_the_reported_cause_of_its_peers_errors():
    # a killed rank breaks its peers' collectives; whichever reply comes first, the death is reported
    ex = MultiprocExecutor(2, EchoWorker, backend="gloo")
    pids = ex.pids
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) died with exit code 9"):
        ex.collective_rpc("fail_as_peer_dies", timeout_s=RPC_TIMEOUT_S)
    assert wait_gone(pids) == []


def test_rank_exception_raises_its_traceback_and_stops_every_rank():
    ex = MultiprocExecutor(2, EchoWorker, backend="gloo")
    pids = ex.pids
    with pytest.raises(RankFailure, match="(?s)rank ([01]) raised.*bad request on rank \\1"):
        ex.collective_rpc("fail", timeout_s=RPC_TIMEOUT_S)
    assert wait_gone(pids) == []


def test_ranks_log_at_the_parents_level(capfd):
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        with MultiprocExecutor(2, EchoWorker, backend="gloo") as ex:
            ex.collective_rpc("log", "a rank's message", timeout_s=RPC_TIMEOUT_S)
    finally:
        root.setLevel(level)
    err = capfd.readouterr().err
    assert "INFO [rank 0] atom.test: a rank's message" in err and "INFO [rank 1] atom.test: a rank's message" in err


def test_posted_calls_run_in_order_and_their_failure_surfaces_at_the_next_call():
    ex = MultiprocExecutor(2, EchoWorker, backend="gloo")
    pids = ex.pids
    for value in range(3):
        ex.post("store", value)
    assert ex.collective_rpc("get", timeout_s=RPC_TIMEOUT_S) == [0, 1, 2]  # no answers were left queued
    ex.post("fail")
    with pytest.raises(RankFailure, match="(?s)rank ([01]) raised.*bad request on rank \\1"):
        ex.collective_rpc("get", timeout_s=RPC_TIMEOUT_S)
    assert wait_gone(pids) == []


PARENT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {test_dir!r})
    from executor_workers import EchoWorker
    from atom.worker.executor import MultiprocExecutor

    if __name__ == "__main__":
        ex = MultiprocExecutor(2, EchoWorker, backend="gloo")
        print(*ex.pids, flush=True)
        sys.stdin.read()  # until killed
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_parent_killed_leaves_no_orphans(tmp_path, sig):
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(test_dir=os.path.dirname(__file__)))
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(10)
        assert wait_gone(pids) == []
    finally:
        parent.kill()


@pytest.mark.parametrize("size", [1, 2, 4])
def test_merged_linear_replicated_part_is_whole_on_every_rank(size):
    """DeepSeek's fused_qkv_a_proj: the head-split query rows (this rank's slice) and the
    replicated latent rows (all of them) in one matrix, on every rank; the rank's output is its
    query slice beside the whole latent projection."""
    q, latent = torch.randn(8 * 6, 10), torch.randn(5, 10)
    x = torch.randn(3, 10)
    for rank in range(size):
        layer = MergedColumnParallelLinear(10, [48, 5], tp=TPInfo(rank, size), replicated=(False, True))
        layer.weight.weight_loader(layer.weight, q, 0)
        layer.weight.weight_loader(layer.weight, latent, 1)
        rows = 48 // size
        assert layer.weight.shape == (rows + 5, 10) and layer.rank_sizes == [rows, 5]
        assert torch.equal(layer.weight, torch.cat((q[rank * rows : (rank + 1) * rows], latent)))
        assert torch.equal(layer(x), x @ layer.weight.t())
    with pytest.raises(ValueError, match="not divisible"):
        MergedColumnParallelLinear(10, [49, 5], tp=TPInfo(0, 2), replicated=(False, True))
