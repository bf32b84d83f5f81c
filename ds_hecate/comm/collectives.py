"""Hecate's collectives over its own process groups: count exchange, SparseAllGather, SparseReduceScatter, the expert
move and the ragged token all-to-all, implemented once over a :mod:`~ds_hecate.comm.transport` (torch.distributed, or
NCCL through CuPy).

All of them are built on a ragged all-to-all with split sizes (gloo has no uneven all_gather). Who sends what is
read from the :class:`~ds_hecate.planning.Placement` / :class:`~ds_hecate.planning.LayerPlan`, identical on every
rank, so every rank issues the same collectives in the same order; a collective is skipped only when the plan says
it is empty on every rank.

**Two transports.** Weight traffic (SparseAllGather, SparseReduceScatter, the expert move) runs on a transport of
its own, beside the token traffic (count exchange, token all-to-all): with NCCL two communicators, two streams.
So backward's token-gradient all-to-all does not queue behind the SparseReduceScatter issued just before it, and
the next layer's count exchange does not queue behind its prefetched SparseAllGather. Each transport sees its own
collectives in the same order on every rank, so the pair cannot deadlock.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..errors import HecateCollectiveError, HecateError
from ..planning import Placement
from ..planning.fanout import RelayPlan
from .buffers import (Accumulator, CommCounters, ExpertMove, GatheredExperts, PendingGather, _itemsize,
                      _source_major, add_into, materialized_buffer, owned_experts_of)
from .device import to_device
from .relay import relayed_all_gather, relayed_reduce_scatter
from .transport import TorchTransport, Transport


class Communicator:
    """Hecate's collectives, implemented once over a :class:`~ds_hecate.comm.transport.Transport`; one per runtime.

    ``transport`` carries the token traffic, ``weight_transport`` (default: the same) the weight traffic. Every
    tensor it creates or hands to a transport is on ``self.device`` (the rank's working device), whatever the rank
    has to send, so every rank takes the same path and issues the same primitives.

    ``one_rank_shortcuts``: on a 1-rank group every primitive is a local copy (or nothing), so by default the
    Communicator does it itself and never calls the transport. ``False`` issues them through the transport as on
    N ranks (on a 1-rank gloo or NCCL group they still complete): the per-rank path of an N-rank run, measurable on
    one rank (``python -m benchmarks.layer --n-rank``, system ``ds_hecate-no-shortcuts``).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int,
                 timeout_s: Optional[float] = None, device: Optional[torch.device] = None,
                 transport: Optional[Transport] = None, weight_transport: Optional[Transport] = None,
                 one_rank_shortcuts: bool = True) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        #: whether a primitive skips the transport (a 1-rank group with its shortcuts on)
        self.alone = world_size == 1 and one_rank_shortcuts
        self.timeout_s = timeout_s
        self.transport: Transport = (transport if transport is not None else
                                     TorchTransport(group, rank, world_size, device or torch.device("cpu")))
        self.weights: Transport = weight_transport if weight_transport is not None else self.transport
        self.device = torch.device(self.transport.device)
        self.activity = "work outside the MoE layers"  # what the caller is doing; named when a collective fails
        #: how messages name this communicator's rank ``i`` (:meth:`name_ranks`: the global rank and group)
        self.rank_name: Callable[[int], str] = lambda i: f"rank {i} of {self.world_size}"

    def name_ranks(self, rank_name: Callable[[int], str]) -> "Communicator":
        """Name this communicator's ranks in messages by ``rank_name(index)`` (a group's communicator numbers its
        ranks inside the group; users know global ranks)."""
        self.rank_name = rank_name
        return self

    @property
    def separate_weight_traffic(self) -> bool:
        return self.weights is not self.transport

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
                f"Hecate collective '{collective}' failed on {self.rank_name(self.rank)} during "
                f"{self.activity} ({cause}). Another rank probably died or stopped responding; Hecate's collectives "
                f"wait at most {limit}. See the other ranks' logs.") from exc

    # ------------------------------------------------------------------------------------------------------------
    def all_to_all(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                   async_op: bool = False, collective: str = "token all-to-all", out: Optional[torch.Tensor] = None,
                   transport: Optional[Transport] = None):
        """Ragged all-to-all along dim 0 (into ``out`` when given, ``sum(recv_splits)`` rows). Returns the receive
        tensor (and the Work handle when ``async_op``)."""
        if self.alone:
            if out is not None:
                out.copy_(send)
                send = out
            return (send, None) if async_op else send
        recv = out if out is not None else send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        with self._guard(collective):
            work = (transport or self.transport).all_to_all(recv, send.contiguous(), list(recv_splits),
                                                            list(send_splits), async_op)
        return (recv, work) if async_op else recv

    def wait(self, work, collective: str) -> None:
        """Wait for an async collective, naming it if it fails."""
        if work is not None:
            with self._guard(collective):
                work.wait()

    def exchange_counts(self, local_counts: torch.Tensor) -> "np.ndarray":
        """All ranks' per-expert token-expert pair counts as a host ``[ranks, n]`` int64 array (the planner's
        input; one device-to-host copy, the layer call's only host read, no Python lists: at 1,024 ranks x 256
        experts those alone cost ms)."""
        if self.alone and local_counts.device.type == "cpu" and local_counts.dtype == torch.int64:
            return local_counts.numpy().reshape(1, -1)   # (a view: nothing to copy or exchange)
        local = local_counts.reshape(-1)
        if local.device != self.device or local.dtype != torch.int64:
            local = local.to(device=self.device, dtype=torch.int64)
        local = local.contiguous()
        if self.alone:
            host = local if local.device.type == "cpu" else local.cpu()
            return host.numpy().reshape(1, -1)
        out = torch.empty(self.world_size * local.numel(), dtype=torch.int64, device=self.device)
        with self._guard("token-count exchange"):
            self.transport.all_gather(out, local)
        return out.view(self.world_size, -1).cpu().numpy()

    def all_reduce(self, value: torch.Tensor, op=dist.ReduceOp.SUM, collective: str = "all-reduce") -> torch.Tensor:
        """In-place all-reduce of a tensor on ``self.device``."""
        if not self.alone:
            with self._guard(collective):
                self.transport.all_reduce(value, op)
        return value

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, collective: str = "reduce-scatter") -> torch.Tensor:
        """``out`` = this rank's chunk of the sum over ranks of ``inp`` (``world_size`` chunks of ``out``'s size)."""
        if self.alone:
            out.copy_(inp.view_as(out))
            return out
        with self._guard(collective):
            self.transport.reduce_scatter(out, inp)
        return out

    def all_gather_into(self, out: torch.Tensor, local: torch.Tensor, collective: str = "all-gather") -> torch.Tensor:
        """``out`` = every rank's ``local``, rank after rank."""
        if self.alone:
            out.copy_(local.view_as(out))
            return out
        with self._guard(collective):
            self.transport.all_gather(out, local.contiguous())
        return out

    def broadcast(self, value: torch.Tensor, src: int = 0, collective: str = "broadcast") -> torch.Tensor:
        """In-place broadcast from group rank ``src`` of a tensor on ``self.device``."""
        if not self.alone:
            with self._guard(collective):
                self.transport.broadcast(value, src)
        return value

    def barrier(self, collective: str = "barrier") -> None:
        self.all_reduce(torch.zeros(1, dtype=torch.float32, device=self.device), collective=collective)

    def all_gather_object(self, obj, collective: str = "all-gather of Python objects") -> list:
        if self.alone:
            return [obj]
        with self._guard(collective):
            return self.transport.all_gather_object(obj)

    # ------------------------------------------------------------------------------------------------------------
    def exchange_rows(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                      numel: int, async_op: bool, collective: str,
                      out: Optional[torch.Tensor] = None) -> Callable[[], torch.Tensor]:
        """Weight traffic: rows of ``numel`` elements, ``send_counts[d]`` of them to rank ``d`` (``send`` holds them
        peer by peer), ``recv_counts[s]`` from rank ``s``; returns a function giving the ``[sum(recv_counts),
        numel]`` received rows (source-major), written into ``out`` when given. The one primitive under
        SparseAllGather, SparseReduceScatter, the expert move and re-sharding."""
        recv_rows = sum(recv_counts)
        target = out if out is not None else torch.empty(recv_rows, numel, dtype=send.dtype, device=self.device)
        recv, work = self.all_to_all(send.reshape(-1), [n * numel for n in send_counts],
                                     [n * numel for n in recv_counts], async_op=True, collective=collective,
                                     out=target.view(-1), transport=self.weights)

        def finish() -> torch.Tensor:
            self.wait(work, collective)
            return target
        if not async_op:
            finish()
            return lambda: target
        return finish

    def exchange_chunk_lists(self, sends: Dict[int, List[torch.Tensor]], recv_lists: Dict[int, List[int]],
                             numel: int, dtype: torch.dtype, collective: str) -> Dict[int, List[torch.Tensor]]:
        """Per-destination lists of flat chunks out, per-source lists of chunks in (``recv_lists`` order), waited
        for: the expert move and re-sharding, whose chunks are not experts of a layer call."""
        parts = [t.to(self.device) for d in sorted(sends) for t in sends[d]]
        received = self.exchange_rows(self.pack(parts, numel, dtype),
                                      [len(sends.get(d, ())) for d in range(self.world_size)],
                                      [len(recv_lists.get(s, ())) for s in range(self.world_size)], numel, False,
                                      collective)()
        rows = iter(received.unbind(0))
        return {src: [next(rows) for _ in recv_lists[src]] for src in sorted(recv_lists)}

    def pack(self, srcs: Sequence[torch.Tensor], numel: int, dtype: torch.dtype,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[len(srcs), numel]`` rows of ``srcs`` cast to ``dtype``, in one pass of the transport's chunk ops."""
        rows = out if out is not None else torch.empty(len(srcs), numel, dtype=dtype, device=self.device)
        self.weights.device_ops.pack(srcs, rows)
        return rows

    def start_sparse_all_gather(self, placement: Placement, owned: Mapping[int, torch.Tensor], numel: int,
                                dtype: torch.dtype, counters: CommCounters, async_op: bool = True,
                                include_owned: bool = True, spare_rows: int = 0,
                                into: Optional[GatheredExperts] = None,
                                relay: Optional[RelayPlan] = None,
                                resident: Optional[torch.Tensor] = None) -> PendingGather:
        """spAG(P, P'): start materializing this rank's experts of ``placement`` (:class:`GatheredExperts`);
        :meth:`PendingGather.wait` gives them.

        The owned experts are ``resident`` as they are (the shard's ``[owned, numel]`` compute-dtype weights, in
        expert order), or, None, packed from ``owned`` (cast to ``dtype``; left out with ``include_owned=False``,
        for calibration's extras). Every other materialized expert is sent by its owner straight into the rows of a
        replica block, and only the pairs in P' \\ P cross the wire.

        ``spare_rows`` reserves rows after the replicas' in the same block for calibration's extras; their gather
        passes ``into`` (the prefetched :class:`GatheredExperts`, with ``include_owned=False``) and receives into
        them.

        ``relay`` (:class:`~ds_hecate.planning.fanout.RelayPlan` of ``placement``): with relayed copies, one
        exchange per stage of the trees, each rank forwarding the rows it received at the stage before; the replica
        rows are in the relay plan's order. The first stage is issued now (asynchronously with ``async_op``), the
        later ones when the gather is waited for (they read rows the first delivers), or, on a stream-ordered
        transport, all of them now (:mod:`.relay`).
        """
        if relay is not None and relay.relayed and placement.num_moved:
            return relayed_all_gather(self, placement, owned, numel, dtype, counters, async_op, include_owned,
                                      spare_rows, into, relay, resident)
        own = owned_experts_of(placement, self.rank) if include_owned else []
        recv_lists = placement.gather_recvs(self.rank)
        received = _source_major(recv_lists)
        owned_rows = self.owned_rows(own, owned, numel, dtype, resident)
        buffer, block = self.gather_block(own, received, numel, dtype, spare_rows, into)
        gathered = GatheredExperts(tuple(own) + tuple(received), owned_rows, buffer, block)
        if placement.num_moved == 0:
            return PendingGather(placement, lambda: gathered)
        counters.count("allgather")
        send_lists = placement.gather_sends(self.rank)
        sent = _source_major(send_lists)
        send = self.pack([owned[e] for e in sent], numel, dtype)
        counts_to = [len(send_lists.get(d, ())) for d in range(self.world_size)]
        counts_from = [len(recv_lists.get(s, ())) for s in range(self.world_size)]
        finish_exchange = self.exchange_rows(send, counts_to, counts_from, numel, async_op, "SparseAllGather",
                                             out=buffer)
        counters.allgather_bytes += len(sent) * numel * _itemsize(dtype)

        def finish() -> GatheredExperts:
            finish_exchange()
            return gathered
        return PendingGather(placement, finish)

    def owned_rows(self, own: List[int], owned: Mapping[int, torch.Tensor], numel: int, dtype: torch.dtype,
                   resident: Optional[torch.Tensor]) -> torch.Tensor:
        """A gather's owned rows: ``resident`` as it is, or ``owned``'s experts ``own`` packed into new rows."""
        if resident is not None and own:
            if tuple(resident.shape) != (len(own), numel) or resident.dtype != dtype:
                raise HecateError(f"SparseAllGather: resident weights {tuple(resident.shape)} {resident.dtype} are "
                                  f"not the {len(own)} owned experts' [{len(own)}, {numel}] {dtype} rows")
            return resident
        return self.pack([owned[e] for e in own], numel, dtype)

    def gather_block(self, own: List[int], received: List[int], numel: int, dtype: torch.dtype,
                     spare_rows: int, into: Optional[GatheredExperts]) -> Tuple[torch.Tensor,
                                                                                Optional[torch.Tensor]]:
        """The rows a gather receives its replicas (``received``) into and the block they start (None when they
        are ``into``'s reserved rows)."""
        rows = len(received)
        if into is not None:
            if own:
                raise HecateError("a gather into reserved rows carries replicas only (include_owned=False)")
            return into.spare(rows), None
        block = materialized_buffer(rows + spare_rows, numel, dtype, self.device)
        return block[:rows], block

    def start_sparse_reduce_scatter(self, placement: Placement, experts: Sequence[int],
                                    own_grads: Optional[torch.Tensor], replica_grads: torch.Tensor,
                                    wire_dtype: torch.dtype, counters: CommCounters, accumulator: Accumulator,
                                    async_op: bool = True, relay: Optional[RelayPlan] = None) -> Callable[[], None]:
        """spRS(P', P): add every materialized copy's gradient into the expert's owner's accumulator.

        ``experts`` are a :class:`GatheredExperts`' experts (its own first, in expert order, then its replicas);
        ``replica_grads`` the gradients of its replica rows, in its buffer's order; ``own_grads`` those of its owned
        rows, or None when the expert compute has written them into ``accumulator`` already. ``accumulator`` holds
        the owner's fp32 ``[owned, numel]`` gradient rows (this rank's owned experts in expert order), into which
        the returned function adds, in place and in a fixed order: the rank's own copies first (written into a
        fresh accumulator), then the received copies by source rank.
        """
        numel = replica_grads.shape[1]
        owned = owned_experts_of(placement, self.rank)
        if tuple(experts[:len(owned)]) != tuple(owned):
            raise HecateError(f"SparseReduceScatter on {self.rank_name(self.rank)}: the gradient rows start with "
                              f"experts {list(experts[:len(owned)])}, not the owned {owned}")

        def add_own() -> torch.Tensor:
            return accumulator.rows() if own_grads is None else add_into(accumulator, own_grads)
        if placement.num_moved == 0:
            return lambda: (add_own(), None)[1]
        if relay is not None and relay.relayed:
            return relayed_reduce_scatter(self, placement, experts, replica_grads, wire_dtype, counters, add_own,
                                          owned, async_op, relay, accumulator)
        counters.count("reducescatter")
        # As a replica, send to each owner the experts it sent us in spAG (same lists, opposite direction).
        send_lists, recv_lists = placement.gather_recvs(self.rank), placement.gather_sends(self.rank)
        rows = {e: i for i, e in enumerate(experts[len(owned):])}
        picks = [rows[e] for e in _source_major(send_lists)]
        if picks == list(range(len(picks))):
            send = replica_grads[:len(picks)]   # the replica rows in wire order already: a view
        else:
            send = replica_grads.index_select(0, to_device(torch.tensor(picks, dtype=torch.int64),
                                                           replica_grads.device))
        send = send.to(wire_dtype)
        counts_to = [len(send_lists.get(d, ())) for d in range(self.world_size)]
        counts_from = [len(recv_lists.get(s, ())) for s in range(self.world_size)]
        finish_exchange = self.exchange_rows(send, counts_to, counts_from, numel, async_op, "SparseReduceScatter")
        counters.reducescatter_bytes += len(picks) * numel * _itemsize(wire_dtype)
        row_of_owned = {e: i for i, e in enumerate(owned)}
        target_rows = [row_of_owned[e] for e in _source_major(recv_lists)]

        def finish() -> None:
            received = finish_exchange()
            self.weights.device_ops.accumulate(add_own(), received, target_rows)
        return finish

    def move_experts(self, sources: Sequence[int], owners: Sequence, local: Dict[int, torch.Tensor],
                     numel: int) -> Dict[int, torch.Tensor]:
        """One-off redistribution: expert e's flat fp32 chunk goes from rank ``sources[e]`` to ``owners[e]`` (a rank,
        or a tuple of ranks: one owner per group, over the world's communicator); the results are on
        ``self.device`` (wherever ``local`` was: a model built on the CPU).

        Used at conversion (experts start replicated, taken from rank 0 as DeepSpeed's broadcast does, or spread
        over expert-parallel ranks) and when re-sharding (chunks then carry optimizer state too).
        """
        move = ExpertMove.of(sources, owners, self.rank)
        kept = {e: local[e].to(device=self.device, dtype=torch.float32).clone() for e in move.kept}
        # whether anything moves, decided from the arguments (the same on every rank), never from this rank's part
        if any((s,) != (d if isinstance(d, tuple) else (d,)) for s, d in zip(sources, owners)):
            sends = {dst: [local[e] for e in experts] for dst, experts in move.sends.items()}
            received = self.exchange_chunk_lists(sends, move.recvs, numel, torch.float32, "expert move")
            for src, experts in move.recvs.items():
                for e, chunk in zip(experts, received[src]):
                    kept[e] = chunk.clone()
        return kept


class AllToAllTokens(torch.autograd.Function):
    """Differentiable ragged all-to-all of token rows; backward is the same exchange with the splits swapped.

    ``pad_rows`` zero rows follow the received rows (the combine points dropped slots at them instead of masking);
    ``x`` carries them too, after its sent rows (the expert compute writes its outputs into a block with that zero
    row): a rank alone returns ``x`` as it is, others receive into a block with the same zero rows. Their gradient
    is dropped in backward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, send_splits: List[int], recv_splits: List[int],
                counters: CommCounters, where: str = "an MoE layer", pad_rows: int = 0) -> torch.Tensor:
        ctx.comm, ctx.send_splits, ctx.recv_splits, ctx.counters, ctx.where = (comm, send_splits, recv_splits,
                                                                              counters, where)
        ctx.rows, ctx.pad_rows = sum(recv_splits), pad_rows
        return _token_exchange(comm, x, send_splits, recv_splits, counters, pad_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with ctx.comm.during(f"backward of {ctx.where}"):
            grad_in = _token_exchange(ctx.comm, grad, ctx.recv_splits, ctx.send_splits, ctx.counters, ctx.pad_rows)
        return grad_in, None, None, None, None, None, None


def _token_exchange(comm: Communicator, x: torch.Tensor, send_splits: List[int], recv_splits: List[int],
                    counters: CommCounters, pad_rows: int = 0) -> torch.Tensor:
    """``x``'s rows (``pad_rows`` zero rows after them, not sent) to their ranks; the received rows, followed by
    ``pad_rows`` zero rows."""
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    counters.dispatch_bytes += row_bytes * sum(s for d, s in enumerate(send_splits) if d != comm.rank)
    counters.count("alltoall")
    if not pad_rows:
        return comm.all_to_all(x, send_splits, recv_splits)
    if comm.alone:   # its rows come back as they went, zero rows included
        return x
    rows = sum(recv_splits)
    out = x.new_empty((rows + pad_rows,) + tuple(x.shape[1:]))
    out[rows:].zero_()
    comm.all_to_all(x[:x.shape[0] - pad_rows], send_splits, recv_splits, out=out[:rows])
    return out


__all__ = ["AllToAllTokens", "CommCounters", "Communicator", "ExpertMove", "GatheredExperts", "PendingGather",
           "materialized_buffer", "owned_experts_of"]
