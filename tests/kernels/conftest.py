"""Kernel tests run the Triton kernels on CPU tensors under Triton's interpreter.

Inputs are random and fresh each session; set ATOM_TEST_SEED to replay a session (the
seed is printed in the pytest header).
"""

import os
import random
import zlib

# Must be set before triton is imported anywhere.
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle  # noqa: E402

_create_dot = InterpreterBuilder.create_dot


def _create_dot_bf16(self, a, b, d, *args, **kwargs):
    # The interpreter keeps bf16 tensors as raw uint16 bits and would multiply those
    # integers in tl.dot; widen bf16 operands to float32 (exact) first.
    if a.dtype.scalar == tl.bfloat16:
        a = self.cast_impl(a, tl.float32)
    if b.dtype.scalar == tl.bfloat16:
        b = self.cast_impl(b, tl.float32)
    return _create_dot(self, a, b, d, *args, **kwargs)


_cast_impl = InterpreterBuilder.cast_impl


def _cast_impl_rtne(self, src, dst_type):
    # The interpreter truncates float32 -> bf16; the GPU (and torch) round to nearest even.
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bits = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16).view(torch.int16)
        return TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
    return _cast_impl(self, src, dst_type)


_create_fp_to_fp = InterpreterBuilder.create_fp_to_fp
_TORCH_FLOAT = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}


def _create_fp_to_fp_e4m3(self, src, dst_type, rounding_mode):
    # The interpreter's narrowing to float8e4nv drops the mantissa carry into the exponent
    # and flushes subnormals; the GPU (cvt.rn.satfinite) and torch round to nearest even.
    if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in _TORCH_FLOAT:
        raw = np.asarray(src.data)
        if src.dtype.scalar == tl.bfloat16:
            x = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
        else:
            x = torch.from_numpy(raw.copy())
        bits = x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        return TensorHandle(bits.numpy(), tl.float8e4nv)
    return _create_fp_to_fp(self, src, dst_type, rounding_mode)


InterpreterBuilder.create_dot = _create_dot_bf16
InterpreterBuilder.cast_impl = _cast_impl_rtne
InterpreterBuilder.create_fp_to_fp = _create_fp_to_fp_e4m3

# Max abs error allowed against a reference on the same (rounded) inputs, per unit of the
# output's largest magnitude (at least 1): a few ulps of the output dtype.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}

SEED = int(os.environ.get("ATOM_TEST_SEED", random.randrange(2**31)))


def pytest_report_header(config):
    return f"ATOM_TEST_SEED={SEED}"


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(SEED + zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=[torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def dtype(request):
    return request.param


@pytest.fixture
def assert_close():
    def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
        assert out.shape == ref.shape
        assert not out.isnan().any()
        err = (out.double() - ref.double()).abs().max().item()
        magnitude = max(1.0, ref.abs().max().item())
        assert err <= TOLERANCE[dtype] * scale * magnitude, f"max abs error {err} at magnitude {magnitude}"

    return check
