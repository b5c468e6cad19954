"""The penalties kernel and the grammar bitmask on CUDA at real shapes, against the
PyTorch reference (run in its own pytest process, as tests/gpu/test_kernels_gpu.py)."""

import os
import random

import pytest
import torch

from atom.ops.penalties import apply_penalties, pack_bitmask, unpack_bitmask
from atom.worker.logits_processors import apply_logits_processors
from atom.worker.penalty_inputs import RequestPenalties, build_penalty_inputs

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton", allow_module_level=True)

VOCAB = 151936  # Qwen3's


def requests(rows: int, rng: random.Random) -> list[RequestPenalties]:
    out = []
    for row in range(rows):
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(200))]
        out.append(
            RequestPenalties(
                prompt_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 2000))],
                output_token_ids=output + output[:50],  # repeats
                presence_penalty=rng.uniform(-1, 1) if row % 4 else 0.0,
                frequency_penalty=rng.uniform(-1, 1) if row % 4 else 0.0,
                repetition_penalty=rng.uniform(0.8, 1.5) if row % 4 else 1.0,
                logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(5))},
                min_tokens=rng.randrange(300),
                stop_token_ids=[151645, 151643],
                bad_words_token_ids=[output[-1:] + [7]] if output else [],
                allowed_token_ids=rng.sample(range(VOCAB), 1000) if row == 3 else None,
            )
        )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_kernel_matches_reference(dtype):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    batch = requests(64, rng)
    logits = (4 * torch.randn(64, VOCAB, device="cuda")).to(dtype)
    inputs = build_penalty_inputs(batch, VOCAB, "cuda")
    grammar = pack_bitmask(torch.rand(64, VOCAB, device="cuda") < 0.9)
    out = apply_logits_processors(logits, inputs, grammar)  # the Triton kernel on CUDA
    ref = apply_penalties(logits, *inputs.args())
    ref.masked_fill_(~unpack_bitmask(grammar, VOCAB), float("-inf"))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)


def test_xgrammar_bitmask_on_cuda_matches_the_fallback():
    from atom.structured_output import bitmask

    allowed = torch.rand(8, VOCAB) < 0.3
    mask = pack_bitmask(allowed)
    logits = torch.randn(8, VOCAB, device="cuda")
    fast, slow = logits.clone(), logits.to(torch.bfloat16)
    bitmask.apply(fast, mask)  # xgrammar's CUDA kernel
    bitmask.apply(slow, mask)  # masked_fill
    assert torch.equal(fast.isinf().cpu(), ~allowed)
    assert torch.equal(slow.isinf().cpu(), ~allowed)
