"""A checkpoint tensor that is read only where a rank needs it.

The loader hands every parameter's ``weight_loader`` a ``CheckpointSlice`` instead of the
full tensor; narrowing it is free, and ``materialize`` reads just the narrowed part from the
memory-mapped safetensors file. So a tensor-parallel rank reads its shards only, and an
expert-parallel rank never reads another rank's experts.
"""

from __future__ import annotations

from typing import Any

import torch


class CheckpointSlice:
    __slots__ = ("_source", "_index", "shape")

    def __init__(self, source: Any, index: tuple[slice, ...] | None = None):
        """``source``: a safetensors ``get_slice`` handle (anything indexable by a tuple of
        slices with a ``get_shape()``)."""
        self._source = source
        self._index = index or tuple(slice(0, n) for n in source.get_shape())
        self.shape = torch.Size(s.stop - s.start for s in self._index)

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"narrow({dim}, {start}, {length}) outside a checkpoint tensor of shape "
                             f"{tuple(self.shape)}")
        return self._with(dim, start, start + length)

    def __getitem__(self, rows: slice) -> CheckpointSlice:
        """Rows ``rows`` of dim 0, clamped to the tensor like a tensor slice is."""
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("a checkpoint slice takes contiguous rows only")
        return self._with(0, start, max(start, stop))

    def _with(self, dim: int, start: int, stop: int) -> CheckpointSlice:
        base = self._index[dim].start
        index = list(self._index)
        index[dim] = slice(base + start, base + stop)
        return CheckpointSlice(self._source, tuple(index))

    def materialize(self) -> torch.Tensor:
        return self._source[self._index]


def materialize(loaded: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    """The tensor itself, read from the checkpoint if it is still a slice."""
    return loaded.materialize() if isinstance(loaded, CheckpointSlice) else loaded
