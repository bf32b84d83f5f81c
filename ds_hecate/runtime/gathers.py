"""One layer's SparseAllGathers: the prefetched one in flight, the call's own, calibration's extras.

The ``hecate`` placement is gathered ahead of the call (:meth:`LayerGathers.prefetch`, issued when the previous
layer's call ends) into a block with rows reserved for what calibration may add after the gate; the call waits for
it and receives the extras into the reserved rows (:meth:`LayerGathers.extend`: nothing copied, the replicas never
live twice). The other placement policies gather after the gate (:meth:`LayerGathers.gather`). Every gathered block
is counted in the replica memory until it is freed (:class:`~.call_monitor.ReplicaMemory`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..comm.buffers import CommCounters, GatheredExperts, PendingGather, owned_experts_of
from ..comm.requests import GatherRequest
from ..planning import Placement
from ..planning.fanout import RelayPlan
from ..ops.grouped_ffn import no_rows
from ..planning.layer_planner import PlanInputs
from .call_monitor import ReplicaBytes, ReplicaMemory
from .host import LayerSetup
from .shard_store import LayerShard


class LayerGathers:
    """See the module docstring. ``counters``: the layer's traffic counters."""

    def __init__(self, setup: LayerSetup, shard: LayerShard, counters: CommCounters, memory: ReplicaMemory) -> None:
        self.setup, self.shard, self.counters, self.memory = setup, shard, counters, memory
        #: the prefetched gather, issued ahead of the call and not yet waited for
        self.pending: Optional[PendingGather] = None
        self.replica_bytes = ReplicaBytes()   # this layer's replicas alive, and their peak
        self.extensions = 0   # calls whose prefetched placement calibration extended
        #: the last gather where nothing moved: (placement, resident rows, their GatheredExperts)
        self._local: Optional[Tuple[Placement, torch.Tensor, GatheredExperts]] = None

    def relay(self, placement: Placement) -> Optional[RelayPlan]:
        """How ``placement``'s copies travel (``hecate.fanout``): the relay trees, flat below the threshold; None
        when nothing moves. The reduction of a calibrated call uses the tree of its whole placement, whatever trees
        its two gathers took: any tree returns every copy's gradient to its owner."""
        if not placement.num_moved:
            return None
        s = self.setup
        return RelayPlan.of(placement, s.ranks_per_node, s.config.fanout, s.config.relay_chunks,
                            s.relays_stream_ordered)

    def request(self, placement: Placement) -> GatherRequest:
        """SparseAllGather of ``placement``: the owned experts are the shard's resident compute-dtype weights as
        they are (nothing packed per call)."""
        s, shard = self.setup, self.shard
        return GatherRequest(s.comm, placement, shard.weights, shard.kernel.numel, s.compute_dtype, self.counters,
                             self.relay(placement), shard.weight_rows, self._track)

    def gather(self, placement: Placement, async_op: bool, spare_rows: int = 0) -> PendingGather:
        """SparseAllGather of ``placement`` into a block with ``spare_rows`` reserved for calibration's extras.
        Where nothing moves and nothing is reserved (every rank holds only its own experts) there is nothing to
        issue: the owned experts' resident rows, one object while the placement and the rows hold."""
        if placement.num_moved or spare_rows:
            return self.request(placement).start(async_op, spare_rows)
        rows = self.shard.weight_rows
        kept = self._local
        if kept is None or kept[0] is not placement or kept[1] is not rows:
            s = self.setup
            own = tuple(owned_experts_of(placement, s.rank))
            if rows is None or tuple(rows.shape) != (len(own), self.shard.kernel.numel) or rows.dtype != s.compute_dtype:
                return self.request(placement).start(async_op, spare_rows)
            empty = no_rows(self.shard.kernel.numel, s.compute_dtype, s.device)
            kept = self._local = (placement, rows, GatheredExperts(own, rows, empty, empty))
        gathered = kept[2]
        return PendingGather(placement, lambda: gathered)

    def prefetch(self, placement: Placement, inputs: PlanInputs, calibration: bool, async_op: bool = True) -> None:
        """Issue the gather of a prefetched placement (:attr:`pending`), reserving rows for calibration's extras:
        what the replica budget leaves this rank beyond the prefetched replicas, at most the experts it does not
        hold (none without calibration)."""
        spare = 0
        if calibration:
            rank = self.setup.rank
            held = len(placement.materialized[rank])
            owned = sum(1 for o in placement.owners if o == rank)
            spare = max(0, min(inputs.replica_budget - (held - owned), len(placement.owners) - held))
        self.pending = self.gather(placement, async_op, spare_rows=spare)

    def take(self) -> Optional[PendingGather]:
        """The prefetched gather, handed to the call that waits for it."""
        pending, self.pending = self.pending, None
        return pending

    def extend(self, extras: Placement, into: GatheredExperts) -> GatheredExperts:
        """Calibration's extras, received into the rows ``into`` reserved for them: the extended buffer (its memory
        was counted with ``into``'s block)."""
        s, shard = self.setup, self.shard
        extra = s.comm.start_sparse_all_gather(extras, shard.weights, shard.kernel.numel, s.compute_dtype,
                                               self.counters, async_op=False, include_owned=False, into=into,
                                               relay=self.relay(extras)).wait()
        self.extensions += len(extra.experts) > 0
        return into.extended(extra)

    def drop_pending(self) -> None:
        """Complete and forget a prefetch nobody waited for (before weights change under it)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def _track(self, gathered: GatheredExperts) -> GatheredExperts:
        """Count a gathered block until it is freed, its reserved rows included: they are allocated."""
        block = gathered.block if gathered.block is not None else gathered.buffer
        self.memory.track(block, gathered.replica_bytes, self.replica_bytes)
        return gathered


__all__ = ["LayerGathers"]
