"""The benchmark shapes (atom.benchmarks.model_configs): each builds atom's model at full size
(on the meta device: no memory), and ``weight_bytes``, the batch-1 bandwidth floor of
benchmark_latency, equals the bytes of the parameters a one-token decode step reads, counted
on that model: all but the embedding table and the norms, and of each MoE layer's experts
only the token's top-k."""

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
    for pname, p in model.named_parameters():  # a tied LM head is listed once, as the embedding
        if p.dim() == 1 or pname == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            continue
        read += p.numel() * top_k // p.shape[0] if pname.endswith(("w13_weight", "w2_weight")) else p.numel()
    assert weight_bytes(CONFIGS[name]) == read * 2
