"""Stand-ins for NCCL (through CuPy), CUDA streams and the CUDA kernels, on the CPU: the GPU check's dry run and
the CPU tests drive the real :class:`~ds_hecate.comm.gpu.nccl_comm.CupyTransport` and
:class:`~ds_hecate.comm.gpu.device_ops.KernelDeviceOps` through them (under the CUDA stand-in of
tests/device_shim.py, whose "CUDA" tensors are CPU memory).

- :class:`FakeNccl`: ``cupy.cuda.nccl``: the constants, ``groupStart``/``groupEnd``, ``get_unique_id`` and
  ``NcclCommunicator`` (a :class:`LoopbackComm` on one rank, a :class:`GlooComm` on several).
- :class:`LoopbackComm`: an NCCL communicator of one rank that really moves the bytes (``ctypes.memmove`` on the
  tensors' addresses, which are host addresses under the stand-in), so a 1-rank round trip checks the data.
- :class:`GlooComm`: an NCCL communicator of several processes whose calls go to gloo on the bytes at the
  addresses NCCL is given (point-to-point calls inside a group are posted together at ``groupEnd``, as NCCL runs
  them), so the CuPy transport's N-rank code runs between real processes.
- :class:`ImmediateStreams`: a communication stream whose events have completed when recorded; counts the
  stream-side joins.
- :func:`reference_launchers`: the kernels' launcher interface implemented by their torch contracts
  (:mod:`ds_hecate.comm.gpu.reference`).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
from types import SimpleNamespace
from typing import Any, List, Sequence, Tuple

import torch


class FakeNccl:
    """Stand-in for the ``cupy.cuda.nccl`` module: dtype and op constants, ``groupStart``/``groupEnd``, the unique
    id and the communicator."""

    available = True
    NCCL_UINT8 = 0
    NCCL_FLOAT32, NCCL_FLOAT64, NCCL_FLOAT16, NCCL_BFLOAT16, NCCL_INT32, NCCL_INT64 = 1, 2, 3, 4, 5, 6
    NCCL_SUM, NCCL_MAX, NCCL_MIN, NCCL_PROD = 0, 1, 2, 3
    #: bytes per element of each NCCL dtype constant
    ITEMSIZE = {0: 1, 1: 4, 2: 8, 3: 2, 4: 2, 5: 4, 6: 8}
    #: the torch dtype of each NCCL dtype constant
    DTYPES = {0: torch.uint8, 1: torch.float32, 2: torch.float64, 3: torch.float16, 4: torch.bfloat16,
              5: torch.int32, 6: torch.int64}

    def __init__(self) -> None:
        self.groups = 0
        self.depth = 0
        #: point-to-point calls issued inside the open group: (communicator, "send"/"recv", tensor, peer)
        self.pending: List[Tuple[Any, str, torch.Tensor, int]] = []

    def groupStart(self) -> None:  # noqa: N802 - NCCL's spelling
        self.groups += 1
        self.depth += 1

    def groupEnd(self) -> None:  # noqa: N802
        self.depth -= 1
        if self.depth == 0 and self.pending:
            calls, self.pending = self.pending, []
            _post_together(calls)

    def get_unique_id(self) -> Tuple[int, ...]:
        return tuple(os.urandom(16))

    def NcclCommunicator(self, world: int, uid, rank: int):  # noqa: N802
        return LoopbackComm() if world == 1 else GlooComm(self, world, rank)


def host_view(ptr: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``count`` elements of ``dtype`` at host address ``ptr`` as a CPU tensor sharing that memory (under the
    stand-in a device pointer is a host address)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=torch.uint8).view(dtype)


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


def _c10d():
    """torch.distributed's own functions (the CUDA stand-in wraps the module's attributes to accept only "CUDA"
    tensors; the bytes here are host memory, as gloo wants)."""
    from torch.distributed import distributed_c10d
    return distributed_c10d


def _post_together(calls: List[Tuple[Any, str, torch.Tensor, int]]) -> None:
    """An NCCL group's point-to-point calls: all posted, then all waited for (NCCL runs a group's calls at once)."""
    c10d = _c10d()
    works = []
    for comm, kind, tensor, peer in calls:
        op = c10d.isend if kind == "send" else c10d.irecv
        works.append(op(tensor, c10d.get_global_rank(comm.group, peer), group=comm.group))
    for work in works:
        work.wait()


class GlooComm:
    """An NCCL communicator of ``world`` processes over gloo: each NCCL call is the gloo call on the bytes at its
    addresses (under the stand-in, host memory). Created, as NCCL's, by every rank at once; the stand-in spans the
    whole torch.distributed world (its own gloo group, so its calls never mix with the caller's)."""

    _REDUCE = {0: "SUM", 1: "MAX", 2: "MIN", 3: "PRODUCT"}

    def __init__(self, nccl: FakeNccl, world: int, rank: int) -> None:
        c10d = _c10d()
        if c10d.get_world_size() != world or c10d.get_rank() != rank:
            raise NotImplementedError(f"the NCCL stand-in spans the whole world: rank {rank} of {world} asked, "
                                      f"rank {c10d.get_rank()} of {c10d.get_world_size()} here")
        self.nccl, self.world, self.rank = nccl, world, rank
        self.group = c10d.new_group(list(range(world)), backend="gloo")
        self.aborted = False
        self.calls: list = []

    def _view(self, ptr: int, count: int, dtype: int) -> torch.Tensor:
        return host_view(ptr, count, FakeNccl.DTYPES[dtype])

    def _op(self, op: int):
        return getattr(_c10d().ReduceOp, self._REDUCE[op])

    def allGather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:  # noqa: N802
        self.calls.append("allGather")
        _c10d().all_gather_into_tensor(self._view(recv, count * self.world, dtype), self._view(send, count, dtype),
                                       group=self.group)

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:  # noqa: N802
        self.calls.append("allReduce")
        out = self._view(recv, count, dtype)
        if send != recv:
            out.copy_(self._view(send, count, dtype))
        _c10d().all_reduce(out, op=self._op(op), group=self.group)

    def reduceScatter(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:  # noqa: N802
        self.calls.append("reduceScatter")
        total = self._view(send, count * self.world, dtype).clone()
        _c10d().all_reduce(total, op=self._op(op), group=self.group)
        self._view(recv, count, dtype).copy_(total.narrow(0, self.rank * count, count))

    def bcast(self, buf: int, count: int, dtype: int, root: int, stream: int) -> None:
        self.calls.append("bcast")
        c10d = _c10d()
        c10d.broadcast(self._view(buf, count, dtype), c10d.get_global_rank(self.group, root), group=self.group)

    def _p2p(self, kind: str, ptr: int, count: int, dtype: int, peer: int) -> None:
        self.calls.append(kind)
        if not 0 <= peer < self.world or peer == self.rank:
            raise AssertionError(f"NCCL {kind} to peer {peer} from rank {self.rank} of {self.world}")
        call = (self, kind, self._view(ptr, count, dtype), peer)
        if self.nccl.depth:
            self.nccl.pending.append(call)
        else:
            _post_together([call])

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._p2p("send", ptr, count, dtype, peer)

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._p2p("recv", ptr, count, dtype, peer)

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


class PendingEvent(DoneEvent):
    """A CUDA event that never completes (a peer that stopped answering)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise AssertionError("the host blocked on an event that never completes")


class StalledStreams(ImmediateStreams):
    """Communication stream stand-in whose completion events never fire: a stalled collective."""

    def done(self) -> PendingEvent:
        return PendingEvent()
