"""Every layer of a model reads one RoPE table: the layers build equal tables from one config,
and ``share_cos_sin_caches`` keeps one (up to 2.5 GiB of GPU memory for DeepSeek-V3). Tables that
differ in shape or values stay apart. That the outputs are unchanged is the HF equivalence tests'."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, Qwen3Config

from atom.layers.rotary_embedding import RotaryEmbedding, share_cos_sin_caches
from atom.models.registry import get_model_class
from atom.testing.tiny_checkpoint import build


def tables(model: nn.Module) -> tuple[int, int]:
    """(RotaryEmbedding modules, distinct tables among them)."""
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    return len(ropes), len({m.cos_sin_cache.data_ptr() for m in ropes})


@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3"])
def test_a_model_holds_one_table(arch, tmp_path):
    config = AutoConfig.from_pretrained(build(str(tmp_path / arch), arch, num_layers=3))
    model = get_model_class(config.architectures[0])(config)
    assert tables(model) == (3, 1)
    layer = model.model.layers[0].self_attn.rotary_emb
    fresh = RotaryEmbedding(config, layer.cos_sin_cache.shape[1], config.max_position_embeddings)
    assert torch.equal(layer.cos_sin_cache, fresh.cos_sin_cache)


def test_different_tables_stay_apart():
    a, b = Qwen3Config(rope_theta=10000.0), Qwen3Config(rope_theta=500000.0)
    model = nn.ModuleList([RotaryEmbedding(a, 16, 64), RotaryEmbedding(a, 32, 64), RotaryEmbedding(b, 16, 64),
                           RotaryEmbedding(a, 16, 64), RotaryEmbedding(b, 16, 64)])  # fmt: skip
    share_cos_sin_caches(model)
    ptr = [m.cos_sin_cache.data_ptr() for m in model]
    assert len(set(ptr[:3])) == 3  # another head_dim, another base
    assert ptr[3] == ptr[0] and ptr[4] == ptr[2]
