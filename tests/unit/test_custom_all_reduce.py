"""The custom all-reduce's dispatch (``atom/distributed/all_reduce.py``) on 2 gloo ranks:
messages that fit go to the custom communicator, larger ones to the process group, eagerly
and through ``torch.ops.atom.all_reduce`` inside torch.compile. The GPU kernel itself is
tested on GPUs (``tests/gpu/allreduce_bench.py``)."""

import pytest
import torch

from atom.worker.executor import MultiprocExecutor
from tests.unit.executor_workers import AllReduceWorker


@pytest.fixture(scope="module")
def ranks():
    with MultiprocExecutor(2, AllReduceWorker, backend="gloo") as ex:
        yield ex


@pytest.mark.parametrize("compiled", [False, True])
def test_small_messages_take_the_custom_path_and_large_ones_the_group(ranks, compiled):
    outs, calls = ranks.collective_rpc("run", compiled, [1, 3, 2], timeout_s=300)
    assert calls == [4096]  # 1 row (16 KiB of float32) fits; 3 and 2 rows do not
    for rows, out in zip([1, 3, 2], outs):
        x = torch.arange(rows * 4096, dtype=torch.float32).reshape(rows, 4096)
        torch.testing.assert_close(out, x * 2 * (1 + 2) + 1)  # ranks hold x and 2x
