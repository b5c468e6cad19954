import pytest

from atom.testing.tiny_checkpoint import build


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Build (once per session) a tiny checkpoint of the given architecture."""
    cache: dict[str, str] = {}

    def get(arch: str = "qwen3") -> str:
        if arch not in cache:
            cache[arch] = build(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch)
        return cache[arch]

    return get
