"""Which MLA decode calls the Gluon Hopper kernel takes (``atom.ops.triton.mla_gluon.supported``); the
kernel itself runs only on sm_90 (tests/gpu/test_mla_gpu.py, tests/gpu/gluon_mla_check.py)."""

import torch

from atom.ops.triton import mla_gluon


def _inputs(heads=128, page=16, dtype=torch.bfloat16, cache_dtype=None, rank=512, rope=64):
    q = torch.zeros(3, heads, rank + rope, dtype=dtype)
    cache = torch.zeros(10, page, rank + rope, dtype=cache_dtype or dtype)
    return q, cache


def test_supported_deepseek_shapes():
    # V3 at -tp 8 / 4 / 2 / 1 (16 heads: also V2-Lite, Moonlight), more heads than V3, one head (-tp 128)
    for heads in (1, 16, 32, 64, 128, 256):
        for page in (8, 16, 64, 256):
            assert mla_gluon.supported(*_inputs(heads, page), 512)
    assert mla_gluon.supported(*_inputs(dtype=torch.float16), 512)
    for heads in (16, 32):  # an fp8 latent cache: the narrow kernel's head counts
        assert mla_gluon.supported(*_inputs(heads, cache_dtype=torch.float8_e4m3fn), 512)


def test_unsupported_inputs_stay_on_triton():
    assert not mla_gluon.supported(*_inputs(heads=96), 512)  # not whole 64-head blocks
    assert not mla_gluon.supported(*_inputs(heads=24), 512)  # nor a divisor of one
    assert not mla_gluon.supported(*_inputs(page=4), 512)  # pages below the 8-row swizzle atom
    assert not mla_gluon.supported(*_inputs(dtype=torch.float32), 512)
    for heads in (1, 64, 128):  # an fp8 latent cache past the narrow kernel's head counts
        assert not mla_gluon.supported(*_inputs(heads, cache_dtype=torch.float8_e4m3fn), 512)
    assert not mla_gluon.supported(*_inputs(16, dtype=torch.float32, cache_dtype=torch.float8_e4m3fn), 512)
    assert not mla_gluon.supported(*_inputs(16, cache_dtype=torch.float16), 512)  # not q's 16-bit dtype
    assert not mla_gluon.supported(*_inputs(rank=256, rope=64), 256)  # other latent dims
    q, _ = _inputs()
    wide = torch.zeros(10, 16, 640, dtype=torch.bfloat16)[..., :576]  # rows not packed
    assert not mla_gluon.supported(q, wide, 512)
    every_other = torch.zeros(20, 16, 576, dtype=torch.bfloat16)[::2]  # pages not packed
    assert not mla_gluon.supported(q, every_other, 512)
    assert mla_gluon.supported(q, every_other.contiguous(), 512)


def test_not_available_off_hopper():
    assert not mla_gluon.available(torch.device("cpu"))


def test_head_blocks():
    assert [mla_gluon.head_blocks(h) for h in (1, 16, 32, 64, 128, 256)] == [1, 1, 1, 1, 2, 4]
