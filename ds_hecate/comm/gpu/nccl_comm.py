"""NCCL through CuPy as a Hecate transport (:class:`ds_hecate.comm.transport.Transport`): bytes only.

Hecate's collectives themselves (SparseAllGather, SparseReduceScatter, expert move, token all-to-all) are
implemented once, in :class:`ds_hecate.comm.collectives.Communicator`, over this transport or over torch.distributed.

- The ragged all-to-all is one NCCL group of point-to-point calls (one ``send``/``recv`` per peer with data); the
  part a rank sends to itself is a device copy.
- Every primitive runs on a communication stream of its own: it starts after the work already queued on the caller's
  stream (event), and the caller's stream waits for its completion event before using the result. Buffers are
  marked with ``record_stream`` so the caching allocator does not recycle them early.
- ``timeout_s`` (``hecate.collective_timeout_s``) bounds every wait: a primitive that has not completed in time
  aborts the NCCL communicator and raises ``TimeoutError`` (the Communicator names the collective, layer and phase
  in a ``HecateCollectiveError``). Waiting polls the completion event from the host.

The NCCL unique id is created by rank 0 of Hecate's torch.distributed group and broadcast over it; object
collectives go through that group too.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ...errors import HecateError

POLL_S = 5e-5


class CudaStreams:
    """The communication stream and its events (replaced by a fake in the CPU tests)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def start(self, tensors: Sequence[torch.Tensor]):
        """Order the communication stream after the caller's stream; returns a context running on it."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)
        for t in tensors:
            t.record_stream(self.stream)
        return torch.cuda.stream(self.stream)

    def handle(self) -> int:
        return self.stream.cuda_stream

    def done(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def join(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


class _Work:
    """A primitive in flight: :meth:`wait` bounds the wait by the timeout, then orders the caller's stream after it."""

    def __init__(self, transport: "CupyTransport", event, what: str) -> None:
        self.transport, self.event, self.what = transport, event, what

    def wait(self) -> None:
        if self.event is not None:
            self.transport.await_event(self.event, self.what)
            self.event = None


class CupyTransport:
    """NCCL (cupy.cuda.nccl) on Hecate's ranks, one CUDA device per rank."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int, device: torch.device,
                 timeout_s: Optional[float] = None, comm: Any = None, streams: Any = None,
                 nccl: Any = None) -> None:
        if device.type != "cuda":
            raise HecateError(f"the CuPy+NCCL transport needs a CUDA device, got {device}")
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.timeout_s = timeout_s
        self.aborted = False
        self.streams = streams if streams is not None else CudaStreams(device)
        self.comm = comm if comm is not None else self._nccl_communicator()
        if nccl is None:
            from cupy.cuda import nccl
        self.nccl = nccl  # the module (a stand-in in the CPU tests)
        self._ops = {dist.ReduceOp.SUM: nccl.NCCL_SUM, dist.ReduceOp.MAX: nccl.NCCL_MAX,
                     dist.ReduceOp.MIN: nccl.NCCL_MIN, dist.ReduceOp.PRODUCT: nccl.NCCL_PROD}
        self._types = {torch.float32: nccl.NCCL_FLOAT32, torch.float64: nccl.NCCL_FLOAT64,
                       torch.float16: nccl.NCCL_FLOAT16, torch.bfloat16: nccl.NCCL_BFLOAT16,
                       torch.int32: nccl.NCCL_INT32, torch.int64: nccl.NCCL_INT64, torch.uint8: nccl.NCCL_UINT8}

    def _nccl_communicator(self):
        import cupy
        from cupy.cuda import nccl

        uid = [nccl.get_unique_id() if self.rank == 0 else None]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(uid, src=src, group=self.group)
        with cupy.cuda.Device(self.device.index):
            return nccl.NcclCommunicator(self.world_size, uid[0], self.rank)

    # -- waiting and aborting ---------------------------------------------------------------------------------
    def await_event(self, event, what: str) -> None:
        """Wait (host polling) until ``event`` completes, at most ``timeout_s``; on expiry abort and raise."""
        deadline = time.monotonic() + self.timeout_s if self.timeout_s else None
        while not event.query():
            if deadline is not None and time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(f"NCCL {what} did not complete within {self.timeout_s:g} s; the NCCL "
                                   "communicator was aborted")
            time.sleep(POLL_S)
        self.streams.join(event)

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self.comm.abort()

    def _launch(self, what: str, tensors: Sequence[torch.Tensor], body: Callable[[int], None],
                async_op: bool) -> Optional[_Work]:
        if self.aborted:
            raise RuntimeError("the NCCL communicator was aborted after an earlier timeout")
        for t in tensors:
            if t.device != self.device:
                raise HecateError(f"the CuPy+NCCL transport got a tensor on {t.device} for {what}, expected "
                                  f"{self.device}")
        with self.streams.start(tensors):
            body(self.streams.handle())
        work = _Work(self, self.streams.done(), what)
        if async_op:
            return work
        work.wait()
        return None

    def _dtype(self, dtype: torch.dtype) -> int:
        if dtype not in self._types:
            raise HecateError(f"the CuPy+NCCL transport cannot reduce or gather {dtype} tensors")
        return self._types[dtype]

    # -- the transport primitives -----------------------------------------------------------------------------
    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, recv_splits: Sequence[int],
                   send_splits: Sequence[int], async_op: bool) -> Optional[_Work]:
        row = math.prod(send.shape[1:])
        item = send.element_size()
        flat_send, flat_recv = send.reshape(-1), recv.view(-1)

        def body(stream: int) -> None:
            s_off = r_off = 0
            self.nccl.groupStart()
            try:
                for peer in range(self.world_size):
                    s_n, r_n = int(send_splits[peer]) * row, int(recv_splits[peer]) * row
                    if peer == self.rank:
                        if s_n:
                            flat_recv.narrow(0, r_off, r_n).copy_(flat_send.narrow(0, s_off, s_n))
                    else:
                        if s_n:
                            self.comm.send(flat_send.narrow(0, s_off, s_n).data_ptr(), s_n * item,
                                           self.nccl.NCCL_UINT8, peer, stream)
                        if r_n:
                            self.comm.recv(flat_recv.narrow(0, r_off, r_n).data_ptr(), r_n * item,
                                           self.nccl.NCCL_UINT8, peer, stream)
                    s_off += s_n
                    r_off += r_n
            finally:
                self.nccl.groupEnd()
        return self._launch("all-to-all", [send, recv], body, async_op)

    def all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None:
        self._launch("all-gather", [out, local], lambda s: self.comm.allGather(
            local.data_ptr(), out.data_ptr(), local.numel(), self._dtype(local.dtype), s), False)

    def all_reduce(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        if op not in self._ops:
            raise HecateError(f"the CuPy+NCCL transport does not implement all_reduce with {op}")
        self._launch("all-reduce", [value], lambda s: self.comm.allReduce(
            value.data_ptr(), value.data_ptr(), value.numel(), self._dtype(value.dtype), self._ops[op], s), False)

    def broadcast(self, value: torch.Tensor, src: int) -> None:
        self._launch("broadcast", [value], lambda s: self.comm.bcast(
            value.data_ptr(), value.numel(), self._dtype(value.dtype), src, s), False)

    def all_gather_object(self, obj: Any) -> List[Any]:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
