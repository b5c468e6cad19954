"""FP8 weights on the CPU (reference ops): tiny checkpoints written in each FP8 format load
and give the logits of the float32 model holding the same weights dequantised, and
``--quantization fp8`` on a float checkpoint agrees with the unquantised model.

Two checks per format. Loading: with the GEMMs computed from the dequantised weights and
unquantised inputs, the logits equal the dequantised model's to float32 rounding (1e-5).
The FP8 path: the GEMM inputs are quantised to e4m3 too (3 mantissa bits), which on this
deliberately sharp tiny model moves the logits by 12-14% (relative L2 norm; measured), and
by 17-18% with MoE, where the noise also flips some expert choices; we allow 16% (dense) and
20% (MoE), and ask for the same top-1 token on at least 90% of the positions where the
reference's margin exceeds 1.0 (dense: all of them)."""

import json

import pytest
import torch

from atom import LLMEngine, SamplingParams
from atom.engine.arg_utils import EngineArgs
from atom.forward_context import AttentionMetadata, set_forward_context
from atom.layers.attention import Attention
from atom.layers.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod
from atom.model_loader.loader import load_model
from atom.ops import reference, reference_fp8
from atom.testing.agreement import teacher_forced_agreement
from atom.testing.fp8_checkpoint import FORMATS, write
from atom.testing.tiny_checkpoint import build

FP8 = torch.float8_e4m3fn
IDS = torch.randint(3, 380, (48,), generator=torch.Generator().manual_seed(0))


def prompt_logits(path: str, **kwargs) -> tuple[torch.Tensor, torch.nn.Module]:
    """Logits of every position of ``IDS`` (one prompt, no KV cache)."""
    config = EngineArgs(model=path, max_model_len=64, device="cpu", **kwargs).create_engine_config()
    model = load_model(config.model_config, torch.device("cpu"))
    n = len(IDS)
    meta = AttentionMetadata(slot_mapping=torch.full((n,), -1), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.zeros(1, 1, dtype=torch.int32), max_seqlen_q=n, max_seqlen_k=n)
    layers = {m.prefix: m for m in model.modules() if isinstance(m, Attention)}
    positions = torch.arange(n)
    with torch.inference_mode(), set_forward_context(meta, positions, layers):
        return model.compute_logits(model(IDS, positions)).float(), model


def _dequantized_linear(self, layer, x, bias, x_q=None):
    w = reference_fp8.dequantize(layer.weight, getattr(layer, self.config.scale_name), self.group_k)
    return torch.nn.functional.linear(x, w.to(x.dtype), bias)


def _dequantize_linears(monkeypatch) -> None:
    """The FP8 linear layers (and the gate / up pairs' one op) as float linears over the dequantized weights."""
    monkeypatch.setattr(Fp8LinearMethod, "apply", _dequantized_linear)
    monkeypatch.setattr(Fp8LinearMethod, "apply_gated",
                        lambda self, layer, x, bias, x_q=None: reference.silu_and_mul(
                            _dequantized_linear(self, layer, x, bias)))


def _dequantized_moe(self, moe, x, weights, ids):
    s13, s2 = (getattr(moe, n) for n in self._names())
    w13, w2 = (torch.stack([reference_fp8.dequantize(w[e], s[e], self.group_k) for e in range(w.shape[0])])
               for w, s in ((moe.w13_weight, s13), (moe.w2_weight, s2)))
    return reference.fused_moe(x, w13.to(x.dtype), w2.to(x.dtype), weights, ids)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_matches_dequantized(tiny_model, tmp_path, fmt, arch):
    path = write(tiny_model(arch), str(tmp_path / "fp8"), fmt, str(tmp_path / "deq"), block=32)
    logits, model = prompt_logits(path)
    ref, _ = prompt_logits(str(tmp_path / "deq"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.quant_method is not None
    if arch == "qwen3_moe":
        assert model.model.layers[0].mlp.experts.w13_weight.dtype == FP8
    assert model.lm_head.weight.dtype == torch.float32  # the LM head stays unquantised
    assert relative_error(logits, ref) <= (0.2 if arch == "qwen3_moe" else 0.16)
    top2 = ref.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1.0
    assert clear.sum() >= 10
    agree = (logits.argmax(-1)[clear] == ref.argmax(-1)[clear]).float().mean().item()
    assert agree >= (0.9 if arch == "qwen3_moe" else 1.0)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_loads_exact_weights(tiny_model, tmp_path, fmt, arch, monkeypatch):
    path = write(tiny_model(arch), str(tmp_path / "fp8"), fmt, str(tmp_path / "deq"), block=32)
    _dequantize_linears(monkeypatch)
    monkeypatch.setattr(Fp8MoEMethod, "apply", _dequantized_moe)
    logits, _ = prompt_logits(path)
    ref, _ = prompt_logits(str(tmp_path / "deq"))
    assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("fmt", ["block", "ct_block"])
def test_the_rms_norms_write_the_fp8_codes_of_qkv_and_gate_up(tmp_path, fmt, monkeypatch):
    # with block scales over whole groups of the hidden size, the RMS norms (with a residual: all but the first)
    # write qkv's and gate_up's e4m3 codes and scales and the layers read them instead of quantising their input
    # (fp8.NORM_WRITES_CODES): the logits of quantising in the layers
    from atom import ops
    from atom.layers.quantization import fp8

    src = build(str(tmp_path / "src"), "qwen3", hidden_size=64)
    path = write(src, str(tmp_path / "fp8"), fmt, str(tmp_path / "deq"), block=32)
    calls = []
    norm_fp8 = ops.fused_add_rms_norm_fp8
    monkeypatch.setattr(ops, "fused_add_rms_norm_fp8", lambda *args: calls.append(args[-1]) or norm_fp8(*args))
    monkeypatch.setattr(fp8, "NORM_WRITES_CODES", True)  # off by default (session 39: GPU warm-up stalled)
    logits, model = prompt_logits(path)
    layers = model.model.layers
    assert {(layer.self_attn.input_group, layer.mlp.input_group) for layer in layers} == {(32, 32)}
    assert calls == [32] * (2 * len(layers) - 1)
    monkeypatch.setattr(fp8, "NORM_WRITES_CODES", False)
    unfused, model = prompt_logits(path)
    assert {layer.mlp.input_group for layer in model.model.layers} == {0} and len(calls) == 2 * len(layers) - 1
    assert torch.equal(logits, unfused)


def test_quantization_fp8_on_load(tiny_model):
    path = tiny_model("qwen3")
    logits, model = prompt_logits(path, quantization="fp8")
    ref, _ = prompt_logits(path)
    assert model.model.layers[1].mlp.down_proj.weight.dtype == FP8
    assert model.model.layers[1].mlp.down_proj.weight_scale.shape == (72, 1)  # per output channel
    # weights rounded to e4m3 as well as the GEMM inputs: 19% measured
    assert relative_error(logits, ref) <= 0.25
    prompts = ["The quick brown fox", "Once upon a time, a small model learned to count: one, two,",
               "def add(a, b):", "Paged attention stores keys and values in"]
    fraction, positions = teacher_forced_agreement(LLMEngine(path, max_model_len=128),
                                                   LLMEngine(path, max_model_len=128, quantization="fp8"),
                                                   prompts, 12, min_margin=0.5)
    # most greedy tokens: 88% of the clear positions measured (weights and inputs in e4m3 on a
    # model whose logits are sharp by construction)
    assert positions >= 30 and fraction >= 0.8


def test_unsupported_quantization_is_refused(tiny_model, tmp_path):
    write(tiny_model("qwen3"), str(tmp_path / "fp8"), "channel", block=32)
    cfg_file = tmp_path / "fp8" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'awq' is not supported"):
        prompt_logits(str(tmp_path / "fp8"))


# DeepSeek-V3/R1 (block FP8, MLA with q_lora, MTP) and V2 (no q_lora): every linear layer of
# the decoder and MTP layers is FP8 in those checkpoints; MLA's kv_b_proj is dequantised to
# the model dtype after loading (MLA multiplies by its weight directly, as in vLLM).


def _check_deepseek_layers(model: torch.nn.Module) -> None:
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    # the first query projection and kv_a_proj_with_mqa are one fused_qkv_a_proj, FP8 checkpoint
    # or quantised on load (apart only where an ignore list names one of them)
    assert attn.fused
    for proj in [attn.fused_qkv_a_proj, attn.o_proj, *([attn.q_b_proj] if attn.q_lora_rank else [])]:
        assert proj.weight.dtype == FP8
    assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.kv_b_proj.quant_method is None
    assert moe.experts.w13_weight.dtype == FP8 and moe.experts.w2_weight.dtype == FP8
    # the shared experts are the fused MoE's last experts, except in block-FP8 checkpoints whose
    # scale groups would span two of them (the tiny models' 40 / 24 columns at 16-column blocks)
    if moe.shared_experts is not None:
        assert moe.shared_experts.gate_up_proj.weight.dtype == FP8 and moe.experts.num_shared == 0
    else:
        assert moe.experts.num_shared == moe.num_fused_shared > 0
    assert moe.gate.weight.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_deepseek_loads_exact_weights(tiny_model, tmp_path, fmt, arch, monkeypatch):
    path = write(tiny_model(arch), str(tmp_path / "fp8"), fmt, str(tmp_path / "deq"), block=16)
    _dequantize_linears(monkeypatch)
    monkeypatch.setattr(Fp8MoEMethod, "apply", _dequantized_moe)
    logits, model = prompt_logits(path)
    _check_deepseek_layers(model)
    ref, _ = prompt_logits(str(tmp_path / "deq"))
    assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("fmt", ["block", "ct_block"])
def test_fp8_deepseek_shared_experts_load_as_experts(tmp_path, fmt, arch, monkeypatch):
    """Block-FP8 shared experts whose intermediate size is whole scale groups (32 = 2 x 16) load
    as the fused MoE's last experts (V2's two: one checkpoint MLP split into two slots, its down
    projection's scale groups too), holding the checkpoint's weights; at 40 (V3's tiny default,
    2.5 groups) a group would span two slots and they stay an MLP of their own."""
    for inter, fused in ((32, True), (40, False)):
        src = build(str(tmp_path / f"src{inter}"), arch, moe_intermediate_size=inter)
        path = write(src, str(tmp_path / f"fp8{inter}"), fmt, str(tmp_path / f"deq{inter}"), block=16)
        _dequantize_linears(monkeypatch)
        monkeypatch.setattr(Fp8MoEMethod, "apply", _dequantized_moe)
        logits, model = prompt_logits(path)
        moe = model.model.layers[1].mlp
        assert (moe.shared_experts is None) == fused
        assert moe.experts.num_shared == (model.config.n_shared_experts if fused else 0)
        ref, _ = prompt_logits(str(tmp_path / f"deq{inter}"))
        assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("fmt", ["block", "ct_block"])
def test_fp8_deepseek_ignored_kv_a_stays_apart(tiny_model, tmp_path, fmt, monkeypatch):
    """A checkpoint whose ignore list leaves one layer's kv_a_proj_with_mqa in high precision:
    its first projections load apart in every layer (a fused layer is FP8 or not as a whole),
    the ignored one in float32, and the model holds the checkpoint's weights."""
    ignored = "model.layers.1.self_attn.kv_a_proj_with_mqa"
    path = write(tiny_model("deepseek_v3"), str(tmp_path / "fp8"), fmt, str(tmp_path / "deq"), block=16,
                 ignore=(ignored,))
    _dequantize_linears(monkeypatch)
    monkeypatch.setattr(Fp8MoEMethod, "apply", _dequantized_moe)
    logits, model = prompt_logits(path)
    attn = model.model.layers[1].self_attn
    assert not attn.fused and not model.model.layers[0].self_attn.fused
    assert attn.kv_a_proj_with_mqa.weight.dtype == torch.float32 and attn.q_a_proj.weight.dtype == FP8
    ref, _ = prompt_logits(str(tmp_path / "deq"))
    assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_fp8_deepseek_matches_dequantized(tmp_path, arch):
    """The whole FP8 path (GEMM inputs in e4m3 too). Each GEMM is as close to its float32
    result as Qwen3's (2.2% relative L2, measured), but the tiny DeepSeek models amplify it
    more: V3's sharp MLA scores (yarn's mscale) and sigmoid routing with its bias flip more.
    With the shared models (init 0.35) the logits move by 40% (V3) / 22% (V2); these are built
    narrower (init 0.2): 31% / 11% measured, with the same top-1 where the reference is clear."""
    src = build(str(tmp_path / "src"), arch, initializer_range=0.2)
    path = write(src, str(tmp_path / "fp8"), "block", str(tmp_path / "deq"), block=16)
    logits, model = prompt_logits(path)
    _check_deepseek_layers(model)
    ref, _ = prompt_logits(str(tmp_path / "deq"))
    assert relative_error(logits, ref) <= (0.4 if arch == "deepseek_v3" else 0.16)
    top2 = ref.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.5
    assert clear.sum() >= 10
    agree = (logits.argmax(-1)[clear] == ref.argmax(-1)[clear]).float().mean().item()
    assert agree >= 0.8


def test_fp8_deepseek_mtp_layer_loads_exact_weights(tiny_model, tmp_path):
    """The MTP draft layer of an FP8 checkpoint is FP8 too (its decoder layer; eh_proj and the
    shared head stay high precision, as in R1): dequantised, it holds the float32 weights."""
    from atom.distributed.parallel_state import SINGLE
    from atom.spec_decode.mtp_loader import load_mtp

    path = write(tiny_model("deepseek_v3"), str(tmp_path / "fp8"), "block", str(tmp_path / "deq"), block=16)
    drafts = []
    for p in (path, str(tmp_path / "deq")):
        config = EngineArgs(model=p, max_model_len=64, device="cpu").create_engine_config()
        drafts.append(load_mtp(config.model_config, None, torch.device("cpu"), SINGLE))
    fp8, ref = (dict(d.named_modules()) for d in drafts)
    layer = fp8["model.layers.3"]
    assert layer.eh_proj.weight.dtype == torch.float32 and layer.eh_proj.quant_method is None
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.float32
    # the unquantised draft runs its shared experts inside the fused MoE, after the routed ones
    ref_experts = ref["model.layers.3.mlp.experts"]
    num_routed, inter = ref_experts.num_experts, ref_experts.intermediate
    shared_w13, shared_w2 = ref_experts.w13_weight[num_routed:], ref_experts.w2_weight[num_routed:]
    shared_ref = {
        "model.layers.3.mlp.shared_experts.gate_up_proj": torch.cat(
            (shared_w13[:, :inter].flatten(0, 1), shared_w13[:, inter:].flatten(0, 1))),
        "model.layers.3.mlp.shared_experts.down_proj": torch.cat(tuple(shared_w2), dim=1),
    }  # fmt: skip
    checked = 0
    for name, module in fp8.items():
        method = getattr(module, "quant_method", None)
        if isinstance(method, Fp8LinearMethod):
            w = reference_fp8.dequantize(module.weight, getattr(module, method.config.scale_name), method.group_k)
            assert torch.equal(w, shared_ref[name] if name in shared_ref else ref[name].weight), name
        elif isinstance(method, Fp8MoEMethod):
            for weight, scale in zip(("w13_weight", "w2_weight"), method._names()):
                q, s = getattr(module, weight), getattr(module, scale)
                w = torch.stack([reference_fp8.dequantize(q[e], s[e], method.group_k) for e in range(q.shape[0])])
                assert torch.equal(w, getattr(ref[name], weight)[: q.shape[0]]), name
        else:
            continue
        checked += 1
    assert checked == 6  # fused q_a + kv_a, q_b, o, the experts, the shared experts' gate_up and down


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Once upon a time, a small model learned to count: one, two,",
           "def add(a, b):", "Paged attention stores keys and values in"]


@pytest.fixture(scope="module")
def fp8_deepseek_v3(tmp_path_factory):
    """A tiny block-FP8 DeepSeek-V3 with MTP whose row-parallel inputs split into whole
    16-column scale blocks on two ranks (o_proj 6 heads x 16, down_proj 160, experts 32), and
    its greedy tokens with an fp8 latent cache, without drafts."""
    tmp = tmp_path_factory.mktemp("fp8-v3")
    src = build(str(tmp / "src"), "deepseek_v3", v_head_dim=16, intermediate_size=160, moe_intermediate_size=32)
    path = write(src, str(tmp / "fp8"), "block", block=16)
    engine = LLMEngine(path, max_model_len=256, kv_cache_dtype="fp8")
    return path, [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_fp8_deepseek_mtp_matches_plain_decoding(fp8_deepseek_v3):
    path, expected = fp8_deepseek_v3
    engine = LLMEngine(path, max_model_len=256, kv_cache_dtype="fp8", method="mtp", num_speculative_tokens=1,
                       max_num_batched_tokens=16)
    draft_layer = engine.core.runner.spec.proposer.draft.model.layers["3"]
    assert draft_layer.mlp.experts.w13_weight.dtype == FP8
    assert [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert engine.core.stats().spec.num_draft_tokens > 0


def test_fp8_deepseek_tp2_matches_one_rank(fp8_deepseek_v3):
    path, expected = fp8_deepseek_v3
    engine = LLMEngine(path, max_model_len=256, kv_cache_dtype="fp8", tensor_parallel_size=2, method="mtp",
                       num_speculative_tokens=1)
    try:
        assert [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    finally:
        engine.shutdown()


def test_quantization_fp8_on_load_deepseek(tiny_model):
    """``--quantization fp8`` on a float DeepSeek-V3: per-channel FP8 for the target's and the
    MTP layer's linear layers and experts, kv_b_proj and eh_proj left in the model dtype; MTP
    gives plain decoding's tokens."""
    path = tiny_model("deepseek_v3")
    plain = LLMEngine(path, max_model_len=256, quantization="fp8", kv_cache_dtype="fp8")
    _check_deepseek_layers(plain.core.runner.model)
    expected = [o["token_ids"] for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    engine = LLMEngine(path, max_model_len=256, quantization="fp8", kv_cache_dtype="fp8", method="mtp",
                       num_speculative_tokens=1)
    draft_layer = engine.core.runner.spec.proposer.draft.model.layers["3"]
    assert draft_layer.self_attn.fused_qkv_a_proj.weight.dtype == FP8
    assert draft_layer.eh_proj.weight.dtype == torch.float32
    assert [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_dummy_weights_fill_large_fp8_tensors():
    """``--load_dummy`` on an FP8 checkpoint's shapes (the benchmarks' ``qwen3-8b-fp8``): tensors
    above the CPU-drawn size are drawn on their device, where ``normal_`` has no float8 kernel."""
    from atom.model_loader.loader import init_dummy_weights

    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.empty(4097, 4096, dtype=torch.float8_e4m3fn), requires_grad=False)
    model.weight_scale_inv = torch.nn.Parameter(torch.empty(33, 32), requires_grad=False)
    init_dummy_weights(model, seed=0)
    w = model.weight.float()
    assert torch.isfinite(w).all() and abs(w.std().item() - 0.02) < 1e-3 and abs(w.mean().item()) < 1e-3
    assert (model.weight_scale_inv == 1).all()


@pytest.mark.parametrize("block", [(32, 32), None])
def test_fp8_gate_up_pair_is_silu_and_mul_of_its_linear(block):
    # the MLP's gate / up call (MergedColumnParallelLinear.silu_and_mul -> Fp8LinearMethod.apply_gated):
    # the layer's own output through SiLU-mul, bit for bit, block-scaled (one op) or per channel
    from atom.layers.linear import MergedColumnParallelLinear
    from atom.layers.quantization.fp8_config import Fp8Config

    config = Fp8Config(block, serialized=True, scale_name="weight_scale_inv" if block else "weight_scale")
    layer = MergedColumnParallelLinear(64, [48, 48])
    method = Fp8LinearMethod(config)
    method.create_weights(layer)
    w_q, w_s = reference_fp8.quantize_weight(torch.randn(96, 64) * 0.1, *(block or (96, 64)))
    layer.weight.data.copy_(w_q)
    getattr(layer, config.scale_name).data.copy_(w_s.expand(96, -1) if block is None else w_s)
    method.process_weights_after_loading(layer)
    x = torch.randn(3, 64)
    out = layer.silu_and_mul(x)
    assert out.shape == (3, 48)
    torch.testing.assert_close(out, reference.silu_and_mul(layer(x)), atol=0, rtol=0)
