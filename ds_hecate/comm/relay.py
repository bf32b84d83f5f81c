"""SparseAllGather and SparseReduceScatter through relay trees (:mod:`ds_hecate.planning.fanout`).

The flat collectives (:class:`~ds_hecate.comm.collectives.Communicator`) send every copy from its owner in one
exchange. With relayed copies the same primitive runs once per stage of the trees: top-down for the gather, each rank
forwarding rows it received at an earlier stage; bottom-up for the reduction, each relay adding its children's fp32
partial sums to its own copy's gradient before passing the sum up. Every rank computes the same
:class:`~ds_hecate.planning.fanout.RelayPlan`, so every rank issues the same number of exchanges, empty or not. The
first stage is issued when the collective starts (asynchronously if asked); the later ones read what the earlier
delivered, so they run when the collective is waited for.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

import torch

from ..planning import Placement
from ..planning.fanout import RelayPlan
from .buffers import CommCounters, GatheredExperts, PendingGather, _itemsize, _source_major, owned_experts_of
from .device import to_device

if TYPE_CHECKING:
    from .collectives import Communicator


def relayed_all_gather(comm: "Communicator", placement: Placement, owned: Dict[int, torch.Tensor], numel: int,
                        dtype: torch.dtype, counters: CommCounters, async_op: bool, include_owned: bool,
                        spare_rows: int, into: Optional[GatheredExperts], relay: RelayPlan) -> PendingGather:
    """:meth:`Communicator.start_sparse_all_gather` through the relay trees: stage by stage, top-down; the replica
    rows in the relay plan's order (:meth:`RelayPlan.received_order`)."""
    own = owned_experts_of(placement, comm.rank) if include_owned else []
    received = relay.received_order(comm.rank)
    buffer, block = comm.gather_block(own, received, numel, dtype, spare_rows, into)
    comm.pack([owned[e] for e in own], numel, dtype, out=buffer[:len(own)])
    gathered = GatheredExperts(tuple(own) + tuple(received), buffer, len(own), block)
    row_of = {e: len(own) + i for i, e in enumerate(received)}
    counters.count("allgather")
    counters.count("relayed_allgather")
    offsets = [len(own)]
    for s in range(len(relay.stages)):
        offsets.append(offsets[-1] + sum(len(v) for v in relay.recvs(comm.rank, s).values()))

    def stage(s: int, async_op: bool) -> Callable[[], torch.Tensor]:
        send_lists, recv_lists = relay.sends(comm.rank, s), relay.recvs(comm.rank, s)
        sent = _source_major(send_lists)
        # an owner sends its weights; a relay forwards the row it received at an earlier stage
        send = comm.pack([owned[e] if placement.owners[e] == comm.rank else buffer[row_of[e]] for e in sent],
                         numel, dtype)
        counters.allgather_bytes += len(sent) * numel * _itemsize(dtype)
        return comm.exchange_rows(send, [len(send_lists.get(d, ())) for d in range(comm.world_size)],
                                  [len(recv_lists.get(r, ())) for r in range(comm.world_size)], numel,
                                  async_op, "SparseAllGather", out=buffer[offsets[s]:offsets[s + 1]])
    first = stage(0, async_op)

    def finish() -> GatheredExperts:
        first()
        for s in range(1, len(relay.stages)):
            stage(s, False)()
        return gathered
    return PendingGather(placement, finish)


def relayed_reduce_scatter(comm: "Communicator", placement: Placement, experts: Sequence[int], grads: torch.Tensor,
                            wire_dtype: torch.dtype, counters: CommCounters,
                            add_own: Callable[[], torch.Tensor], owned: List[int], async_op: bool,
                            relay: RelayPlan) -> Callable[[], None]:
    """:meth:`Communicator.start_sparse_reduce_scatter` up the relay trees, deepest stage first: a relay's fp32 partial sum
    starts as its own copy's gradient and adds its children's sums (child rank ascending) before it goes to
    its parent; the owner adds its own copy first, then its children's sums, into its accumulator."""
    numel = grads.shape[1]
    rows = {e: i for i, e in enumerate(experts)}
    relayed = sorted(e for e in relay.children(comm.rank) if placement.owners[e] != comm.rank)
    partial_row = {e: i for i, e in enumerate(relayed)}
    partial = torch.empty(len(relayed), numel, dtype=torch.float32, device=comm.device)
    comm.pack([grads[rows[e]] for e in relayed], numel, torch.float32, out=partial)
    owned_row = {e: i for i, e in enumerate(owned)}
    counters.count("reducescatter")
    counters.count("relayed_reducescatter")
    target: List[Optional[torch.Tensor]] = [None]

    def stage(s: int, async_op: bool) -> Callable[[], None]:
        # stage s's copies in reverse: each receiver sends its sum to the rank it received the expert from
        send_lists, recv_lists = relay.recvs(comm.rank, s), relay.sends(comm.rank, s)
        sent = _source_major(send_lists)
        send = comm.pack([partial[partial_row[e]] if e in partial_row else grads[rows[e]] for e in sent],
                         numel, wire_dtype)
        counters.reducescatter_bytes += len(sent) * numel * _itemsize(wire_dtype)
        finish_exchange = comm.exchange_rows(
            send, [len(send_lists.get(d, ())) for d in range(comm.world_size)],
            [len(recv_lists.get(c, ())) for c in range(comm.world_size)], numel, async_op,
            "SparseReduceScatter")
        arrived = _source_major(recv_lists)

        def add() -> None:
            received = finish_exchange()
            mine = [i for i, e in enumerate(arrived) if e in owned_row]
            if mine:
                if target[0] is None:
                    target[0] = add_own()
                _add_rows(comm, target[0], received, mine, [owned_row[arrived[i]] for i in mine])
            passed = [i for i, e in enumerate(arrived) if e in partial_row]
            _add_rows(comm, partial, received, passed, [partial_row[arrived[i]] for i in passed])
        return add
    last = len(relay.stages) - 1
    first = stage(last, async_op)

    def finish() -> None:
        first()
        for s in range(last - 1, -1, -1):
            stage(s, False)()
        if target[0] is None:
            add_own()
    return finish


def _add_rows(comm: "Communicator", target: torch.Tensor, received: torch.Tensor, picks: List[int],
              target_rows: List[int]) -> None:
    """``target[target_rows[i]] += received[picks[i]]`` in fp32, in order."""
    if not picks:
        return
    rows = received if picks == list(range(received.shape[0])) else received.index_select(
        0, to_device(torch.tensor(picks, dtype=torch.int64), received.device))
    comm.weights.device_ops.accumulate(target, rows, target_rows)

