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


@pytest.mark.parametrize(
    ("page", "dtype", "ok"),
    [
        (16, torch.bfloat16, True),
        (8, torch.bfloat16, True),
        (256, torch.bfloat16, True),  # pages above a key tile: one box per tile
        (4, torch.bfloat16, False),  # below the 8-row swizzle atom
        (24, torch.bfloat16, False),  # not a power of two: boxes would straddle pages
        (16, torch.float8_e4m3fn, False),  # an fp8 cache stays on the Triton kernel
    ],
)
def test_cache_supported(page, dtype, ok):
    q = torch.zeros(10, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(2, 20, 8, page, 128, dtype=dtype)  # the engine's [k/v, blocks, kv_heads, page, d]
    assert pg.cache_supported(q, kv[0], kv[1]) is ok


def test_cache_supported_needs_contiguous_page_rows():
    q = torch.zeros(10, 32, 128, dtype=torch.bfloat16)
    nhd = torch.zeros(2, 20, 16, 8, 128, dtype=torch.bfloat16).transpose(2, 3)  # [blocks, page, heads, d] storage
    assert not pg.cache_supported(q, nhd[0], nhd[1])


def test_cache_rows_address_every_slot():
    # the kernel's row of (block, kv_head, slot) in the flat view the cache descriptor spans
    kv = torch.randn(2, 5, 3, 16, 64).to(torch.bfloat16)
    k = kv[1]  # not at the storage's start
    flat, per_block, per_head = pg.cache_rows(k)
    assert flat.data_ptr() == k.data_ptr()
    for b, h, s in [(0, 0, 0), (4, 2, 15), (2, 1, 7)]:
        assert torch.equal(flat[b * per_block + h * per_head + s], k[b, h, s])
    assert flat.shape[0] == 4 * per_block + 2 * per_head + 16  # ends at the cache's last row


@pytest.mark.parametrize(
    ("seqs", "max_q", "max_k", "heads", "splits"),
    [
        (1, 128, 8320, 32, 4),  # 32 items of 65 key tiles for 132 SMs: 4 splits fill them once
        (1, 256, 16640, 32, 2),
        (2, 64, 3064, 32, 2),
        (1, 512, 4608, 32, 1),  # 128 items: the SMs are full
        (1, 128, 1000, 32, 1),  # 8 key tiles: splits of fewer than 4 tiles do not pay
        (1, 2048, 2048, 32, 1),
    ],
)
def test_num_splits(seqs, max_q, max_k, heads, splits):
    assert pg.num_splits(seqs, max_q, max_k, heads, num_sms=132) == splits
