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

from atom import LLMEngine
from atom.engine.arg_utils import EngineArgs
from atom.forward_context import AttentionMetadata, set_forward_context
from atom.layers.attention import Attention
from atom.layers.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod
from atom.model_loader.loader import load_model
from atom.ops import reference, reference_fp8
from atom.testing.agreement import teacher_forced_agreement
from atom.testing.fp8_checkpoint import FORMATS, write

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


def _dequantized_linear(self, layer, x, bias):
    w = reference_fp8.dequantize(layer.weight, getattr(layer, self.config.scale_name), self.group_k)
    return torch.nn.functional.linear(x, w.to(x.dtype), bias)


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
    monkeypatch.setattr(Fp8LinearMethod, "apply", _dequantized_linear)
    monkeypatch.setattr(Fp8MoEMethod, "apply", _dequantized_moe)
    logits, _ = prompt_logits(path)
    ref, _ = prompt_logits(str(tmp_path / "deq"))
    assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max()


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
