"""NCCL through CuPy as a Hecate transport (:class:`ds_hecate.comm.transport.Transport`): bytes only.

Hecate's collectives themselves (SparseAllGather, SparseReduceScatter, expert move, token all-to-all) are
implemented once, in :class:`ds_hecate.comm.collectives.Communicator`, over this transport or over torch.distributed.
The device work around them (pack, the owners' gradient sum, the weighted un-permute) is
:class:`ds_hecate.comm.gpu.device_ops.KernelDeviceOps`: the CUDA kernels.

- The ragged all-to-all is one NCCL group of point-to-point calls (one ``send``/``recv`` per peer with data); the
  part a rank sends to itself is a device copy.
- Every primitive runs on this transport's communication stream (one per transport, so one per NCCL communicator):
  it starts after the work already queued on the caller's stream (an event), and buffers are marked with
  ``record_stream`` so the caching allocator does not recycle them early.
- **Waits are stream-side.** :meth:`_Work.wait` (and a synchronous call) makes the caller's current stream wait for
  the primitive's completion event (``wait_event``) and returns at once: the host never blocks on a collective. The
  one exception is the count exchange (``all_gather``), whose result the host reads right away (the planner's
  input): there the host waits for the event, bounded by the timeout.
- **The timeout is watched off the caller's thread.** With ``timeout_s`` (``hecate.collective_timeout_s``) every
  primitive is handed to the transport's :class:`Watchdog` (one daemon thread per transport) with its deadline. The
  watchdog polls the completion events in issue order; when one is overdue it aborts the NCCL communicator (which
  ends NCCL's kernels, so the streams waiting on them move on and no host call hangs) and records the failure. The
  next call on this transport, or the next wait, raises it as ``TimeoutError`` naming the primitive that stalled
  (the Communicator turns it into ``HecateCollectiveError`` naming the collective, layer and phase).

The NCCL unique id is created by rank 0 of Hecate's torch.distributed group and broadcast over it (not needed on
one rank); object collectives go through that group too.
"""
from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
import weakref
from typing import Any, Callable, Deque, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from ...errors import HecateError
from ..transport import DeviceOps

#: host polling interval of the count exchange's host-side wait (the only one)
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
        """An event recorded on the communication stream after the work just queued (no timing: cheaper)."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def join(self, event) -> None:
        """Stream-side wait: the caller's current stream waits for ``event``; the host does not."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def bind_thread(self) -> None:
        """Called once on the watchdog's thread before it queries events: the device is per thread in CUDA."""
        torch.cuda.set_device(self.device)


class _Inflight:
    """One primitive the watchdog watches: its event is None while the host is still enqueueing it (NCCL's group
    end may block the host, e.g. connecting to a dead peer, and the abort must reach that too)."""

    __slots__ = ("what", "deadline", "event")

    def __init__(self, what: str, deadline: float) -> None:
        self.what, self.deadline, self.event = what, deadline, None


class Watchdog:
    """Deadlines of one transport's primitives in flight, checked by a daemon thread (never the caller's).

    Primitives of one transport complete in issue order (one stream), so only the oldest needs polling. When it is
    overdue, ``expire(what)`` is called on the transport (held weakly: a dropped transport ends the thread) and
    everything still in flight is forgotten (the communicator is gone).
    """

    def __init__(self, owner: "CupyTransport", timeout_s: float, bind_thread: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self.poll_s = max(1e-3, min(0.1, timeout_s / 20))
        self._owner = weakref.ref(owner)
        self._bind_thread = bind_thread
        self._queue: Deque[_Inflight] = collections.deque()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self.stopped = False

    def begin(self, what: str) -> _Inflight:
        """Watch a primitive from now on (before the host enqueues it)."""
        entry = _Inflight(what, time.monotonic() + self.timeout_s)
        with self._cond:
            self._queue.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ds_hecate-nccl-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        return entry

    def enqueued(self, entry: _Inflight, event) -> None:
        entry.event = event

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._queue.clear()
            self._cond.notify()

    def _run(self) -> None:
        try:
            self._bind_thread()
        except Exception:  # noqa: BLE001 - querying from the default device still works for one device
            pass
        while True:
            with self._cond:
                while not self._queue and not self.stopped:
                    self._cond.wait(timeout=1.0)
                    if self._owner() is None:
                        return
                if self.stopped:
                    return
                head = self._queue[0]
            if head.event is not None and head.event.query():
                with self._cond:
                    if self._queue and self._queue[0] is head:
                        self._queue.popleft()
                continue
            if time.monotonic() > head.deadline:
                owner = self._owner()
                self.stop()
                if owner is not None:
                    owner.expire(head.what)
                return
            time.sleep(self.poll_s)


class _Work:
    """A primitive in flight: :meth:`wait` orders the caller's stream after it (stream-side; the host goes on)."""

    def __init__(self, transport: "CupyTransport", event, what: str) -> None:
        self.transport, self.event, self.what = transport, event, what

    def wait(self) -> None:
        if self.event is not None:
            self.transport.check()
            self.transport.streams.join(self.event)
            self.event = None


class CupyTransport:
    """NCCL (cupy.cuda.nccl) on Hecate's ranks, one CUDA device per rank; its own NCCL communicator and stream."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int, device: torch.device,
                 timeout_s: Optional[float] = None, comm: Any = None, streams: Any = None,
                 nccl: Any = None, device_ops: Optional[DeviceOps] = None) -> None:
        if device.type != "cuda":
            raise HecateError(f"the CuPy+NCCL transport needs a CUDA device, got {device}")
        if device.index is None:   # tensors report cuda:<index>: compare like with like
            device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.timeout_s = timeout_s
        self.aborted = False
        #: why this transport stopped (a collective overran the timeout), raised by every later call
        self.failure: Optional[str] = None
        self.streams = streams if streams is not None else CudaStreams(device)
        self.comm = comm if comm is not None else self._nccl_communicator()
        if nccl is None:
            from cupy.cuda import nccl as cupy_nccl
            nccl = cupy_nccl
        self.nccl = nccl  # the module (a stand-in in the CPU tests)
        if device_ops is None:
            from .device_ops import KernelDeviceOps
            device_ops = KernelDeviceOps()
        self.device_ops = device_ops
        self.watchdog = (Watchdog(self, timeout_s, getattr(self.streams, "bind_thread", lambda: None))
                         if timeout_s else None)
        self._ops = {dist.ReduceOp.SUM: nccl.NCCL_SUM, dist.ReduceOp.MAX: nccl.NCCL_MAX,
                     dist.ReduceOp.MIN: nccl.NCCL_MIN, dist.ReduceOp.PRODUCT: nccl.NCCL_PROD}
        self._types = {torch.float32: nccl.NCCL_FLOAT32, torch.float64: nccl.NCCL_FLOAT64,
                       torch.float16: nccl.NCCL_FLOAT16, torch.bfloat16: nccl.NCCL_BFLOAT16,
                       torch.int32: nccl.NCCL_INT32, torch.int64: nccl.NCCL_INT64, torch.uint8: nccl.NCCL_UINT8}

    def _nccl_communicator(self):
        import cupy
        from cupy.cuda import nccl

        uid = [nccl.get_unique_id() if self.rank == 0 else None]
        if self.world_size > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast_object_list(uid, src=src, group=self.group)
        with cupy.cuda.Device(self.device.index):
            return nccl.NcclCommunicator(self.world_size, uid[0], self.rank)

    # -- failure, waiting and aborting ------------------------------------------------------------------------
    def expire(self, what: str) -> None:
        """A primitive overran the timeout (the watchdog's call, or the host wait's): abort and remember why."""
        if self.failure is None:
            self.failure = (f"NCCL {what} did not complete within {self.timeout_s:g} s; the NCCL communicator was "
                            "aborted")
        self.abort()

    def check(self) -> None:
        """Raise the recorded failure, if any (every call and every wait does)."""
        if self.failure is not None:
            raise TimeoutError(self.failure)
        if self.aborted:
            raise RuntimeError("the NCCL communicator was aborted")

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            if self.watchdog is not None:
                self.watchdog.stop()
            self.comm.abort()

    def host_wait(self, event, what: str) -> None:
        """Block the host until ``event`` completes (the count exchange: the host reads the result next), at most
        ``timeout_s``; then order the caller's stream after it."""
        if self.timeout_s:
            deadline = time.monotonic() + self.timeout_s
            while not event.query():
                self.check()
                if time.monotonic() > deadline:
                    self.expire(what)
                    self.check()
                time.sleep(POLL_S)
        else:
            event.synchronize()
        self.check()
        self.streams.join(event)

    # -- a chain of primitives issued at once (the relay trees, ds_hecate.comm.relay) ---------------------------
    @property
    def stream_ordered(self) -> bool:
        """Always: every primitive runs on the communication stream in issue order and waits are stream-side."""
        return True

    @contextlib.contextmanager
    def relay_scope(self, tensors: Sequence[torch.Tensor]) -> Iterator[Callable[[], None]]:
        """:meth:`~ds_hecate.comm.transport.Transport.relay_scope` on the communication stream itself: the chain's
        primitives and the device work between them queue there after the caller's work so far, and the function
        given orders the caller's stream after the chain (an event; the host goes on)."""
        self.check()
        ended: List[Any] = []

        def join() -> None:
            self.check()
            self.streams.join(ended[0])
        with self.streams.start(tensors):
            yield join
        ended.append(self.streams.done())

    def _launch(self, what: str, tensors: Sequence[torch.Tensor], body: Callable[[int], None],
                async_op: bool, host_wait: bool = False) -> Optional[_Work]:
        self.check()
        for t in tensors:
            if t.device != self.device:
                raise HecateError(f"the CuPy+NCCL transport got a tensor on {t.device} for {what}, expected "
                                  f"{self.device}")
        entry = self.watchdog.begin(what) if self.watchdog is not None else None
        try:
            with self.streams.start(tensors):
                body(self.streams.handle())
        except Exception:
            self.check()   # aborted by the watchdog while the host was enqueueing: say so
            raise
        event = self.streams.done()
        if entry is not None:
            assert self.watchdog is not None   # the entry is the watchdog's
            self.watchdog.enqueued(entry, event)
        if host_wait:
            self.host_wait(event, what)
            return None
        work = _Work(self, event, what)
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
        """The count exchange's primitive: the host reads ``out`` next, so the host waits here (bounded)."""
        self._launch("all-gather", [out, local], lambda s: self.comm.allGather(
            local.data_ptr(), out.data_ptr(), local.numel(), self._dtype(local.dtype), s), False, host_wait=True)

    def all_reduce(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        if op not in self._ops:
            raise HecateError(f"the CuPy+NCCL transport does not implement all_reduce with {op}")
        self._launch("all-reduce", [value], lambda s: self.comm.allReduce(
            value.data_ptr(), value.data_ptr(), value.numel(), self._dtype(value.dtype), self._ops[op], s), False)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Expert-data-parallel gradient reduction at the accumulation boundary (sum)."""
        self._launch("reduce-scatter", [out, inp], lambda s: self.comm.reduceScatter(
            inp.data_ptr(), out.data_ptr(), out.numel(), self._dtype(out.dtype), self.nccl.NCCL_SUM, s), False)

    def broadcast(self, value: torch.Tensor, src: int) -> None:
        self._launch("broadcast", [value], lambda s: self.comm.bcast(
            value.data_ptr(), value.numel(), self._dtype(value.dtype), src, s), False)

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Through Hecate's torch.distributed group (objects are host data); on one rank no group is needed, as
        for the NCCL unique id."""
        self.check()
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

