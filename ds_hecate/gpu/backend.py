"""Choice of the communication backend: CuPy+NCCL on CUDA, torch.distributed otherwise.

``hecate.comm_backend``: ``"auto"`` picks CuPy+NCCL when Hecate's tensors are on a CUDA device and CuPy imports,
sees a GPU and has NCCL; otherwise torch.distributed, and says why in one log line. ``"cupy"`` insists (an error
naming the missing piece, never a silent fallback); ``"torch"`` always uses torch.distributed.
"""
from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Optional, Tuple

import torch

from ..errors import HecateConfigError
from ..logging_utils import log_rank0

BACKENDS = ("auto", "torch", "cupy")


@functools.lru_cache(maxsize=None)
def cupy_status() -> Tuple[bool, str]:
    """(usable, reason): whether CuPy can run Hecate's kernels and NCCL here, and if not, why. Cached."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CuPy warns on import when libnccl is missing; we report it below
            import cupy
            from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return False, f"cupy is not importable ({type(exc).__name__}: {exc}); install it with pip install " \
                      "'ds_hecate[gpu]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy_backends CUDARuntimeError: no driver / insufficient driver
        return False, f"cupy {cupy.__version__} is installed but sees no usable GPU ({exc})"
    if count == 0:
        return False, f"cupy {cupy.__version__} is installed but sees no GPU"
    if not getattr(nccl, "available", False):
        return False, f"cupy {cupy.__version__} is installed but cannot load NCCL (libnccl.so.2); install it with " \
                      "pip install nvidia-nccl-cu12"
    try:
        from .kernels import kernel_dir
        kernel_dir()
    except Exception as exc:
        return False, str(exc)
    return True, f"cupy {cupy.__version__}, {count} GPU(s), NCCL available"


def resolve_backend(requested: str, device: torch.device) -> Tuple[str, Optional[str]]:
    """("cupy" | "torch", why CuPy is not used or None). Raises HecateConfigError when "cupy" cannot be honoured."""
    if requested not in BACKENDS:
        raise HecateConfigError(f"hecate.comm_backend={requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "torch":
        return "torch", None
    if device.type != "cuda":
        # No CuPy probe here: importing cupy costs ~0.5 s per process and cannot change the answer.
        installed = importlib.util.find_spec("cupy") is not None
        why = (f"Hecate's tensors are on '{device.type}', not CUDA (cupy is "
               f"{'installed' if installed else 'not installed'})")
    else:
        usable, reason = cupy_status()
        if usable:
            return "cupy", None
        why = reason
    if requested == "cupy":
        raise HecateConfigError(f"hecate.comm_backend='cupy' but the CuPy+NCCL backend cannot be used: {why}; set "
                                "comm_backend to 'auto' or 'torch', or run on CUDA devices with "
                                "pip install 'ds_hecate[gpu]'")
    return "torch", why


def build_communicator(requested: str, group, rank: int, world_size: int, device: torch.device,
                       timeout_s: Optional[float] = None):
    """The Communicator for ``hecate.comm_backend`` (see the module docstring); logs the choice once (rank 0)."""
    from ..collectives import Communicator

    backend, why = resolve_backend(requested, device)
    if backend == "cupy":
        from .nccl_comm import CupyNcclCommunicator
        comm = CupyNcclCommunicator(group, rank, world_size, device, timeout_s=timeout_s)
        log_rank0(f"communication backend: CuPy+NCCL on {device} ({cupy_status()[1]})")
        return comm
    if why is not None:
        log_rank0(f"communication backend: torch.distributed; CuPy+NCCL not used: {why}")
    return Communicator(group, rank, world_size, timeout_s=timeout_s)
