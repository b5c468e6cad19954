"""DeepSeek pieces beyond the end-to-end HF parity of test_hf_equivalence: routing against
transformers' routers, the latent cache's size, short queries (MTP verification) as decode rows,
and the MTP draft layers against the formula computed with transformers' own decoder layer."""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RotaryEmbedding,
    DeepseekV3TopkRouter,
)

from atom.config import Config, ModelConfig
from atom.distributed.parallel_state import SINGLE
from atom.forward_context import AttentionMetadata, set_forward_context
from atom.layers.mla import SHORT_QUERY, MLAAttention, causal_rows, latent_attention
from atom.models.deepseek_mtp import DeepseekMTP
from atom.ops.reference import grouped_topk
from atom.spec_decode.mtp_loader import load_mtp
from atom.worker.model_runner import ModelRunner


def _sorted(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def test_v3_routing_matches_transformers():
    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    router.weight.data.normal_()
    router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(50, 16)
    _, ref_w, ref_ids = router(x)
    w, ids = grouped_topk(router(x)[0], 3, "sigmoid", 4, 2, router.e_score_correction_bias, True, 2.5)
    torch.testing.assert_close(_sorted(w, ids), _sorted(ref_w, ref_ids))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_matches_transformers(method):
    torch.manual_seed(0)
    cfg = DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=12, num_experts_per_tok=3,
                           n_group=4, topk_group=2, topk_method=method, routed_scaling_factor=1.5)
    router = DeepseekV2TopkRouter(cfg)
    router.weight.data.normal_()
    x = torch.randn(50, 16)
    logits, ref_w, ref_ids = router(x)
    groups = 4 if method == "group_limited_greedy" else 1
    w, ids = grouped_topk(logits, 3, "softmax", groups, 2, None, False, 1.5)
    torch.testing.assert_close(_sorted(w, ids), _sorted(ref_w, ref_ids))


def test_latent_cache_holds_one_row_per_token(tiny_model):
    path = tiny_model("deepseek_v3")
    hf = AutoConfig.from_pretrained(path)
    runner = ModelRunner(Config(ModelConfig(path, hf, torch.float32, 256, path)))
    layers = [m for m in runner.model.modules() if isinstance(m, MLAAttention)]
    assert len(layers) == hf.num_hidden_layers == len(runner.attn_layers)  # the MTP layer is not the model's
    latent = hf.kv_lora_rank + hf.qk_rope_head_dim
    assert runner.block_bytes() == hf.num_hidden_layers * runner.block_size * latent * 4
    runner.allocate_kv_cache(3)
    assert layers[0].kv_cache.shape == (3, runner.block_size, latent)


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def mtp_reference(path, ids, positions, prev):
    """The MTP formula with transformers' DeepseekV3DecoderLayer for the decoder block."""
    cfg = AutoConfig.from_pretrained(path)
    cfg._attn_implementation = "eager"
    n = cfg.num_hidden_layers
    w = load_file(os.path.join(path, "mtp.safetensors"))
    embed = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"]
    pre = f"model.layers.{n}."
    mine = {k[len(pre) :]: v for k, v in w.items() if k.startswith(pre)}
    experts = range(cfg.n_routed_experts)
    mtp_only = ("enorm", "hnorm", "eh_proj", "shared_head")
    state = {k: v for k, v in mine.items() if ".experts." not in k and not k.startswith(mtp_only)}
    gate_up = [torch.cat((mine[f"mlp.experts.{e}.gate_proj.weight"], mine[f"mlp.experts.{e}.up_proj.weight"]))
               for e in experts]  # fmt: skip
    state["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    state["mlp.experts.down_proj"] = torch.stack([mine[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    layer = DeepseekV3DecoderLayer(cfg, n)
    layer.load_state_dict(state, strict=True)
    eps = cfg.rms_norm_eps
    e = embed[ids] * (positions != 0).unsqueeze(-1)
    x = torch.cat((_rms(e, mine["enorm.weight"], eps), _rms(prev, mine["hnorm.weight"], eps)), -1)
    x = (x @ mine["eh_proj.weight"].t()).unsqueeze(0)
    cos_sin = DeepseekV3RotaryEmbedding(cfg)(x, positions.unsqueeze(0))
    mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        h = layer(x, attention_mask=mask, position_ids=positions.unsqueeze(0), position_embeddings=cos_sin)[0]
    logits = _rms(h, mine["shared_head.norm.weight"], eps) @ mine["shared_head.head.weight"].t()
    return h, logits


def _meta(q_lens, seq_lens, slots, num_decodes=0, width=2):
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(width, dtype=torch.int32).repeat(len(q_lens), 1),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), num_decode_tokens=num_decodes,
    )


@torch.inference_mode()
def test_mtp_layer_loads_and_matches_the_formula(tiny_model):
    path = tiny_model("deepseek_v3")
    hf = AutoConfig.from_pretrained(path)
    mtp = load_mtp(ModelConfig(path, hf, torch.float32, 256, path), None, torch.device("cpu"), SINGLE)
    torch.manual_seed(0)
    num = 9
    ids, positions = torch.randint(0, hf.vocab_size, (num,)), torch.arange(num)
    prev = torch.randn(num, hf.hidden_size)
    ref_h, ref_logits = mtp_reference(path, ids, positions, prev)
    attn = [m for m in mtp.modules() if isinstance(m, MLAAttention)]
    layers = {a.prefix: a for a in attn}
    assert list(layers) == [f"model.layers.{hf.num_hidden_layers}.self_attn.attn"]
    # without a cache (one prompt), then through the paged latent cache: a prompt chunk of
    # num - 1 tokens and one decode step (the absorbed path)
    with set_forward_context(_meta([num], [num], [-1] * num), positions, layers):
        h = mtp(ids, positions, prev)
    torch.testing.assert_close(h, ref_h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mtp.compute_logits(h), ref_logits, atol=1e-4, rtol=1e-4)
    attn[0].bind_kv_cache(torch.zeros(2, 8, hf.kv_lora_rank + hf.qk_rope_head_dim))
    with set_forward_context(_meta([num - 1], [num - 1], list(range(num - 1))), positions[:-1], layers):
        h_prompt = mtp(ids[:-1], positions[:-1], prev[:-1])
    with set_forward_context(_meta([1], [num], [num - 1], num_decodes=1), positions[-1:], layers):
        h_decode = mtp(ids[-1:], positions[-1:], prev[-1:])
    torch.testing.assert_close(torch.cat((h_prompt, h_decode)), ref_h, atol=1e-4, rtol=1e-4)


def test_mtp_needs_next_n_layers(tiny_model):
    hf = AutoConfig.from_pretrained(tiny_model("deepseek_v3"))
    hf.num_nextn_predict_layers = 0
    with pytest.raises(ValueError, match="no MTP layers"):
        DeepseekMTP(hf)


def _latent_batch(q_lens: list[int], earlier: list[int]):
    """A batch over a random latent cache: sequence ``i`` brings ``q_lens[i]`` rows after
    ``earlier[i]`` (0: a whole prompt); ``latent_attention``'s leading arguments, and each row's
    position and sequence."""
    heads, nope, rope, rank, v_dim, block_size = 4, 16, 8, 32, 12, 4
    seq_lens = [len_q + extra for len_q, extra in zip(q_lens, earlier)]
    max_blocks = -(-max(seq_lens) // block_size)
    num_decodes = sum(1 for n in q_lens[:1] if n == 1)
    cache = torch.randn(len(q_lens) * max_blocks, block_size, rank + rope)
    tables = torch.randperm(len(cache)).view(len(q_lens), max_blocks).int()
    cu = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    # this step's rows: the cache's rows at the sequences' last positions (already written)
    positions = [p for n, total in zip(q_lens, seq_lens) for p in range(total - n, total)]
    seqs = [i for i, n in enumerate(q_lens) for _ in range(n)]
    latents = torch.stack([cache[tables[i, p // block_size], p % block_size] for i, p in zip(seqs, positions)])
    q = torch.randn(len(seqs), heads, nope + rope)
    w = torch.randn(heads * (nope + v_dim), rank) * 0.2
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (q, latents[:, :rank], latents[:, rank:], cache, cu, lens, tables, num_decodes, w, 0.3, v_dim)
    return args, positions, seqs


@pytest.mark.parametrize("q_lens", [[1, 3, 2, 4], [2, 2], [SHORT_QUERY, 1]])
def test_short_queries_run_as_decode_rows(q_lens):
    """Sequences bringing at most SHORT_QUERY rows (MTP's K + 1) attend as absorbed decode rows
    over their causal prefix of the cache: the prompt path's output (latents expanded per head),
    in float32, for a batch with and without a decode row first, one sequence all new rows."""
    torch.manual_seed(0)
    args, positions, seqs = _latent_batch(q_lens, [4, 6, 0, 9])
    cu, lens, tables = args[4:7]
    short = latent_attention(*args, max_query_len=max(q_lens))
    torch.testing.assert_close(short, latent_attention(*args), rtol=1e-5, atol=1e-5)  # the prompt path
    row_lens, row_tables = causal_rows(cu, lens, tables, len(seqs))
    assert row_lens.tolist() == [p + 1 for p in positions] and torch.equal(row_tables, tables[seqs])


@pytest.mark.parametrize("q_lens, earlier", [([1, 13, 20, 9], [6, 5, 0, 0]), ([12, 1], [0, 3]), ([10, 11], [7, 30])])
def test_prompt_rows_take_host_lengths(q_lens, earlier):
    """The runner's host copies of cu_seqlens_q and seq_lens (``host_lens``, what keeps the
    prompt rows from syncing with the device) give the output the device tensors give: decode
    rows first or not, whole prompts and chunks after earlier rows in one batch."""
    torch.manual_seed(1)
    args, _, _ = _latent_batch(q_lens, earlier)
    cu, lens = args[4], args[5]
    host = (cu.tolist(), lens.tolist())
    torch.testing.assert_close(latent_attention(*args, max_query_len=max(q_lens), host_lens=host),
                               latent_attention(*args, max_query_len=max(q_lens)), rtol=0, atol=0)  # fmt: skip


@pytest.mark.parametrize("num_shared", [1, 2])
def test_shared_experts_inside_the_moe_and_dense_agree(num_shared, monkeypatch):
    """The shared experts as the fused MoE's last experts (small batches) and as a dense MLP on
    the same slots (large ones) both give routed experts + the shared MLP, in float32, against
    transformers' DeepseekV2MLP holding the checkpoint's shared tensors."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP

    from atom.models import deepseek_v2

    torch.manual_seed(num_shared)
    hidden, inter, experts = 32, 16, 8
    cfg = DeepseekV2Config(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                           num_experts_per_tok=3, n_shared_experts=num_shared, n_group=1, topk_group=1,
                           routed_scaling_factor=1.5, norm_topk_prob=False)  # fmt: skip
    moe = deepseek_v2.DeepseekMoE(cfg, SINGLE, "greedy")
    assert moe.shared_experts is None and moe.experts.num_shared == num_shared
    shared = DeepseekV2MLP(cfg, intermediate_size=inter * num_shared)
    for p in (*moe.parameters(), *shared.parameters()):
        torch.nn.init.normal_(p, std=0.3)
    mapping = {f: (p, e, s) for p, f, e, s in moe.experts.expert_mapping(experts, num_shared=num_shared)}
    for name in ("gate_proj", "up_proj", "down_proj"):
        param, expert, shard = mapping[f"shared_experts.{name}.weight"]
        moe.experts.weight_loader(getattr(moe.experts, param.split(".")[-1]), getattr(shared, name).weight.data,
                                  shard, expert)  # fmt: skip
    x = torch.randn(20, hidden)
    weights, ids = grouped_topk(moe.gate(x), 3, "softmax", 1, 1, None, False, 1.5)
    routed = deepseek_v2.ops.fused_moe(x, moe.experts.w13_weight[:experts], moe.experts.w2_weight[:experts],
                                       weights, ids)  # fmt: skip
    expect = routed + shared(x)
    monkeypatch.setattr(deepseek_v2, "FUSED_SHARED_MAX_TOKENS", 64)
    torch.testing.assert_close(moe(x), expect, rtol=1e-5, atol=1e-5)  # inside the MoE launch
    monkeypatch.setattr(deepseek_v2, "FUSED_SHARED_MAX_TOKENS", 8)
    torch.testing.assert_close(moe(x), expect, rtol=1e-5, atol=1e-5)  # a dense MLP
