"""Hecate's collectives over its own process group: count exchange, SparseAllGather, SparseReduceScatter, the expert
move and the ragged token all-to-all, implemented once over a :mod:`~ds_hecate.comm.transport` (torch.distributed, or
NCCL through CuPy).

All of them are built on a ragged all-to-all with split sizes (gloo has no uneven all_gather). Who sends what is
read from the :class:`~ds_hecate.planning.Placement` / :class:`~ds_hecate.planning.LayerPlan`, identical on every
rank, so every rank issues the same collectives in the same order; a collective is skipped only when the plan says
it is empty on every rank.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..errors import HecateCollectiveError, HecateError
from ..planning import Placement
from .transport import TorchTransport, Transport


@dataclass
class CommCounters:
    """Bytes this rank sent, per kind of traffic (local copies excluded), and calls per collective."""

    allgather_bytes: int = 0
    reducescatter_bytes: int = 0
    dispatch_bytes: int = 0
    calls: Dict[str, int] = field(default_factory=dict)

    def count(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def add(self, other: "CommCounters") -> None:
        self.allgather_bytes += other.allgather_bytes
        self.reducescatter_bytes += other.reducescatter_bytes
        self.dispatch_bytes += other.dispatch_bytes
        for k, v in other.calls.items():
            self.calls[k] = self.calls.get(k, 0) + v

    def as_dict(self) -> dict:
        return {"bytes_allgather": self.allgather_bytes, "bytes_reducescatter": self.reducescatter_bytes,
                "bytes_dispatch": self.dispatch_bytes, "calls": dict(self.calls)}


class PendingGather:
    """A SparseAllGather in flight; :meth:`wait` returns (expert -> flat tensor, receive buffers of the replicas)."""

    def __init__(self, placement: Placement, finish: Callable[[], Tuple[Dict[int, torch.Tensor],
                                                                       List[torch.Tensor]]]) -> None:
        self.placement = placement
        self._finish = finish
        self._result: Optional[Tuple[Dict[int, torch.Tensor], List[torch.Tensor]]] = None

    def wait(self) -> Tuple[Dict[int, torch.Tensor], List[torch.Tensor]]:
        if self._result is None:
            self._result = self._finish()
            self._finish = None  # type: ignore[assignment]
        return self._result


def local_materialized(placement: Placement, rank: int, owned: Dict[int, torch.Tensor],
                       dtype: torch.dtype) -> Dict[int, torch.Tensor]:
    """The experts of ``placement`` this rank materializes from its own masters (a view when ``dtype`` is the
    master's, else a cast copy): the part of a SparseAllGather that never crosses the wire."""
    result: Dict[int, torch.Tensor] = {}
    for e in placement.materialized[rank]:
        if placement.owners[e] == rank:
            master = owned[e]
            result[e] = master.detach() if master.dtype == dtype else master.detach().to(dtype)
    return result


@dataclass
class ExpertMove:
    """This rank's part of a one-off expert redistribution: experts kept, sent per destination, received per
    source (each list in expert order)."""

    kept: List[int]
    sends: Dict[int, List[int]]
    recvs: Dict[int, List[int]]

    @staticmethod
    def of(sources: Sequence[int], owners: Sequence[int], rank: int) -> "ExpertMove":
        move = ExpertMove([], {}, {})
        for e, (src, dst) in enumerate(zip(sources, owners)):
            if src == dst == rank:
                move.kept.append(e)
            elif src == rank:
                move.sends.setdefault(dst, []).append(e)
            elif dst == rank:
                move.recvs.setdefault(src, []).append(e)
        return move


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Communicator:
    """Hecate's collectives, implemented once over a :class:`~ds_hecate.comm.transport.Transport`; one per runtime.

    Every tensor it creates or hands to the transport is on ``self.device`` (the rank's working device), whatever
    the rank has to send, so every rank takes the same path and issues the same primitives.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int,
                 timeout_s: Optional[float] = None, device: Optional[torch.device] = None,
                 transport: Optional[Transport] = None) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.transport: Transport = (transport if transport is not None else
                                     TorchTransport(group, rank, world_size, device or torch.device("cpu")))
        self.device = torch.device(self.transport.device)
        self.activity = "work outside the MoE layers"  # what the caller is doing; named when a collective fails

    @contextlib.contextmanager
    def during(self, activity: str):
        """Name what the collectives issued inside this block are for (shown if one of them fails)."""
        previous, self.activity = self.activity, activity
        try:
            yield
        finally:
            self.activity = previous

    @contextlib.contextmanager
    def _guard(self, collective: str):
        """Turn a backend failure (peer gone, timeout) into an error that says which collective was waiting."""
        try:
            yield
        except HecateError:
            raise
        except (RuntimeError, TimeoutError) as exc:
            lines = str(exc).strip().splitlines()
            cause = f"{type(exc).__name__}: {lines[0] if lines else ''}"
            limit = (f"hecate.collective_timeout_s = {self.timeout_s:g} s" if self.timeout_s
                     else "the process group's timeout")
            raise HecateCollectiveError(
                f"Hecate collective '{collective}' failed on rank {self.rank} of {self.world_size} during "
                f"{self.activity} ({cause}). Another rank probably died or stopped responding; Hecate's collectives "
                f"wait at most {limit}. See the other ranks' logs.") from exc

    # ------------------------------------------------------------------------------------------------------------
    def all_to_all(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                   async_op: bool = False, collective: str = "token all-to-all"):
        """Ragged all-to-all along dim 0. Returns the receive tensor (and the Work handle when ``async_op``)."""
        if self.world_size == 1:
            return (send, None) if async_op else send
        recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        with self._guard(collective):
            work = self.transport.all_to_all(recv, send.contiguous(), list(recv_splits), list(send_splits),
                                             async_op)
        return (recv, work) if async_op else recv

    def wait(self, work, collective: str) -> None:
        """Wait for an async collective, naming it if it fails."""
        if work is not None:
            with self._guard(collective):
                work.wait()

    def exchange_counts(self, local_counts: torch.Tensor) -> "np.ndarray":
        """All ranks' per-expert token-expert pair counts as a host ``[ranks, n]`` int64 array (the planner's
        input; one device-to-host copy, no Python lists: at 1,024 ranks x 256 experts those alone cost ms)."""
        local = local_counts.to(device=self.device, dtype=torch.int64).reshape(-1).contiguous()
        if self.world_size == 1:
            return local.cpu().numpy().reshape(1, -1)
        out = torch.empty(self.world_size * local.numel(), dtype=torch.int64, device=self.device)
        with self._guard("token-count exchange"):
            self.transport.all_gather(out, local)
        return out.view(self.world_size, -1).cpu().numpy()

    def all_reduce(self, value: torch.Tensor, op=dist.ReduceOp.SUM, collective: str = "all-reduce") -> torch.Tensor:
        """In-place all-reduce of a tensor on ``self.device``."""
        if self.world_size > 1:
            with self._guard(collective):
                self.transport.all_reduce(value, op)
        return value

    def broadcast(self, value: torch.Tensor, src: int = 0, collective: str = "broadcast") -> torch.Tensor:
        """In-place broadcast from group rank ``src`` of a tensor on ``self.device``."""
        if self.world_size > 1:
            with self._guard(collective):
                self.transport.broadcast(value, src)
        return value

    def barrier(self, collective: str = "barrier") -> None:
        self.all_reduce(torch.zeros(1, dtype=torch.float32, device=self.device), collective=collective)

    def all_gather_object(self, obj, collective: str = "all-gather of Python objects") -> list:
        if self.world_size == 1:
            return [obj]
        with self._guard(collective):
            return self.transport.all_gather_object(obj)

    # ------------------------------------------------------------------------------------------------------------
    def exchange_chunks(self, sends: Dict[int, List[torch.Tensor]], recv_lists: Dict[int, List[int]],
                        numel: int, dtype: torch.dtype, async_op: bool,
                        collective: str) -> Callable[[], Dict[int, List[torch.Tensor]]]:
        """Send per-destination lists of equal-size flat chunks (cast to ``dtype``, on ``self.device``); returns a
        function giving the received chunks per source, in ``recv_lists`` order. The one primitive under
        SparseAllGather, SparseReduceScatter, the expert move and re-sharding."""
        send_splits = [len(sends.get(d, ())) * numel for d in range(self.world_size)]
        recv_splits = [len(recv_lists.get(s, ())) * numel for s in range(self.world_size)]
        parts = [t.reshape(-1).to(device=self.device, dtype=dtype)
                 for d in range(self.world_size) for t in sends.get(d, ())]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=self.device)
        recv, work = self.all_to_all(send, send_splits, recv_splits, async_op=True, collective=collective)

        def finish() -> Dict[int, List[torch.Tensor]]:
            self.wait(work, collective)
            out: Dict[int, List[torch.Tensor]] = {}
            offset = 0
            for src in range(self.world_size):
                for _ in recv_lists.get(src, ()):
                    out.setdefault(src, []).append(recv.narrow(0, offset, numel))
                    offset += numel
            return out
        if not async_op:
            received = finish()
            return lambda: received
        return finish

    def start_sparse_all_gather(self, placement: Placement, owned: Dict[int, torch.Tensor], numel: int,
                                dtype: torch.dtype, counters: CommCounters, async_op: bool = True) -> PendingGather:
        """spAG(P, P'): start materializing this rank's experts of ``placement``; :meth:`PendingGather.wait` gives
        them as flat ``dtype`` vectors.

        Owned experts are local (a view of the fp32 master when ``dtype`` is fp32, else a cast copy); every other
        materialized expert is sent by its owner, and only the pairs in P' \\ P cross the wire. The wait also
        returns the receive buffers the replicas view into, so callers can tell when replica memory is freed.
        """
        result = local_materialized(placement, self.rank, owned, dtype)
        if placement.num_moved == 0:
            return PendingGather(placement, lambda: (result, []))
        counters.count("allgather")
        send_lists = {dst: [owned[e] for e in experts] for dst, experts in placement.gather_sends(self.rank).items()}
        recv_lists = placement.gather_recvs(self.rank)
        finish_exchange = self.exchange_chunks(send_lists, recv_lists, numel, dtype, async_op, "SparseAllGather")
        counters.allgather_bytes += sum(len(v) for v in send_lists.values()) * numel * _itemsize(dtype)

        def finish():
            received = finish_exchange()
            replicas = {id(c._base): c._base for chunks in received.values() for c in chunks}
            for src, experts in recv_lists.items():
                for e, chunk in zip(experts, received[src]):
                    result[e] = chunk
            return result, list(replicas.values())
        return PendingGather(placement, finish)

    def start_sparse_reduce_scatter(self, placement: Placement, grads: Dict[int, torch.Tensor], numel: int,
                                    wire_dtype: torch.dtype, counters: CommCounters,
                                    async_op: bool = True) -> Callable[[], Dict[int, torch.Tensor]]:
        """spRS(P', P): sum every materialized copy's gradient onto the expert's owner.

        ``grads`` holds this rank's gradient for each of its materialized experts. Returns a function that waits
        for the exchange and gives, for each expert this rank owns, the sum over all ranks (fp32), summed in a fixed
        order: own copy first, then by source rank.
        """
        totals: Dict[int, torch.Tensor] = {}
        for e in placement.materialized[self.rank]:
            if placement.owners[e] == self.rank:
                totals[e] = grads[e].to(torch.float32)
        if placement.num_moved == 0:
            return lambda: totals
        counters.count("reducescatter")
        # As a replica, send to each owner the experts it sent us in spAG (same lists, opposite direction).
        send_lists = {owner: [grads[e] for e in experts]
                      for owner, experts in placement.gather_recvs(self.rank).items()}
        recv_lists = placement.gather_sends(self.rank)
        finish_exchange = self.exchange_chunks(send_lists, recv_lists, numel, wire_dtype, async_op,
                                               "SparseReduceScatter")
        counters.reducescatter_bytes += (sum(len(v) for v in send_lists.values()) * numel
                                         * _itemsize(wire_dtype))

        def finish() -> Dict[int, torch.Tensor]:
            received = finish_exchange()
            for src in range(self.world_size):
                for e, chunk in zip(recv_lists.get(src, ()), received.get(src, ())):
                    totals[e] = totals[e] + chunk.to(torch.float32)
            return totals
        return finish

    def move_experts(self, sources: Sequence[int], owners: Sequence[int], local: Dict[int, torch.Tensor],
                     numel: int) -> Dict[int, torch.Tensor]:
        """One-off redistribution: expert e's flat fp32 chunk goes from rank ``sources[e]`` to ``owners[e]``; the
        results are on ``self.device`` (wherever ``local`` was: a model built on the CPU).

        Used at conversion (experts start replicated, taken from rank 0 as DeepSpeed's broadcast does, or spread
        over expert-parallel ranks) and when re-sharding (chunks then carry optimizer state too).
        """
        move = ExpertMove.of(sources, owners, self.rank)
        kept = {e: local[e].to(device=self.device, dtype=torch.float32).clone() for e in move.kept}
        if any(s != d for s, d in zip(sources, owners)):
            sends = {dst: [local[e] for e in experts] for dst, experts in move.sends.items()}
            received = self.exchange_chunks(sends, move.recvs, numel, torch.float32, False, "expert move")()
            for src, experts in move.recvs.items():
                for e, chunk in zip(experts, received[src]):
                    kept[e] = chunk.clone()
        return kept


class AllToAllTokens(torch.autograd.Function):
    """Differentiable ragged all-to-all of token rows; backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, send_splits: List[int], recv_splits: List[int],
                counters: CommCounters, where: str = "an MoE layer") -> torch.Tensor:
        ctx.comm, ctx.send_splits, ctx.recv_splits, ctx.counters, ctx.where = (comm, send_splits, recv_splits,
                                                                              counters, where)
        return _token_exchange(comm, x, send_splits, recv_splits, counters)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with ctx.comm.during(f"backward of {ctx.where}"):
            grad_in = _token_exchange(ctx.comm, grad, ctx.recv_splits, ctx.send_splits, ctx.counters)
        return grad_in, None, None, None, None, None


def _token_exchange(comm: Communicator, x: torch.Tensor, send_splits: List[int], recv_splits: List[int],
                    counters: CommCounters) -> torch.Tensor:
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    counters.dispatch_bytes += row_bytes * sum(s for d, s in enumerate(send_splits) if d != comm.rank)
    counters.count("alltoall")
    return comm.all_to_all(x, send_splits, recv_splits)
