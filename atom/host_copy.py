"""Host-to-device copies that do not wait for the device: through pinned memory,
``non_blocking``. A plain ``torch.tensor(data, device="cuda")`` copies from pageable memory,
which waits for the stream's queued work first, so the GPU idles while the host builds the
next launch."""

from __future__ import annotations

import numpy as np
import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` (a list, nested lists or a NumPy array) as a ``dtype`` tensor on ``device``."""
    t = torch.as_tensor(np.asarray(data), dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
