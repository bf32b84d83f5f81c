"""Hecate's collectives over its own process group: count exchange, SparseAllGather, SparseReduceScatter and the
ragged token all-to-all.

All of them are built on ``all_to_all_single`` with split sizes (gloo has no uneven all_gather). Who sends what is
read from the :class:`~ds_hecate.planning.LayerPlan`, which is identical on every rank, so every rank issues the
same collectives in the same order; a collective is skipped only when the plan says it is empty on every rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .planning import LayerPlan


@dataclass
class CommCounters:
    """Bytes this rank sent, per kind of traffic (local copies excluded)."""

    allgather_bytes: int = 0
    reducescatter_bytes: int = 0
    dispatch_bytes: int = 0
    calls: Dict[str, int] = field(default_factory=dict)

    def count(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def as_dict(self) -> dict:
        return {"bytes_allgather": self.allgather_bytes, "bytes_reducescatter": self.reducescatter_bytes,
                "bytes_dispatch": self.dispatch_bytes, "calls": dict(self.calls)}


class Communicator:
    """Collectives on one process group; one instance per Hecate runtime."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.counters = CommCounters()

    # ------------------------------------------------------------------------------------------------------------
    def all_to_all(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        """Ragged all-to-all along dim 0. With one rank it is a copy-free identity."""
        if self.world_size == 1:
            return send
        recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=list(recv_splits),
                               input_split_sizes=list(send_splits), group=self.group)
        return recv

    def count_token_bytes(self, rows: torch.Tensor, send_splits: Sequence[int]) -> None:
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        self.counters.dispatch_bytes += row_bytes * sum(s for d, s in enumerate(send_splits) if d != self.rank)

    def exchange_counts(self, local_counts: torch.Tensor) -> List[List[int]]:
        """All ranks' per-expert token-expert pair counts, as nested Python ints (the planner's input)."""
        self.counters.count("counts")
        local = local_counts.to(torch.int64).reshape(-1)
        if self.world_size == 1:
            return [local.tolist()]
        out = torch.empty(self.world_size * local.numel(), dtype=torch.int64, device=local.device)
        dist.all_gather_into_tensor(out, local, group=self.group)
        return out.view(self.world_size, -1).tolist()

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group)
        return value

    # ------------------------------------------------------------------------------------------------------------
    def _chunk_exchange(self, sends: Dict[int, List[torch.Tensor]], recv_numels: Dict[int, List[int]],
                        numel: int, dtype: torch.dtype, device: torch.device) -> Dict[int, List[torch.Tensor]]:
        """Send per-dst lists of equal-size flat chunks; return per-src lists of received chunks."""
        send_splits = [len(sends.get(d, ())) * numel for d in range(self.world_size)]
        recv_splits = [len(recv_numels.get(s, ())) * numel for s in range(self.world_size)]
        parts = [t.reshape(-1).to(dtype) for d in range(self.world_size) for t in sends.get(d, ())]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
        recv = self.all_to_all(send, send_splits, recv_splits)
        out: Dict[int, List[torch.Tensor]] = {}
        offset = 0
        for src in range(self.world_size):
            for _ in recv_numels.get(src, ()):
                out.setdefault(src, []).append(recv.narrow(0, offset, numel))
                offset += numel
        return out

    def sparse_all_gather(self, plan: LayerPlan, owned: Dict[int, torch.Tensor], numel: int,
                          dtype: torch.dtype) -> Tuple[Dict[int, torch.Tensor], List[torch.Tensor]]:
        """spAG(P, P'): the materialized experts of this rank, as flat ``dtype`` vectors.

        Owned experts are local (a view of the fp32 master when ``dtype`` is fp32, else a cast copy); every other
        materialized expert is sent by its owner, and only the pairs in P' \\ P cross the wire. Also returns the
        freshly allocated buffers the result views into, so callers can tell when that memory is released.
        """
        mine = plan.materialized[self.rank]
        result: Dict[int, torch.Tensor] = {}
        buffers: List[torch.Tensor] = []
        for e in mine:
            if plan.owners[e] == self.rank:
                master = owned[e]
                result[e] = master.detach() if master.dtype == dtype else master.detach().to(dtype)
                if master.dtype != dtype:
                    buffers.append(result[e])
        if plan.num_moved == 0:
            return result, buffers
        self.counters.count("allgather")
        device = next(iter(owned.values())).device if owned else torch.device("cpu")
        send_lists = {dst: [owned[e] for e in experts] for dst, experts in plan.gather_sends(self.rank).items()}
        recv_lists = plan.gather_recvs(self.rank)
        received = self._chunk_exchange(send_lists, recv_lists, numel, dtype, device)
        buffers.extend({id(c._base): c._base for chunks in received.values() for c in chunks}.values())
        self.counters.allgather_bytes += sum(len(v) for v in send_lists.values()) * numel * _itemsize(dtype)
        for src, experts in recv_lists.items():
            for e, chunk in zip(experts, received[src]):
                result[e] = chunk
        return result, buffers

    def sparse_reduce_scatter(self, plan: LayerPlan, grads: Dict[int, torch.Tensor], numel: int,
                              wire_dtype: torch.dtype) -> Dict[int, torch.Tensor]:
        """spRS(P', P): sum every materialized copy's gradient onto the expert's owner.

        ``grads`` holds this rank's gradient for each of its materialized experts. Returns, for each expert this
        rank owns, the sum over all ranks (fp32), summed in a fixed order: own copy first, then by source rank.
        """
        totals: Dict[int, torch.Tensor] = {}
        for e in plan.materialized[self.rank]:
            if plan.owners[e] == self.rank:
                totals[e] = grads[e].to(torch.float32)
        if plan.num_moved == 0:
            return totals
        self.counters.count("reducescatter")
        # As a replica, send to each owner the experts it sent us in spAG (same lists, opposite direction).
        send_lists = {owner: [grads[e] for e in experts] for owner, experts in plan.gather_recvs(self.rank).items()}
        recv_lists = plan.gather_sends(self.rank)
        device = next(iter(grads.values())).device if grads else torch.device("cpu")
        received = self._chunk_exchange(send_lists, recv_lists, numel, wire_dtype, device)
        self.counters.reducescatter_bytes += sum(len(v) for v in send_lists.values()) * numel * _itemsize(wire_dtype)
        for src in range(self.world_size):
            for e, chunk in zip(recv_lists.get(src, ()), received.get(src, ())):
                totals[e] = totals[e] + chunk.to(torch.float32)
        return totals

    def move_experts(self, sources: Sequence[int], owners: Sequence[int], local: Dict[int, torch.Tensor],
                     numel: int) -> Dict[int, torch.Tensor]:
        """One-off redistribution: expert e goes from rank ``sources[e]`` to rank ``owners[e]`` (fp32).

        Used at conversion, when experts start replicated (taken from rank 0, as DeepSpeed's broadcast does) or
        spread over expert-parallel ranks.
        """
        sends: Dict[int, List[torch.Tensor]] = {}
        recvs: Dict[int, List[int]] = {}
        kept: Dict[int, torch.Tensor] = {}
        for e, (src, dst) in enumerate(zip(sources, owners)):
            if src == dst == self.rank:
                kept[e] = local[e].to(torch.float32).clone()
            elif src == self.rank:
                sends.setdefault(dst, []).append(local[e])
            elif dst == self.rank:
                recvs.setdefault(src, []).append(e)
        if any(s != d for s, d in zip(sources, owners)):
            received = self._chunk_exchange(sends, recvs, numel, torch.float32, torch.device("cpu"))
            for src, experts in recvs.items():
                for e, chunk in zip(experts, received[src]):
                    kept[e] = chunk.clone()
        return kept


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class AllToAllTokens(torch.autograd.Function):
    """Differentiable ragged all-to-all of token rows; backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, send_splits: List[int], recv_splits: List[int],
                kind: str) -> torch.Tensor:
        ctx.comm, ctx.send_splits, ctx.recv_splits, ctx.kind = comm, send_splits, recv_splits, kind
        return _token_exchange(comm, x, send_splits, recv_splits, kind)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _token_exchange(ctx.comm, grad, ctx.recv_splits, ctx.send_splits, ctx.kind), None, None, None, None


def _token_exchange(comm: Communicator, x: torch.Tensor, send_splits: List[int], recv_splits: List[int],
                    kind: str) -> torch.Tensor:
    comm.count_token_bytes(x, send_splits)
    comm.counters.count(kind)
    return comm.all_to_all(x, send_splits, recv_splits)
