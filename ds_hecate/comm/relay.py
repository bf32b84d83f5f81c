"""SparseAllGather and SparseReduceScatter through relay trees (:mod:`ds_hecate.planning.fanout`).

The flat collectives (:class:`~ds_hecate.comm.collectives.Communicator`) send every copy from its owner in one
exchange. With relayed copies the same primitive runs over the stages of the trees: top-down for the gather, each
rank forwarding rows it received at an earlier stage; bottom-up for the reduction, each relay adding its children's
fp32 partial sums to its own copy's gradient before passing the sum up. The first stage (the owners' sends; in the
reduction the deepest level's) travels whole and is issued when the collective starts (asynchronously if asked);
the deeper stages read what the earlier delivered, so on gloo they run when the collective is waited for; on a
stream-ordered transport (NCCL on CUDA, :meth:`~ds_hecate.comm.transport.Transport.relay_scope`) every stage is
issued when the collective starts, off the caller's stream, each waiting for the one before on the device, so the
whole tree runs behind the compute that hides the first stage. Either way pipelined: each
expert row is cut into ``hecate.relay_chunks`` column slices and one exchange carries chunk ``c`` of one level
beside chunk ``c + 1`` of the level above, so a tree of depth ``D`` costs about ``1 + (D - 2) / chunks`` whole-row
transfers past the first stage instead of ``D - 1`` (:meth:`~ds_hecate.planning.fanout.RelayPlan.pipeline`).
Slices cut columns only, so every element is summed in the same order whatever the chunk count. Every rank computes
the same :class:`~ds_hecate.planning.fanout.RelayPlan`, so every rank issues the same exchanges, empty or not.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from ..planning import Placement
from ..planning.fanout import RelayPlan, chunk_bounds
from .buffers import (Accumulator, CommCounters, GatheredExperts, PendingGather, _itemsize, _source_major,
                      owned_experts_of)
from .device import to_device
from .transport import Transport


class Communicator(Protocol):
    """What the relayed collectives use of the :class:`~ds_hecate.comm.collectives.Communicator` that calls them:
    its rank and device, its weight transport, and four of its primitives. Declared here, not imported, so that
    the names go one way (collectives.py imports this module, never the reverse)."""

    rank: int
    world_size: int
    device: torch.device
    weights: Transport

    def exchange_rows(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], numel: int,
                      async_op: bool, collective: str,
                      out: Optional[torch.Tensor] = None) -> Callable[[], torch.Tensor]: ...

    def pack(self, srcs: Sequence[torch.Tensor], numel: int, dtype: torch.dtype,
             out: Optional[torch.Tensor] = None) -> torch.Tensor: ...

    def owned_rows(self, own: List[int], owned: Mapping[int, torch.Tensor], numel: int, dtype: torch.dtype,
                   resident: Optional[torch.Tensor]) -> torch.Tensor: ...

    def gather_block(self, own: List[int], received: List[int], numel: int, dtype: torch.dtype, spare_rows: int,
                     into: Optional[GatheredExperts]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]: ...


def relayed_all_gather(comm: "Communicator", placement: Placement, owned: Mapping[int, torch.Tensor], numel: int,
                        dtype: torch.dtype, counters: CommCounters, async_op: bool, include_owned: bool,
                        spare_rows: int, into: Optional[GatheredExperts], relay: RelayPlan,
                        resident: Optional[torch.Tensor] = None) -> PendingGather:
    """:meth:`Communicator.start_sparse_all_gather` through the relay trees, top-down: the first stage whole (the
    owners' sends, issued now), the deeper ones pipelined in row chunks (:meth:`RelayPlan.pipeline`); the replica
    rows in the relay plan's order (:meth:`RelayPlan.received_order`)."""
    own = owned_experts_of(placement, comm.rank) if include_owned else []
    received = relay.received_order(comm.rank)
    owned_rows = comm.owned_rows(own, owned, numel, dtype, resident)
    buffer, block = comm.gather_block(own, received, numel, dtype, spare_rows, into)
    gathered = GatheredExperts(tuple(own) + tuple(received), owned_rows, buffer, block)
    row_of = {e: i for i, e in enumerate(received)}
    counters.count("allgather")
    counters.count("relayed_allgather")
    offsets = [0]
    for s in range(len(relay.stages)):
        offsets.append(offsets[-1] + sum(len(v) for v in relay.recvs(comm.rank, s).values()))

    def source(e: int) -> torch.Tensor:
        """What this rank sends of expert ``e``: an owner its weights, a relay the row it received earlier."""
        return owned[e].reshape(-1) if placement.owners[e] == comm.rank else buffer[row_of[e]]

    sends = [relay.sends(comm.rank, s) for s in range(len(relay.stages))]
    recvs = [relay.recvs(comm.rank, s) for s in range(len(relay.stages))]
    sent = _source_major(sends[0])
    counters.allgather_bytes += len(sent) * numel * _itemsize(dtype)

    def issue_first(async_first: bool) -> Callable[[], torch.Tensor]:
        return comm.exchange_rows(comm.pack([source(e) for e in sent], numel, dtype),
                                  _counts_per_peer(sends[0], comm.world_size),
                                  _counts_per_peer(recvs[0], comm.world_size), numel,
                                  async_first, "SparseAllGather", out=buffer[offsets[0]:offsets[1]])
    # where each (stage, source)'s rows start in the buffer (a stage's rows are source-major)
    row_start = {(s, src): offsets[s] + sum(len(v) for p, v in recvs[s].items() if p < src)
                 for s in range(1, len(recvs)) for src in recvs[s]}

    def receive(stage: int, src: int, lo: int, hi: int, rows: torch.Tensor) -> None:
        start = row_start[(stage, src)]
        buffer[start:start + rows.shape[0], lo:hi].copy_(rows)

    def deeper() -> None:
        _pipelined(comm, relay, numel, dtype, "SparseAllGather", counters, "allgather_bytes", sends=sends,
                   recvs=recvs, row=source, receive=receive)

    scope = _stream_scope(comm, async_op, lambda: [buffer, *(owned[e] for e in own), *(owned[e] for e in sent)])
    if scope is None:   # the deeper stages wait for the collective's wait
        first = issue_first(async_op)

        def finish() -> GatheredExperts:
            first()
            deeper()
            return gathered
        return PendingGather(placement, finish)
    with scope as join:   # every stage now, on the device's order
        issue_first(True)()
        deeper()
    return PendingGather(placement, lambda: (join(), gathered)[1])


def relayed_reduce_scatter(comm: "Communicator", placement: Placement, experts: Sequence[int],
                           grads: torch.Tensor, wire_dtype: torch.dtype, counters: CommCounters,
                           add_own: Callable[[], torch.Tensor], owned: List[int], async_op: bool,
                           relay: RelayPlan, accumulator: "Accumulator") -> Callable[[], None]:
    """:meth:`Communicator.start_sparse_reduce_scatter` up the relay trees, deepest stage first (whole, issued now),
    the shallower ones pipelined in row chunks as the gather's deeper ones: a relay's fp32 partial sum starts as
    its own copy's gradient and adds its children's sums (child rank ascending) before each chunk goes to its
    parent; the owner adds its own copy first, then its children's sums, into its accumulator. Chunks cut the
    rows into column slices, so every element is summed in the same order whatever ``relay_chunks`` is.
    ``accumulator``: the owner's rows ``add_own`` adds into; on a stream-ordered transport they are made on the
    caller's stream before the chain is issued beside it (every add into them still runs in the chain, in order).
    ``grads``: the gradients of the gathered replica rows (the owned experts' are in ``add_own``)."""
    numel = grads.shape[1]
    rows = {e: i for i, e in enumerate(experts[len(owned):])}   # ``grads``: the replica rows
    relayed = sorted(e for e in relay.children(comm.rank) if placement.owners[e] != comm.rank)
    partial_row = {e: i for i, e in enumerate(relayed)}
    partial = torch.empty(len(relayed), numel, dtype=torch.float32, device=comm.device)
    comm.pack([grads[rows[e]] for e in relayed], numel, torch.float32, out=partial)
    owned_row = {e: i for i, e in enumerate(owned)}
    counters.count("reducescatter")
    counters.count("relayed_reducescatter")
    target: List[Optional[torch.Tensor]] = [None]
    last = len(relay.stages) - 1

    def row(e: int) -> torch.Tensor:
        """What this rank sends up for expert ``e``: a relay its partial sum, a leaf its own copy's gradient."""
        return partial[partial_row[e]] if e in partial_row else grads[rows[e]]

    def add(arrived: List[int], received: torch.Tensor, lo: int, hi: int) -> None:
        """Children's sums ``received`` (rows in ``arrived`` order, columns ``[lo, hi)``) into the accumulator
        (owned experts) or the partial sums (relayed ones), in arrival order."""
        mine = [i for i, e in enumerate(arrived) if e in owned_row]
        if mine:
            own_rows = target[0]
            if own_rows is None:
                own_rows = target[0] = add_own()
            _add_rows(comm, own_rows[:, lo:hi], received, mine, [owned_row[arrived[i]] for i in mine])
        passed = [i for i, e in enumerate(arrived) if e in partial_row]
        _add_rows(comm, partial[:, lo:hi], received, passed, [partial_row[arrived[i]] for i in passed])

    # reduction stage s is gather stage last - s reversed: each receiver sends its sum to the rank it received the
    # expert from (its parent), and receives from the ranks it sent to (its children); stage 0, the deepest, whole
    parents_of = [relay.recvs(comm.rank, last - s) for s in range(last + 1)]
    children_of = [relay.sends(comm.rank, last - s) for s in range(last + 1)]
    sent = _source_major(parents_of[0])
    counters.reducescatter_bytes += len(sent) * numel * _itemsize(wire_dtype)

    def issue_first(async_first: bool) -> Callable[[], torch.Tensor]:
        return comm.exchange_rows(comm.pack([row(e) for e in sent], numel, wire_dtype),
                                  _counts_per_peer(parents_of[0], comm.world_size),
                                  _counts_per_peer(children_of[0], comm.world_size), numel, async_first,
                                  "SparseReduceScatter")

    def rest(first_rows: torch.Tensor) -> None:
        add(_source_major(children_of[0]), first_rows, 0, numel)
        _pipelined(comm, relay, numel, wire_dtype, "SparseReduceScatter", counters, "reducescatter_bytes",
                   sends=parents_of, recvs=children_of, row=row,
                   receive=lambda s, src, lo, hi, rows_in: add(children_of[s][src], rows_in, lo, hi))
        if target[0] is None:
            add_own()

    scope = _stream_scope(comm, async_op,
                          lambda: [grads, partial, accumulator.rows()] if owned else [grads, partial])
    if scope is None:   # the shallower stages wait for the collective's wait
        first = issue_first(async_op)
        return lambda: rest(first())
    with scope as join:   # every stage now, on the device's order
        rest(issue_first(True)())
    return join


def _stream_scope(comm: "Communicator", async_op: bool, tensors: Callable[[], List[torch.Tensor]]):
    """The weight transport's :meth:`~ds_hecate.comm.transport.Transport.relay_scope` for an asynchronous
    collective, over the caller's tensors the chain uses (asked for only there); None: the deeper stages run at the
    wait (a synchronous collective, or a transport whose works complete on the host)."""
    if not async_op or not getattr(comm.weights, "stream_ordered", False):
        return None
    return comm.weights.relay_scope(tensors())


def _pipelined(comm: "Communicator", relay: RelayPlan, numel: int, dtype: torch.dtype, collective: str,
               counters: CommCounters, counter: str, sends: Sequence[Dict[int, List[int]]],
               recvs: Sequence[Dict[int, List[int]]], row: Callable[[int], torch.Tensor],
               receive: Callable[[int, int, int, int, torch.Tensor], None]) -> None:
    """The exchanges of :meth:`RelayPlan.pipeline` after the first stage, each waited for before the next (a relay
    forwards what the previous one delivered). ``sends[s]`` / ``recvs[s]``: peer -> experts this rank sends to /
    receives from at pipeline stage ``s``. Exchange ``t`` sends, per peer (ascending), every active (stage, chunk)
    in stage order: the chunk's column slice of :func:`row` of each expert the rank sends at that stage to that
    peer (expert ascending), packed straight into one send buffer; and hands each peer's received block per (stage,
    chunk) to :func:`receive` (stage, source, lo, hi, ``[n, hi - lo]`` rows). Every rank runs the same number of
    exchanges, empty or not."""
    bounds = chunk_bounds(numel, relay.chunks)
    for active in relay.pipeline(len(bounds)):
        peers = sorted({p for s, _ in active for p in (*sends[s], *recvs[s])})
        outgoing: List[Tuple[List[int], int, int]] = []       # (experts, lo, hi) in send order
        layout: List[Tuple[int, int, int, int, int]] = []     # (source, stage, lo, hi, rows) in receive order
        send_elems = [0] * comm.world_size
        recv_elems = [0] * comm.world_size
        for peer in peers:
            for s, c in active:
                lo, hi = bounds[c]
                experts = sends[s].get(peer, ())
                if experts:
                    outgoing.append((experts, lo, hi))
                    send_elems[peer] += len(experts) * (hi - lo)
                n_in = len(recvs[s].get(peer, ()))
                if n_in:
                    layout.append((peer, s, lo, hi, n_in))
                    recv_elems[peer] += n_in * (hi - lo)
        send = torch.empty(sum(send_elems), dtype=dtype, device=comm.device)
        offset = 0
        for experts, lo, hi in outgoing:
            size = len(experts) * (hi - lo)
            comm.pack([row(e)[lo:hi] for e in experts], hi - lo, dtype,
                      out=send[offset:offset + size].view(len(experts), hi - lo))
            offset += size
        setattr(counters, counter, getattr(counters, counter) + send.numel() * _itemsize(dtype))
        recv = comm.exchange_rows(send.view(-1, 1), send_elems, recv_elems, 1, False, collective)()
        offset = 0
        for peer, s, lo, hi, n in layout:
            receive(s, peer, lo, hi, recv[offset:offset + n * (hi - lo)].view(n, hi - lo))
            offset += n * (hi - lo)


def _counts_per_peer(lists: Dict[int, List[int]], world: int) -> List[int]:
    """Rows to or from each rank, ``lists`` being peer -> experts."""
    return [len(lists.get(p, ())) for p in range(world)]


def _add_rows(comm: "Communicator", target: torch.Tensor, received: torch.Tensor, picks: List[int],
              target_rows: List[int]) -> None:
    """``target[target_rows[i]] += received[picks[i]]`` in fp32, in order."""
    if not picks:
        return
    rows = received if picks == list(range(received.shape[0])) else received.index_select(
        0, to_device(torch.tensor(picks, dtype=torch.int64), received.device))
    comm.weights.device_ops.accumulate(target, rows, target_rows)

