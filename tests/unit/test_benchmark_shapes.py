"""The benchmark shapes (atom.benchmarks.model_configs): each builds atom's model at full size
(on the meta device: no memory), and ``weight_bytes``, the batch-1 bandwidth floor of
benchmark_latency, equals the bytes of the parameters a one-token decode step reads, counted
on that model: all but the embedding table and the norms, and of each MoE layer's experts
only the token's top-k; FP8 models' linears at one byte a weight, the router and LM head at two."""

import json

import pytest
import torch
from transformers import AutoConfig

from atom.benchmarks.model_configs import CONFIGS, weight_bytes
from atom.models.registry import get_model_class


@pytest.mark.parametrize("name", CONFIGS)
def test_weight_bytes_is_what_a_batch_1_step_reads(name, tmp_path):
    # yarn's rope tables cannot be computed on the meta device; rope has no parameters
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name] | {"rope_scaling": None}))
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = get_model_class(config.architectures[0])(config)
    top_k, read = getattr(config, "num_experts_per_tok", 0), 0
    fp8 = "quantization_config" in CONFIGS[name]
    for pname, p in model.named_parameters():  # a tied LM head is listed once, as the embedding
        if p.dim() == 1 or pname == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            continue
        if pname.endswith(("w13_weight", "w2_weight")):  # the token's experts: top-k and any fused shared ones
            experts = model.get_submodule(pname.rpartition(".")[0])
            read += p.numel() * (top_k + experts.num_shared) // p.shape[0] * (1 if fp8 else 2)
        elif pname.endswith(("lm_head.weight", "embed_tokens.weight", "mlp.gate.weight")):  # stay bf16
            read += p.numel() * 2
        else:
            read += p.numel() * (1 if fp8 else 2)
    assert weight_bytes(CONFIGS[name]) == read


def test_vllm_dummy_weights_tie_the_router_and_the_redraw_spreads_it():
    """Why the benchmarks redraw vLLM's dummy weights: with uniform +-1e-3 weights (norms
    included), DeepSeek-V2's router scores after vLLM's bf16 softmax are all equal, so top-k
    sends every token to the same experts; with the weights atom draws they differ per token."""
    from types import SimpleNamespace

    from atom.benchmarks.model_configs import redraw_dummy_weights

    torch.manual_seed(0)
    hidden, experts, tokens = 2048, 64, 256
    model = torch.nn.ModuleDict(dict(
        norm=torch.nn.RMSNorm(hidden, dtype=torch.bfloat16),
        gate=torch.nn.Linear(hidden, experts, bias=False, dtype=torch.bfloat16),
    ))  # fmt: skip
    model.register_parameter("fp8_weight", torch.nn.Parameter(torch.ones(4, dtype=torch.float8_e4m3fn), False))
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == torch.bfloat16:
                p.uniform_(-1e-3, 1e-3)  # vLLM's initialize_dummy_weights
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16).uniform_(-1e-3, 1e-3)  # the embedding's scale

    def experts_used():
        scores = torch.softmax(model["gate"](model["norm"](x)), dim=-1)  # bf16, as grouped_topk
        return scores.topk(6, dim=-1).indices.unique().numel()

    assert experts_used() == 6  # every token: the same 6 experts
    assert redraw_dummy_weights(SimpleNamespace(get_model=lambda: model)) == 2
    assert torch.equal(model["norm"].weight, torch.ones(hidden, dtype=torch.bfloat16))
    assert 0.018 < model["gate"].weight.float().std() < 0.022
    assert model.fp8_weight.float().eq(1).all()  # FP8 and integer tensors are kept
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16) * 0.02  # atom's embedding scale
    assert experts_used() == experts
