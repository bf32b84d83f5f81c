"""Choice of the communication backend: CuPy+NCCL on CUDA, torch.distributed otherwise.

``hecate.comm_backend``: ``"torch"`` always uses torch.distributed (NCCL on CUDA). ``"cupy"`` insists on the CuPy+NCCL
transport: every rank raises, naming the rank and the missing piece, if any rank cannot use it. ``"auto"`` picks
CuPy+NCCL only once it has passed a multi-GPU check (:data:`CUPY_VERIFIED`) and every rank can use it, and
otherwise torch.distributed, saying why in one log line. The choice is agreed by all ranks in one collective.

``hecate.device_kernels`` chooses the device work apart from the transport (the kernels need CuPy, not NCCL):
``"auto"`` runs ds_hecate's CUDA kernels where they compile on the rank's CUDA device (they passed ``make
gpu-check`` on an H200 bit for bit against their torch contracts), else torch ops; ``"cupy"`` insists, agreed by
all ranks; ``"torch"`` never.
"""
from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Any, Optional, Tuple

import torch

from ...errors import HecateConfigError
from ...logging_utils import log_rank0
from .kernels import compile_all, device_index, kernel_dir

BACKENDS = ("auto", "torch", "cupy")


def _cupy_gpus(with_nccl: bool) -> Tuple[Any, str, int]:
    """(cupy module or None, its version or why it cannot run, visible GPUs): the probe both status functions start
    with. ``with_nccl`` also imports CuPy's NCCL module (its warning when libnccl is missing is silenced: the
    caller reports it)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy
            if with_nccl:
                from cupy.cuda import nccl  # noqa: F401 - what the CuPy transport needs
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken CUDA install raising at import
        return None, (f"cupy is not importable ({type(exc).__name__}: {exc}); install it with pip install "
                      "'ds_hecate[gpu]' (CUDA 12) or 'ds_hecate[gpu13]' (CUDA 13)"), 0
    version = getattr(cupy, "__version__", "(no version)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - cupy_backends CUDARuntimeError: no driver / insufficient driver
        return None, f"cupy {version} is installed but sees no usable GPU ({type(exc).__name__}: {exc})", 0
    if count == 0:
        return None, f"cupy {version} is installed but sees no GPU", 0
    return cupy, version, count


@functools.lru_cache(maxsize=None)
def cupy_status() -> Tuple[bool, str]:
    """(usable, reason): whether CuPy can run Hecate's kernels and NCCL here, and if not, why. Cached."""
    cupy, version, count = _cupy_gpus(with_nccl=True)
    if cupy is None:
        return False, version
    if not getattr(cupy.cuda.nccl, "available", False):
        return False, f"cupy {version} is installed but cannot load NCCL (libnccl.so.2); install it with " \
                      "pip install nvidia-nccl-cu12 (or nvidia-nccl-cu13 for CUDA 13)"
    try:
        kernel_dir()
    except Exception as exc:
        return False, str(exc)
    return True, f"cupy {version}, {count} GPU(s), NCCL available"


@functools.lru_cache(maxsize=None)
def kernels_status(index: int) -> Tuple[bool, str]:
    """(usable, reason): whether ds_hecate's CUDA kernels compile and can run on CUDA device ``index`` (CuPy
    importable, a GPU, the sources found, every kernel compiled by NVRTC now rather than at a first launch in the
    middle of a layer call). NCCL is not needed. Cached per device."""
    cupy, version, count = _cupy_gpus(with_nccl=False)
    if cupy is None:
        return False, version
    if index >= count:
        return False, f"cupy {version} sees {count} GPU(s), not device {index}"
    try:
        compile_all(index)
    except Exception as exc:  # noqa: BLE001 - a missing source or an NVRTC error: the kernels cannot run here
        return False, f"the CUDA kernels did not compile ({type(exc).__name__}: {str(exc)[:300]})"
    return True, f"cupy {version}, kernels compiled for device {index}"


def local_kernels_status(device: torch.device) -> Tuple[bool, str]:
    """(usable, reason) of the CUDA kernels on this rank, for Hecate's working ``device``."""
    if device.type != "cuda":
        return False, f"Hecate's tensors are on '{device.type}', not CUDA"
    return kernels_status(device_index(device))


def _unusable_ranks(status: Tuple[bool, str], group, world_size: int) -> Optional[str]:
    """Every rank's ``status`` exchanged in one collective over ``group`` (none on one rank): the ranks that cannot
    use the candidate, with their reasons ("rank r: why; ..."), or None when all can. The same on every rank."""
    statuses = [status]
    if world_size > 1:
        import torch.distributed as dist
        statuses = [None] * world_size
        dist.all_gather_object(statuses, status, group=group)
    bad = [(r, why) for r, (ok, why) in enumerate(statuses) if not ok]
    if not bad:
        return None
    return "; ".join(f"rank {r}: {reason}" for r, reason in bad[:4]) + (" ..." if len(bad) > 4 else "")


def agree_device_ops(requested: str, device: torch.device, group, world_size: int) -> Tuple[str, Optional[str]]:
    """("cupy" | "torch", why the kernels are not used or None) for ``hecate.device_kernels``. ``auto`` decides per
    rank with no collective: kernels and torch ops give the same bits (the kernels' contracts,
    :mod:`.reference`, checked on a GPU by tests/gpu), so ranks that differ still train alike. ``cupy`` exchanges
    every rank's probe in one collective and every rank raises HecateConfigError, naming the ranks, if one cannot
    run them (a rank raising alone would leave the others waiting in the next collective)."""
    if requested not in BACKENDS:
        raise HecateConfigError(f"hecate.device_kernels={requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "torch":
        return "torch", None
    status = local_kernels_status(device)
    if requested == "auto":
        return ("cupy", None) if status[0] else ("torch", status[1])
    why = _unusable_ranks(status, group, world_size)
    if why is None:
        return "cupy", None
    raise HecateConfigError(f"hecate.device_kernels='cupy' but the CUDA kernels cannot run ({why}); set "
                            "device_kernels to 'auto' or 'torch', or run on CUDA devices with pip install "
                            "'ds_hecate[gpu]'")


#: Whether the CuPy+NCCL transport has passed ``make gpu-check`` on 2 or more GPUs (docs/benchmarks.md). It passed on
#: one H200 (2026-12-04), where NCCL refuses a second rank, so it has never run between processes; until it has,
#: ``auto`` uses torch.distributed on CUDA too and the CuPy transport is opt-in (``comm_backend: "cupy"``).
CUPY_VERIFIED = False


def local_status(device: torch.device) -> Tuple[bool, str]:
    """(usable, reason) of the CuPy transport on this rank, for Hecate's working ``device``."""
    if device.type != "cuda":
        # No CuPy probe here: importing cupy costs ~0.5 s per process and cannot change the answer.
        installed = importlib.util.find_spec("cupy") is not None
        return False, (f"Hecate's tensors are on '{device.type}', not CUDA (cupy is "
                       f"{'installed' if installed else 'not installed'})")
    return cupy_status()


def agree_backend(requested: str, device: torch.device, group, world_size: int) -> Tuple[str, Optional[str]]:
    """("cupy" | "torch", why CuPy is not used or None), the same on every rank: when CuPy is a candidate, every
    rank's probe result is exchanged in one collective and one unusable rank makes all fall back (``auto``) or all
    raise HecateConfigError (``cupy``). Collective over ``group`` unless the answer needs no probe."""
    if requested not in BACKENDS:
        raise HecateConfigError(f"hecate.comm_backend={requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "torch":
        return "torch", None
    if requested == "auto" and not (CUPY_VERIFIED and device.type == "cuda"):
        if device.type != "cuda":
            return "torch", local_status(device)[1]
        return "torch", ("the CuPy+NCCL transport has not passed a GPU check on 2 or more GPUs yet (make gpu-check); "
                         "set comm_backend: 'cupy' to opt in")
    status = local_status(device)
    why = _unusable_ranks(status, group, world_size)
    if why is None:
        return "cupy", None
    if requested == "cupy":
        raise HecateConfigError(f"hecate.comm_backend='cupy' but the CuPy+NCCL transport cannot be used ({why}); "
                                "set comm_backend to 'auto' or 'torch', or run on CUDA devices with "
                                "pip install 'ds_hecate[gpu]'")
    return "torch", why


def build_communicator(requested: str, group, rank: int, world_size: int, device: torch.device,
                       timeout_s: Optional[float] = None, weight_group=None, device_kernels: str = "auto",
                       one_rank_shortcuts: bool = True):
    """The Communicator over the transport all ranks agreed on (see :func:`agree_backend`), its device work on the
    ops :func:`agree_device_ops` chose (``hecate.device_kernels``); logs both once.

    ``weight_group`` (a second process group over the same ranks) gives the weight traffic a transport of its own:
    a second NCCL communicator, so a second stream; None shares the token transport. ``one_rank_shortcuts``: see
    :class:`~ds_hecate.comm.collectives.Communicator`."""
    from ..collectives import Communicator
    from ..transport import TORCH_DEVICE_OPS, TorchTransport

    backend, why = agree_backend(requested, device, group, world_size)
    ops_name, ops_why = agree_device_ops(device_kernels, device, group, world_size)
    if ops_name == "cupy":
        from .device_ops import KernelDeviceOps
        ops = KernelDeviceOps()
        log_rank0(f"device work: ds_hecate's CUDA kernels ({local_kernels_status(device)[1]})")
    else:
        ops = TORCH_DEVICE_OPS
        if ops_why is not None and device.type == "cuda":
            log_rank0(f"device work: torch ops; CUDA kernels not used: {ops_why}")
    if backend == "cupy":
        from .nccl_comm import CupyTransport
        transport = CupyTransport(group, rank, world_size, device, timeout_s=timeout_s, device_ops=ops)
        weights = (CupyTransport(weight_group, rank, world_size, device, timeout_s=timeout_s, device_ops=ops)
                   if weight_group is not None else None)
        log_rank0(f"communication backend: CuPy+NCCL on {device} ({cupy_status()[1]})")
        return Communicator(group, rank, world_size, timeout_s=timeout_s, transport=transport,
                            weight_transport=weights, one_rank_shortcuts=one_rank_shortcuts)
    if why is not None:
        log_rank0(f"communication backend: torch.distributed; CuPy+NCCL not used: {why}")
    transport = TorchTransport(group, rank, world_size, device, device_ops=ops)
    weights = (TorchTransport(weight_group, rank, world_size, device, device_ops=ops)
               if weight_group is not None else None)
    return Communicator(group, rank, world_size, timeout_s=timeout_s, transport=transport,
                        weight_transport=weights, one_rank_shortcuts=one_rank_shortcuts)
