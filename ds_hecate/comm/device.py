"""Host-to-device copies of the small tables the collectives and the layer call need, without blocking the host."""
from __future__ import annotations

import numpy as np
import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without blocking the host: pinned and ``non_blocking`` on CUDA (the
    caching host allocator keeps the pinned buffer alive until the copy has run). A tensor already on ``device``
    (the CPU) is returned as it is, without dispatching a no-op ``to``."""
    if host.device == device:
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def host_index(rows: "np.ndarray", device: torch.device) -> torch.Tensor:
    """A host-built int64 index (a plan's rows, permutations, send order) on ``device``: pinned and non-blocking on
    CUDA, the array itself on the CPU."""
    return to_device(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)), device)
