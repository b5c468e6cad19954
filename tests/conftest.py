import os

# Under ``pytest -n N`` each worker, and the servers and ranks it starts, gets its share of the cores.
# torch's OpenMP pool takes every core in every process by default, and N pools spinning on the same
# cores ran the suite ~10x slower on CI's two cores (a spec-decode test: 6 s alone, 106 s under
# ``-n 2``). libgomp reads the variable when torch loads: before any import of it.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))

import pytest  # noqa: E402

from atom.testing.tiny_checkpoint import build  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Build (once per session) a tiny checkpoint of the given architecture."""
    cache: dict[str, str] = {}

    def get(arch: str = "qwen3") -> str:
        if arch not in cache:
            cache[arch] = build(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch)
        return cache[arch]

    return get
