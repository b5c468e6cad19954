"""``ATOM_TRITON_PDL``: kernels on the CPU (the interpreter) never launch with programmatic
dependent launch, whatever the switch says (the interpreter cannot run ``gdc_wait``)."""

import torch

from atom.ops.triton import pdl


def test_never_on_the_cpu(monkeypatch):
    for value in ("0", "1"):
        monkeypatch.setenv("ATOM_TRITON_PDL", value)
        pdl._enabled.cache_clear()
        assert pdl.pdl_args(torch.device("cpu")) == {"USE_PDL": False, "launch_pdl": False}
    pdl._enabled.cache_clear()


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("ATOM_TRITON_PDL", raising=False)
    pdl._enabled.cache_clear()
    assert pdl._enabled(0) is False  # decided before any device is queried
    pdl._enabled.cache_clear()
