import pytest
import torch

from atom.ops import reference
from atom.ops.triton import silu_and_mul


@pytest.mark.parametrize("shape", [(1, 64), (5, 2 * 768), (2, 3, 2 * 100), (3, 2 * 1500)])
def test_silu_and_mul(shape, dtype, assert_close):
    x = 3 * torch.randn(shape, dtype=dtype)
    out = silu_and_mul(x)
    assert out.dtype == dtype
    assert_close(out, reference.silu_and_mul(x.float()), dtype, scale=2)
    assert_close(out, reference.silu_and_mul(x), dtype, scale=2)
