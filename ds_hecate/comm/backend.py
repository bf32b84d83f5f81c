"""Which transport carries Hecate's collectives and which implementation does their device work: the registry of
both, named once here (the ``hecate`` config's schema reads the names), and the choice every rank agrees on.

``hecate.comm_backend`` (:data:`TRANSPORTS`): ``"torch"`` always uses torch.distributed (NCCL on CUDA,
:class:`~ds_hecate.comm.transport.TorchTransport`). ``"cupy"`` insists on the CuPy+NCCL transport
(:class:`~ds_hecate.comm.gpu.nccl_comm.CupyTransport`): every rank raises, naming the rank and the missing piece, if
any rank cannot use it. ``"auto"`` picks CuPy+NCCL only once it has passed a multi-GPU check
(:data:`CUPY_VERIFIED`) and every rank can use it, and otherwise torch.distributed, saying why in one log line. The
choice is agreed by all ranks in one collective.

``hecate.device_kernels`` (:data:`DEVICE_OPS`) chooses the device work apart from the transport (the kernels need
CuPy, not NCCL): ``"auto"`` runs ds_hecate's CUDA kernels where they compile on the rank's CUDA device (they passed
``make gpu-check`` on an H200 bit for bit against their torch contracts), else torch ops; ``"cupy"`` insists, agreed
by all ranks; ``"torch"`` never.

A new transport is named in :data:`TRANSPORTS` and built in :func:`build_communicator`; what only CuPy needs (its
probes, kernels and transport) lives under :mod:`.gpu`, imported when asked for, so this module imports no torch
and the config can read the names.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from ..errors import HecateConfigError
from ..logging_utils import log_rank0

if TYPE_CHECKING:
    import torch

    from .transport import DeviceOps, Transport

#: the transports Hecate's collectives run on: torch.distributed, NCCL through CuPy
TRANSPORTS = ("torch", "cupy")
#: the implementations of their device work (pack, accumulate, combine): torch ops, ds_hecate's CUDA kernels
DEVICE_OPS = ("torch", "cupy")
#: the values of ``hecate.comm_backend`` and ``hecate.device_kernels``
COMM_BACKENDS = ("auto",) + TRANSPORTS
DEVICE_KERNELS = ("auto",) + DEVICE_OPS


def _gpu():
    """The CuPy probes (:mod:`.gpu.backend`), imported when a choice needs them (they import torch)."""
    from .gpu import backend
    return backend


def _unusable_ranks(status: Tuple[bool, str], group, world_size: int) -> Optional[str]:
    """Every rank's ``status`` exchanged in one collective over ``group`` (none on one rank): the ranks that cannot
    use the candidate, with their reasons ("rank r: why; ..."), or None when all can. The same on every rank."""
    statuses: List[Tuple[bool, str]] = [status]
    if world_size > 1:
        import torch.distributed as dist
        gathered: List[Any] = [None] * world_size
        dist.all_gather_object(gathered, status, group=group)
        statuses = gathered
    bad = [(r, why) for r, (ok, why) in enumerate(statuses) if not ok]
    if not bad:
        return None
    return "; ".join(f"rank {r}: {reason}" for r, reason in bad[:4]) + (" ..." if len(bad) > 4 else "")


def agree_device_ops(requested: str, device: torch.device, group, world_size: int) -> Tuple[str, Optional[str]]:
    """("cupy" | "torch", why the kernels are not used or None) for ``hecate.device_kernels``. ``auto`` decides per
    rank with no collective: kernels and torch ops give the same bits (the kernels' contracts,
    :mod:`.gpu.reference`, checked on a GPU by tests/gpu), so ranks that differ still train alike. ``cupy`` exchanges
    every rank's probe in one collective and every rank raises HecateConfigError, naming the ranks, if one cannot
    run them (a rank raising alone would leave the others waiting in the next collective)."""
    if requested not in DEVICE_KERNELS:
        raise HecateConfigError(f"hecate.device_kernels={requested!r} is not one of {', '.join(DEVICE_KERNELS)}")
    if requested == "torch":
        return "torch", None
    status = _gpu().local_kernels_status(device)
    if requested == "auto":
        return ("cupy", None) if status[0] else ("torch", status[1])
    why = _unusable_ranks(status, group, world_size)
    if why is None:
        return "cupy", None
    raise HecateConfigError(f"hecate.device_kernels='cupy' but the CUDA kernels cannot run ({why}); set "
                            "device_kernels to 'auto' or 'torch', or run on CUDA devices with pip install "
                            "'ds_hecate[gpu]'")


#: Whether the CuPy+NCCL transport has passed ``make gpu-check`` on 2 or more GPUs (docs/benchmarks.md). It passed on
#: one GPU, where NCCL refuses a second rank, so it has never run between processes; until it has,
#: ``auto`` uses torch.distributed on CUDA too and the CuPy transport is opt-in (``comm_backend: "cupy"``).
CUPY_VERIFIED = False


def agree_backend(requested: str, device: torch.device, group, world_size: int) -> Tuple[str, Optional[str]]:
    """("cupy" | "torch", why CuPy is not used or None), the same on every rank: when CuPy is a candidate, every
    rank's probe result is exchanged in one collective and one unusable rank makes all fall back (``auto``) or all
    raise HecateConfigError (``cupy``). Collective over ``group`` unless the answer needs no probe."""
    if requested not in COMM_BACKENDS:
        raise HecateConfigError(f"hecate.comm_backend={requested!r} is not one of {', '.join(COMM_BACKENDS)}")
    if requested == "torch":
        return "torch", None
    if requested == "auto" and not (CUPY_VERIFIED and device.type == "cuda"):
        if device.type != "cuda":
            return "torch", _gpu().local_status(device)[1]
        return "torch", ("the CuPy+NCCL transport has not passed a GPU check on 2 or more GPUs yet (make gpu-check); "
                         "set comm_backend: 'cupy' to opt in")
    status = _gpu().local_status(device)
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
    from .collectives import Communicator
    from .transport import TORCH_DEVICE_OPS, TorchTransport

    backend, why = agree_backend(requested, device, group, world_size)
    ops_name, ops_why = agree_device_ops(device_kernels, device, group, world_size)
    ops: DeviceOps
    transport: Transport
    weights: Optional[Transport]
    if ops_name == "cupy":
        from .gpu.device_ops import KernelDeviceOps
        ops = KernelDeviceOps()
        log_rank0(f"device work: ds_hecate's CUDA kernels ({_gpu().local_kernels_status(device)[1]})")
    else:
        ops = TORCH_DEVICE_OPS
        if ops_why is not None and device.type == "cuda":
            log_rank0(f"device work: torch ops; CUDA kernels not used: {ops_why}")
    if backend == "cupy":
        from .gpu.nccl_comm import CupyTransport
        transport = CupyTransport(group, rank, world_size, device, timeout_s=timeout_s, device_ops=ops)
        weights = (CupyTransport(weight_group, rank, world_size, device, timeout_s=timeout_s, device_ops=ops)
                   if weight_group is not None else None)
        log_rank0(f"communication backend: CuPy+NCCL on {device} ({_gpu().cupy_status()[1]})")
        return Communicator(group, rank, world_size, timeout_s=timeout_s, transport=transport,
                            weight_transport=weights, one_rank_shortcuts=one_rank_shortcuts)
    if why is not None:
        log_rank0(f"communication backend: torch.distributed; CuPy+NCCL not used: {why}")
    transport = TorchTransport(group, rank, world_size, device, device_ops=ops)
    weights = (TorchTransport(weight_group, rank, world_size, device, device_ops=ops)
               if weight_group is not None else None)
    return Communicator(group, rank, world_size, timeout_s=timeout_s, transport=transport,
                        weight_transport=weights, one_rank_shortcuts=one_rank_shortcuts)
