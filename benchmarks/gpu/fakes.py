"""Stand-ins for NCCL (through CuPy), CUDA streams and the CUDA kernels, on the CPU: the GPU check's dry run and
the CPU tests drive the real :class:`~ds_hecate.comm.gpu.nccl_comm.CupyTransport` and
:class:`~ds_hecate.comm.gpu.device_ops.KernelDeviceOps` through them (under the CUDA stand-in of
tests/device_shim.py, whose "CUDA" tensors are CPU memory).

- :class:`FakeNccl`: the constants and group calls of ``cupy.cuda.nccl``.
- :class:`LoopbackComm`: an NCCL communicator of one rank that really moves the bytes (``ctypes.memmove`` on the
  tensors' addresses, which are host addresses under the stand-in), so a 1-rank round trip checks the data.
- :class:`ImmediateStreams`: a communication stream whose events have completed when recorded; counts the
  stream-side joins.
- :data:`REFERENCE_LAUNCHERS`: the kernels' launcher interface implemented by their torch contracts
  (:mod:`ds_hecate.comm.gpu.reference`).
"""
from __future__ import annotations

import contextlib
import ctypes
from types import SimpleNamespace
from typing import Sequence

import torch


class FakeNccl:
    """Stand-in for the ``cupy.cuda.nccl`` module: dtype and op constants, ``groupStart``/``groupEnd``."""

    NCCL_UINT8 = 0
    NCCL_FLOAT32, NCCL_FLOAT64, NCCL_FLOAT16, NCCL_BFLOAT16, NCCL_INT32, NCCL_INT64 = 1, 2, 3, 4, 5, 6
    NCCL_SUM, NCCL_MAX, NCCL_MIN, NCCL_PROD = 0, 1, 2, 3
    #: bytes per element of each NCCL dtype constant
    ITEMSIZE = {0: 1, 1: 4, 2: 8, 3: 2, 4: 2, 5: 4, 6: 8}

    def __init__(self) -> None:
        self.groups = 0

    def groupStart(self) -> None:  # noqa: N802 - NCCL's spelling
        self.groups += 1

    def groupEnd(self) -> None:  # noqa: N802
        pass


class LoopbackComm:
    """An NCCL communicator of one rank over host memory: every collective of one rank is a copy (or nothing)."""

    def __init__(self) -> None:
        self.aborted = False
        self.calls: list = []

    def _copy(self, dst: int, src: int, count: int, dtype: int) -> None:
        if dst != src and count:
            ctypes.memmove(dst, src, count * FakeNccl.ITEMSIZE[dtype])

    def allGather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:  # noqa: N802
        self.calls.append("allGather")
        self._copy(recv, send, count, dtype)

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:  # noqa: N802
        self.calls.append("allReduce")
        self._copy(recv, send, count, dtype)

    def reduceScatter(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:  # noqa: N802
        self.calls.append("reduceScatter")
        self._copy(recv, send, count, dtype)

    def bcast(self, buf: int, count: int, dtype: int, root: int, stream: int) -> None:
        self.calls.append("bcast")

    def send(self, *args) -> None:
        raise AssertionError("a rank of one sent to a peer: its part for itself must be a device copy")

    recv = send

    def abort(self) -> None:
        self.aborted = True


class DoneEvent:
    """A CUDA event that has completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class ImmediateStreams:
    """Communication stream stand-in: work runs at once (on the CPU), events are complete, joins are counted."""

    def __init__(self) -> None:
        self.joins = 0
        self.starts = 0

    def start(self, tensors: Sequence[torch.Tensor]):
        self.starts += 1
        return contextlib.nullcontext()

    def handle(self) -> int:
        return 0

    def done(self) -> DoneEvent:
        return DoneEvent()

    def join(self, event) -> None:
        self.joins += 1

    def bind_thread(self) -> None:
        pass


def _pack_chunks(srcs: Sequence[torch.Tensor], out: torch.Tensor, numel: int) -> torch.Tensor:
    from ds_hecate.comm.gpu import reference
    out.copy_(reference.pack_chunks(srcs, out.dtype, numel, out.device))
    return out


def _reduce_chunks(bases, recv, chunks_per_output, numel, outs=None):
    from ds_hecate.comm.gpu import reference
    totals = reference.reduce_chunks(bases, recv, chunks_per_output, numel)
    if outs is None:
        return totals
    for out, total in zip(outs, totals):
        out.copy_(total)
    return list(outs)


def reference_launchers() -> SimpleNamespace:
    """The launcher interface of :mod:`ds_hecate.comm.gpu.kernels` (what :class:`KernelDeviceOps` and the
    micro-benchmarks call), computed by the kernels' torch contracts, which the GPU tests compare the kernels to."""
    from ds_hecate.comm.gpu import kernels, reference
    return SimpleNamespace(supports=kernels.supports, pack_chunks=_pack_chunks, unpack_chunks=reference.unpack_chunks,
                           reduce_chunks=_reduce_chunks, accumulate_rows=reference.accumulate_rows,
                           permute_rows=lambda x, index, out=None: reference.permute_rows(x, index),
                           unpermute_combine=reference.unpermute_combine,
                           expert_histogram=reference.expert_histogram)


def loopback_transport(device: torch.device, timeout_s=None, device_ops=None):
    """A 1-rank :class:`CupyTransport` over :class:`LoopbackComm` and :class:`ImmediateStreams`, with the kernels'
    references as its device ops unless ``device_ops`` is given."""
    from ds_hecate.comm.gpu.device_ops import KernelDeviceOps
    from ds_hecate.comm.gpu.nccl_comm import CupyTransport
    ops = device_ops if device_ops is not None else KernelDeviceOps(reference_launchers())
    return CupyTransport(None, 0, 1, device, timeout_s=timeout_s, comm=LoopbackComm(), streams=ImmediateStreams(),
                         nccl=FakeNccl(), device_ops=ops)


class PendingEvent:
    """A CUDA event that never completes (a peer that stopped answering)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise AssertionError("the host blocked on an event that never completes")


class StalledStreams(ImmediateStreams):
    """Communication stream stand-in whose completion events never fire: a stalled collective."""

    def done(self) -> PendingEvent:
        return PendingEvent()
