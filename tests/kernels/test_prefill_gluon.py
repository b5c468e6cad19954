"""The Gluon Hopper prefill kernel stays out of the way where it cannot run; its numerics
are checked on an H100 by tests/gpu/gluon_prefill_check.py."""

import pytest
import torch

from atom.ops.triton import prefill_attention_gluon as pg


def test_not_available_without_hopper(monkeypatch):
    # the CPU, and the interpreter even where a Hopper GPU is present
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pg.available()
    monkeypatch.delenv("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        assert not pg.available()


@pytest.mark.parametrize(
    ("shape", "kv_heads", "dtype", "ok"),
    [
        ((100, 32, 128), 8, torch.bfloat16, True),
        ((100, 32, 64), 32, torch.float16, True),
        ((100, 32, 256), 8, torch.bfloat16, False),  # head_dim 256: the Triton kernel
        ((100, 32, 128), 8, torch.float32, False),
        ((100, 12, 128), 8, torch.bfloat16, False),  # heads not a multiple of the KV heads
    ],
)
def test_supported_shapes(shape, kv_heads, dtype, ok):
    q = torch.zeros(shape, dtype=dtype)
    k = torch.zeros(shape[0], kv_heads, shape[2], dtype=dtype)
    assert pg.supported(q, k, k.clone()) is ok


def test_strided_kv_not_supported():
    q = torch.zeros(100, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(100, 8, 2, 128, dtype=torch.bfloat16)  # k and v interleaved: head stride 256
    assert not pg.supported(q, kv[:, :, 0], kv[:, :, 1])
