"""Hecate's collectives over NCCL through CuPy, on a CUDA stream of their own.

Same interface and results as :class:`ds_hecate.collectives.Communicator` (which the runtime, the plans and the
tests drive unchanged), but:

- the sparse collectives and the token all-to-all are NCCL grouped point-to-point calls (``groupStart``; one
  ``send``/``recv`` per peer with data; ``groupEnd``), the same volume as the paper's Broadcast/Reduce groups,
  with no padding and no intermediate all-to-all split bookkeeping;
- they run on a dedicated communication stream: the caller's (compute) stream records an event after the send
  buffer is packed, the communication stream waits on it, and the result is handed out by making the compute stream
  wait on the communication stream's completion event. The host never blocks, so a prefetched SparseAllGather runs
  beside the non-MoE compute until :meth:`PendingGather.wait` is called. Buffers used on the communication stream
  are marked with ``record_stream`` so torch's caching allocator does not recycle them early;
- packing (with the fp32 -> compute-dtype cast), unpacking and the owner-side gradient sum are the CUDA kernels
  of ``kernels/sparse_collectives.cu`` (:mod:`ds_hecate.gpu.kernels`).

The NCCL unique id is created by rank 0 of Hecate's torch.distributed group and broadcast over that group.
Object collectives (``all_gather_object``, ``barrier``) stay on torch.distributed.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..collectives import CommCounters, Communicator, ExpertMove, PendingGather, _itemsize, local_materialized
from ..errors import HecateError
from ..planning import Placement
from . import kernels
from .layout import gather_layout, owned_materialized, reduce_chunk_lists, reduce_layout

#: One transfer: (peer rank, flat contiguous CUDA tensor).
Transfer = Tuple[int, torch.Tensor]


class NcclTransport:
    """The NCCL communicator (cupy.cuda.nccl.NcclCommunicator) of Hecate's group, and the calls it needs."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int, device: torch.device) -> None:
        import cupy
        from cupy.cuda import nccl

        self.nccl = nccl
        self.rank = rank
        self.world_size = world_size
        uid = [nccl.get_unique_id() if rank == 0 else None]
        # broadcast_object_list's src is a global rank: the group's rank 0.
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(uid, src=src, group=group)
        with cupy.cuda.Device(device.index):
            self.comm = nccl.NcclCommunicator(world_size, uid[0], rank)
        self._ops = {dist.ReduceOp.SUM: nccl.NCCL_SUM, dist.ReduceOp.MAX: nccl.NCCL_MAX,
                     dist.ReduceOp.MIN: nccl.NCCL_MIN, dist.ReduceOp.PRODUCT: nccl.NCCL_PROD}
        self._types = {torch.float32: nccl.NCCL_FLOAT32, torch.float64: nccl.NCCL_FLOAT64,
                       torch.float16: nccl.NCCL_FLOAT16, torch.bfloat16: nccl.NCCL_BFLOAT16,
                       torch.int32: nccl.NCCL_INT32, torch.int64: nccl.NCCL_INT64, torch.uint8: nccl.NCCL_UINT8}

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], stream: torch.cuda.Stream) -> None:
        """Grouped point-to-point: every send and receive in one NCCL group, as raw bytes, on ``stream``."""
        self.nccl.groupStart()
        try:
            for peer, t in sends:
                self.comm.send(t.data_ptr(), t.numel() * t.element_size(), self.nccl.NCCL_UINT8, peer,
                               stream.cuda_stream)
            for peer, t in recvs:
                self.comm.recv(t.data_ptr(), t.numel() * t.element_size(), self.nccl.NCCL_UINT8, peer,
                               stream.cuda_stream)
        finally:
            self.nccl.groupEnd()

    def all_gather(self, send: torch.Tensor, recv: torch.Tensor, stream: torch.cuda.Stream) -> None:
        self.comm.allGather(send.data_ptr(), recv.data_ptr(), send.numel(), self._dtype(send.dtype),
                            stream.cuda_stream)

    def all_reduce(self, value: torch.Tensor, op, stream: torch.cuda.Stream) -> None:
        if op not in self._ops:
            raise HecateError(f"the CuPy+NCCL backend does not implement all_reduce with {op}")
        self.comm.allReduce(value.data_ptr(), value.data_ptr(), value.numel(), self._dtype(value.dtype),
                            self._ops[op], stream.cuda_stream)

    def _dtype(self, dtype: torch.dtype) -> int:
        if dtype not in self._types:
            raise HecateError(f"the CuPy+NCCL backend cannot reduce or gather {dtype} tensors")
        return self._types[dtype]


class _Work:
    """The handle :meth:`CupyNcclCommunicator.all_to_all` returns with ``async_op``: ``wait()`` orders the
    caller's stream after the exchange (no host synchronisation), like a torch NCCL Work."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish = finish

    def wait(self) -> None:
        if self._finish is not None:
            self._finish()
            self._finish = None


class CupyNcclCommunicator(Communicator):
    """:class:`~ds_hecate.collectives.Communicator` whose data collectives are NCCL calls through CuPy on a
    dedicated CUDA stream, with the pack/unpack/reduce kernels of :mod:`ds_hecate.gpu.kernels`."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int, device: torch.device,
                 transport=None, timeout_s: Optional[float] = None) -> None:
        super().__init__(group, rank, world_size, timeout_s=timeout_s)
        if device.type != "cuda":
            raise HecateError(f"the CuPy+NCCL backend needs a CUDA device, got {device}")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.stream = torch.cuda.Stream(device=self.device)
        self.transport = transport if transport is not None else NcclTransport(group, rank, world_size, self.device)

    # -- stream plumbing -----------------------------------------------------------------------------------------
    def _on_comm_stream(self, launch: Callable[[torch.cuda.Stream], None], tensors: Sequence[torch.Tensor],
                        async_op: bool) -> Callable[[], None]:
        """Run ``launch(comm_stream)`` after the work already queued on the caller's stream; return a function
        that makes the then-current stream wait for it (called at once unless ``async_op``)."""
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        self.stream.wait_event(ready)
        for t in tensors:
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            launch(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)

        def finish() -> None:
            torch.cuda.current_stream(self.device).wait_event(done)
        if not async_op:
            finish()
        return finish

    def _cuda(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if t.device != self.device:
            raise HecateError(f"the CuPy+NCCL backend got {what} on {t.device}, expected {self.device}; "
                              "Hecate's expert shards and tokens must live on the rank's CUDA device")
        return t

    def _exchange_flat(self, send: torch.Tensor, send_counts: Sequence[int], recv: torch.Tensor,
                       recv_counts: Sequence[int], async_op: bool, collective: str) -> Callable[[], None]:
        """Ragged exchange of a flat send buffer (``send_counts[d]`` elements to rank d, in rank order) into a flat
        receive buffer (``recv_counts[s]`` from rank s, in rank order). The part for this rank is a device copy."""
        sends, recvs, local = [], [], None
        s_off = r_off = 0
        for peer in range(self.world_size):
            s_n, r_n = int(send_counts[peer]), int(recv_counts[peer])
            if peer == self.rank:
                if s_n != r_n:
                    raise HecateError(f"rank {self.rank} sends {s_n} elements to itself but expects {r_n}")
                if s_n:
                    local = (send.narrow(0, s_off, s_n), recv.narrow(0, r_off, r_n))
            else:
                if s_n:
                    sends.append((peer, send.narrow(0, s_off, s_n)))
                if r_n:
                    recvs.append((peer, recv.narrow(0, r_off, r_n)))
            s_off += s_n
            r_off += r_n

        def launch(stream: torch.cuda.Stream) -> None:
            if local is not None:
                local[1].copy_(local[0])
            if sends or recvs:
                self.transport.exchange(sends, recvs, stream)
        with self._guard(collective):
            return self._on_comm_stream(launch, [send, recv], async_op)

    # -- dense helpers -------------------------------------------------------------------------------------------
    def all_to_all(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                   async_op: bool = False, collective: str = "token all-to-all"):
        """Ragged all-to-all of rows along dim 0 (token dispatch and combine)."""
        if self.world_size == 1:
            return (send, None) if async_op else send
        send = self._cuda(send, "token rows").contiguous()
        row = math.prod(send.shape[1:])
        recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        finish = self._exchange_flat(send.view(-1), [n * row for n in send_splits], recv.view(-1),
                                     [n * row for n in recv_splits], async_op, collective)
        return (recv, _Work(finish)) if async_op else recv

    def exchange_counts(self, local_counts: torch.Tensor) -> List[List[int]]:
        local = local_counts.to(device=self.device, dtype=torch.int64).reshape(-1).contiguous()
        if self.world_size == 1:
            return [local.tolist()]
        out = torch.empty(self.world_size * local.numel(), dtype=torch.int64, device=self.device)
        with self._guard("token-count exchange"):
            self._on_comm_stream(lambda s: self.transport.all_gather(local, out, s), [local, out], async_op=False)
        return out.view(self.world_size, -1).tolist()

    def all_reduce(self, value: torch.Tensor, op=dist.ReduceOp.SUM, collective: str = "all-reduce") -> torch.Tensor:
        if self.world_size == 1:
            return value
        if not value.is_cuda:  # e.g. a CPU scalar: torch.distributed, as the torch backend does
            return super().all_reduce(value, op, collective=collective)
        if not value.is_contiguous():
            raise HecateError("the CuPy+NCCL backend all-reduces contiguous tensors only")
        with self._guard(collective):
            self._on_comm_stream(lambda s: self.transport.all_reduce(value, op, s), [value], async_op=False)
        return value

    # -- sparse collectives --------------------------------------------------------------------------------------
    def start_sparse_all_gather(self, placement: Placement, owned: Dict[int, torch.Tensor], numel: int,
                                dtype: torch.dtype, counters: CommCounters, async_op: bool = True) -> PendingGather:
        """spAG(P, P'): see :meth:`Communicator.start_sparse_all_gather`. Owners pack the experts each peer lacks
        (fp32 master -> ``dtype`` in the pack kernel), one NCCL group moves them; replicas are views of the receive
        buffer (no unpack copy: the expert kernels read them in place)."""
        result = local_materialized(placement, self.rank, owned, dtype)
        if placement.num_moved == 0:
            return PendingGather(placement, lambda: (result, []))
        counters.count("allgather")
        lay = gather_layout(placement, self.rank)
        send = torch.empty(len(lay.send_experts) * numel, dtype=dtype, device=self.device)
        kernels.pack_chunks([self._cuda(owned[e].detach(), f"expert {e}") for e in lay.send_experts], send, numel)
        recv = torch.empty(len(lay.recv_experts) * numel, dtype=dtype, device=self.device)
        finish_exchange = self._exchange_flat(send, [n * numel for n in lay.send_counts], recv,
                                              [n * numel for n in lay.recv_counts], async_op, "SparseAllGather")
        counters.allgather_bytes += len(lay.send_experts) * numel * _itemsize(dtype)

        def finish():
            finish_exchange()
            for index, e in enumerate(lay.recv_experts):
                result[e] = recv.narrow(0, index * numel, numel)
            return result, [recv]
        return PendingGather(placement, finish)

    def start_sparse_reduce_scatter(self, placement: Placement, grads: Dict[int, torch.Tensor], numel: int,
                                    wire_dtype: torch.dtype, counters: CommCounters,
                                    async_op: bool = True) -> Callable[[], Dict[int, torch.Tensor]]:
        """spRS(P', P): see :meth:`Communicator.start_sparse_reduce_scatter`. Replicas pack their gradients
        (cast to ``wire_dtype``), one NCCL group moves them, and the owner's reduce kernel adds them to its own
        copy in fp32, own copy first, then by source rank (the torch backend's order, bit for bit)."""
        own = owned_materialized(placement, self.rank)
        if placement.num_moved == 0:
            return lambda: {e: grads[e].to(torch.float32) for e in own}
        counters.count("reducescatter")
        lay = reduce_layout(placement, self.rank)
        send = torch.empty(len(lay.send_experts) * numel, dtype=wire_dtype, device=self.device)
        kernels.pack_chunks([self._cuda(grads[e].detach().contiguous(), f"gradient of expert {e}")
                             for e in lay.send_experts], send, numel)
        recv = torch.empty(len(lay.recv_experts) * numel, dtype=wire_dtype, device=self.device)
        finish_exchange = self._exchange_flat(send, [n * numel for n in lay.send_counts], recv,
                                              [n * numel for n in lay.recv_counts], async_op, "SparseReduceScatter")
        counters.reducescatter_bytes += len(lay.send_experts) * numel * _itemsize(wire_dtype)
        chunk_lists = reduce_chunk_lists(placement, self.rank)

        def finish() -> Dict[int, torch.Tensor]:
            finish_exchange()
            if not own:
                return {}
            bases = [self._cuda(grads[e].detach().contiguous(), f"gradient of expert {e}") for e in own]
            if len({b.dtype for b in bases}) > 1:
                bases = [b.to(torch.float32) for b in bases]
            totals = kernels.reduce_chunks(bases, recv, chunk_lists, numel)
            return dict(zip(own, totals))
        return finish

    def move_experts(self, sources: Sequence[int], owners: Sequence[int], local: Dict[int, torch.Tensor],
                     numel: int) -> Dict[int, torch.Tensor]:
        """See :meth:`Communicator.move_experts`; received chunks are unpacked into separate fp32 tensors."""
        move = ExpertMove.of(sources, owners, self.rank)
        send_experts, recv_experts = move.sends, move.recvs
        kept = {e: local[e].to(torch.float32).clone() for e in move.kept}
        if not any(s != d for s, d in zip(sources, owners)):
            return kept
        order = [e for d in range(self.world_size) for e in send_experts.get(d, ())]
        send = torch.empty(len(order) * numel, dtype=torch.float32, device=self.device)
        kernels.pack_chunks([self._cuda(local[e].detach().reshape(-1).contiguous(), f"expert {e}") for e in order],
                            send, numel)
        incoming = [e for s in range(self.world_size) for e in recv_experts.get(s, ())]
        recv = torch.empty(len(incoming) * numel, dtype=torch.float32, device=self.device)
        self._exchange_flat(send, [len(send_experts.get(d, ())) * numel for d in range(self.world_size)],
                            recv, [len(recv_experts.get(s, ())) * numel for s in range(self.world_size)],
                            async_op=False, collective="expert move")
        fresh = {e: torch.empty(numel, dtype=torch.float32, device=self.device) for e in incoming}
        kernels.unpack_chunks(recv, [fresh[e] for e in incoming], numel)
        kept.update(fresh)
        return kept
