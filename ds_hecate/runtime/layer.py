"""One MoE layer call on every rank, whatever its tokens (:meth:`LayerBinding.run`).

1. (ahead of time, when prefetching) SparseAllGather of the placement the planner predicts from the load window;
2. exchange per-expert token counts (all-gather); the planner may calibrate the placement (extra gather);
3. route tokens (topology-aware dispatch) and send them to the ranks that process them (ragged all-to-all);
4. run each materialized expert on its rows; send results back (ragged all-to-all) and combine;
5. prefetch the next layer's placement.

The gather/compute pair is an autograd function (:mod:`.expert_compute`), so backward issues SparseReduceScatter
(and, with re-materialization, a second SparseAllGather) in the mirror order on every rank. All planning is
:class:`~ds_hecate.planning.layer_planner.LayerPlanner`'s, the code the simulator runs too.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..comm.collectives import CommCounters, GatheredExperts, PendingGather
from ..errors import HecateError
from ..planning import Placement
from ..planning.balance import estimated_force_balanced_fraction
from ..planning.cost_model import imbalance, owner_loads
from ..planning.dispatch_plan import DispatchPlan, rank_tables
from ..planning.fanout import RelayPlan
from ..planning.layer_planner import LayerPlanner, PlanInputs, PlannerSettings
from ..planning.search.reuse import ScheduleReuse
from .phases import PHASES
from .dispatcher import Routes, TokenDispatcher, slot_histogram
from .expert_compute import (CallGrads, ExpertRows, Materialize, MaterializeWeights, RematerializedExperts, run_loop,
                             run_parts, grouped_operands)
from .interfaces import RuntimeView
from .shard_store import LayerShard, ShardAccumulator
from .tensor_parallel import run_layer
from .timing import Intervals, PhaseTimer, boundary




def in_backward_pass() -> bool:
    """True while autograd runs a backward pass (activation-checkpoint recompute happens there)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


class LayerBinding:
    """Connects one ``ds_hecate.MoE`` module to the runtime and to its shard."""

    def __init__(self, runtime: RuntimeView, shard: LayerShard, hidden_size: int) -> None:
        self.runtime = runtime
        self.index = len(runtime.bindings)   # registration order: this layer's place in the pool and call order
        self.shard = shard
        self.hidden_size = hidden_size
        self.cost = runtime.comm_cost_model(shard, hidden_size)
        self.planner = LayerPlanner(PlannerSettings.from_config(runtime.config, runtime.ranks_per_node),
                                    runtime.ep_size, shard.num_experts)
        self.counters = CommCounters()
        self.host_phase_s: Dict[str, float] = {p: 0.0 for p in PHASES}   # host time (launches, planning)
        self.pending: Optional[PendingGather] = None
        #: each forward call's counts, plan and the gathers that built its buffer (prefetched placement, extras)
        self.forward_cache: List[Tuple[np.ndarray, DispatchPlan, Placement, Optional[Placement]]] = []
        self.last_plan: Optional[DispatchPlan] = None
        self.last_counts: Optional[np.ndarray] = None
        self.calls = 0
        self.prefetch_hits = 0
        self.recomputes = 0
        self.extensions = 0   # calls whose prefetched placement calibration extended (extras in the reserved rows)
        self.remembered_calibrations = 0   # calibrations that took the remembered placement instead of searching
        self.shadow_calibrations = 0   # calibrations that took the hot experts on every rank instead of searching
        self.growth_calibrations = 0   # calibrations that took FasterMoE's growth without a search (search_record)
        self.pairs_processed = 0
        self.gap_time = Intervals(keep=16)   # device time between the previous MoE layer and this one
        self.device_time = {p: Intervals(keep=0) for p in PHASES}   # device time per phase: stats, cost model
        self.cross_node_rows = 0
        self.avoidable_cross_node_rows = 0
        self.peak_replica_bytes = 0
        self._live_buffers: List[Tuple[weakref.ref, int]] = []   # gathered buffers and their replica bytes
        self.top_k = 0  # routes per token, seen at the last call (for the trace header)
        self.dispatcher = TokenDispatcher(runtime.comm, self.counters, f"MoE layer '{shard.name}'",
                                          runtime.comm.transport.device_ops.combine)

    # -- helpers -----------------------------------------------------------------------------------------------
    def timed(self, phase: str) -> PhaseTimer:
        return PhaseTimer(self, phase)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one materialized expert in the compute dtype."""
        return self.shard.kernel.numel * torch.empty((), dtype=self.runtime.compute_dtype).element_size()

    def replica_budget(self) -> int:
        """Replicas this layer may hold per rank: its slots in the replica pool (``materialize_budget_mb``)."""
        return self.runtime.grant(self).replicas

    @property
    def rematerializes(self) -> bool:
        """Whether this layer frees its replicas after forward and gathers them again in backward (the pool's
        decision, or ``hecate.rematerialize`` when set)."""
        return self.runtime.grant(self).rematerialize

    @property
    def predictor(self):
        """The layer's load window (checkpoints and re-sharding read it)."""
        return self.planner.predictor

    @property
    def schedule(self):
        """The layer's schedule re-use state (checkpoints and statistics read it)."""
        return self.planner.schedule

    def plan_inputs(self) -> PlanInputs:
        """What the planner reads that may change between calls: owners, measured costs, the replica budget."""
        return PlanInputs(self.shard.owners, self.runtime.step_costs(self), self.replica_budget(), self.cost)

    # -- collectives ---------------------------------------------------------------------------------------------
    def relay(self, placement: Placement) -> RelayPlan:
        """How ``placement``'s copies travel (``hecate.fanout``): the relay trees, flat below the threshold. The
        reduction of a calibrated call uses the tree of its whole placement, whatever trees its two gathers took:
        any tree returns every copy's gradient to its owner."""
        config = self.runtime.config
        return RelayPlan.of(placement, self.runtime.ranks_per_node, config.fanout, config.relay_chunks,
                            self.runtime.relays_stream_ordered)

    def gather(self, placement: Placement, async_op: bool, spare_rows: int = 0) -> PendingGather:
        """SparseAllGather of ``placement`` into a block with ``spare_rows`` reserved for calibration's extras
        (:meth:`gather_prefetched` sizes them)."""
        rt = self.runtime
        # the owned experts are the shard's resident compute-dtype weights as they are: nothing packed per call
        pending = rt.comm.start_sparse_all_gather(placement, self.shard.weights, self.shard.kernel.numel,
                                                  rt.compute_dtype, self.counters, async_op=async_op,
                                                  spare_rows=spare_rows, relay=self.relay(placement),
                                                  resident=self.shard.weight_rows)
        finish = pending.wait

        return PendingGather(placement, lambda: self._track(finish()))

    def gather_extras(self, extras: Placement, into: GatheredExperts) -> GatheredExperts:
        """Calibration's extras, received into the rows ``into`` reserved for them: the extended buffer (its
        memory was tracked with ``into``'s block)."""
        rt = self.runtime
        extra = rt.comm.start_sparse_all_gather(extras, self.shard.weights, self.shard.kernel.numel, rt.compute_dtype,
                                                self.counters, async_op=False, include_owned=False, into=into,
                                                relay=self.relay(extras)).wait()
        self.extensions += len(extra.experts) > 0
        return into.extended(extra)

    def gather_prefetched(self, placement: Placement, inputs: PlanInputs, async_op: bool) -> PendingGather:
        """The gather of a prefetched placement, reserving rows for calibration's extras: what the replica budget
        leaves this rank beyond the prefetched replicas, at most the experts it does not hold (none without
        calibration)."""
        spare = 0
        if self.planner.settings.calibration:
            rank = self.runtime.rank
            held = len(placement.materialized[rank])
            owned = sum(1 for o in placement.owners if o == rank)
            spare = max(0, min(inputs.replica_budget - (held - owned), len(placement.owners) - held))
        return self.gather(placement, async_op, spare_rows=spare)

    def _track(self, gathered: GatheredExperts) -> GatheredExperts:
        """Remember a gathered block until it is freed (replica memory statistics and budget checks), its reserved
        rows counted: they are allocated."""
        block = gathered.block if gathered.block is not None else gathered.buffer   # the replicas' block
        self._live_buffers.append((weakref.ref(block), gathered.replica_bytes))
        self.peak_replica_bytes = max(self.peak_replica_bytes, self.replica_bytes_alive())
        self.runtime.note_replica_bytes()
        return gathered

    def reduce_scatter(self, plan: DispatchPlan, experts, own_grads: Optional[torch.Tensor],
                       replica_grads: torch.Tensor) -> None:
        """Issue the layer's SparseReduceScatter asynchronously (``experts``: the call's, own first; ``own_grads``:
        their owned rows' gradients, None when the expert compute wrote them into the accumulator already;
        ``replica_grads``: the replica rows'); the rest of backward runs while it is in flight, and
        :meth:`HecateRuntime.flush_reductions` completes it, adding into the owners' gradient rows in place."""
        rt = self.runtime
        with self.timed("reduce_scatter"):
            finish = rt.comm.start_sparse_reduce_scatter(plan.placement, experts, own_grads, replica_grads,
                                                         rt.reduce_dtype,
                                                         self.counters, ShardAccumulator(self.shard, rt.device),
                                                         relay=self.relay(plan.placement))
        rt.pending_reductions.append((self, finish))
        rt.issued_reduction()

    def replica_bytes_alive(self) -> int:
        """Bytes of this layer's materialized replicas (experts of other ranks) still alive."""
        total, alive = 0, []
        for ref, replica_bytes in self._live_buffers:
            if ref() is not None:
                total += replica_bytes
                alive.append((ref, replica_bytes))
        self._live_buffers = alive
        return total

    # -- planning -----------------------------------------------------------------------------------------------
    def check_saved_schedule(self, state: dict) -> None:
        """Raise if a checkpoint's saved schedule (``ScheduleReuse.state_dict``) cannot belong to this layer."""
        rt = self.runtime
        if not ScheduleReuse.state_fits(state, rt.ep_size, self.shard.num_experts):
            raise HecateError(f"MoE layer '{self.shard.name}': the checkpoint's saved schedule does not fit this "
                              f"model ({rt.ep_size} ranks, {self.shard.num_experts} experts); the checkpoint's "
                              "meta.json is damaged")

    def restore_schedule(self, state: dict) -> None:
        """Adopt a checkpointed schedule (after owners and measured costs are restored): same reuse decisions."""
        self.planner.restore_schedule(state, self.plan_inputs())

    def start_prefetch(self) -> None:
        if self.pending is None and self.planner.prefetches:
            with self.timed("plan"):  # the scheduler's search runs here, after the previous layer
                inputs = self.plan_inputs()
                placement = self.planner.prefetch_placement(inputs)
                # the dispatch tables of this placement, so the call after the gate only divides counts
                rank_tables(placement, self.runtime.ranks_per_node, self.runtime.rank)
            with self.timed("gather"):   # issued now, waited for in the call
                self.pending = self.gather_prefetched(placement, inputs, async_op=True)

    def _plan(self, counts: np.ndarray) -> Tuple[DispatchPlan, PendingGather, Optional[Placement]]:
        """Plan this call; returns (plan, gather of the prefetched placement, calibration's extras or None)."""
        inputs, rank = self.plan_inputs(), self.runtime.rank
        if not self.planner.prefetches:
            after = self.planner.plan_call(counts, inputs, None, rank)
            return after.plan, self.gather(after.plan.placement, async_op=False), None
        self.prefetch_hits += self.pending is not None
        if self.pending is None:
            self.pending = self.gather_prefetched(self.planner.prefetch_placement(inputs), inputs, async_op=False)
        pending, self.pending = self.pending, None
        after = self.planner.plan_call(counts, inputs, pending.placement, rank)
        self.remembered_calibrations += after.remembered
        self.shadow_calibrations += after.shadowed
        self.growth_calibrations += after.grown
        return after.plan, pending, after.extras

    def _cached_plan(self, counts: np.ndarray) -> Tuple[DispatchPlan, Placement, Optional[Placement]]:
        """The plan of the forward call this recompute replays, with the placements its buffer was gathered from
        (the prefetched one, and calibration's extras or None). Kept until the next model forward: torch's
        non-reentrant checkpointing may recompute a region twice (backward reaching an auxiliary output, such as
        the gate's l_aux, before the main path), and every recompute must replay the same plan."""
        for cached_counts, plan, prefetched, extras in self.forward_cache:
            if np.array_equal(cached_counts, counts):
                return plan, prefetched, extras
        raise HecateError(
            f"MoE layer '{self.shard.name}': activation-checkpoint recompute routed tokens differently from the "
            "forward pass; recompute must reproduce the gate (keep torch.utils.checkpoint's preserve_rng_state=True "
            "and do not change the model between forward and backward)")

    # -- one layer call ---------------------------------------------------------------------------------------
    def run(self, x: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor,
            arithmetic: str = "deepspeed") -> torch.Tensor:
        """The layer's routed-experts output ``[S, H]`` for a data-parallel slice's tokens (the MoE layers call
        this): :meth:`call`, with a model-parallel unit on this tensor-parallel rank's share of them
        (:mod:`.tensor_parallel`)."""
        return run_layer(self.call, self.runtime.layout.tensor_parallel, self.shard.num_experts, x, indices, gates,
                         arithmetic)

    def call(self, x: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor,
             arithmetic: str = "deepspeed") -> torch.Tensor:
        """The layer's routed-experts output ``[S, H]``: for each token the sum over its routes ``j`` (``indices``:
        ``[k, S]`` expert ids, -1 = dropped) of ``gates[j, t]`` times the expert's output, combined with the caller's
        arithmetic (:mod:`ds_hecate.ops.combine`: ``"deepspeed"`` or ``"hf"``).

        ``gates`` also feeds the health check: non-finite gate values or expert ids out of range travel with the
        count exchange, so every rank of the group learns of a bad rank at the same collective; with one group all
        raise there, with several the whole world agrees at the end of the forward (:mod:`.stops`; out-of-range
        routes are out of every count, so the call runs as if they were dropped). The count exchange is the
        call's only host read of the device (``tests/test_host_syncs.py`` counts them). Every part of the call,
        backward included, is timed in a phase (:mod:`.phases`).
        """
        rt, shard = self.runtime, self.shard
        recompute = in_backward_pass()
        rt.note_layer_call(self, recompute)
        if not recompute and rt.last_layer_end is not None:
            self.gap_time.add(rt.last_layer_end, rt.clock.mark())
        x = boundary(x, self, "dispatch_bwd", None)
        self.top_k = indices.shape[0]
        flat = indices.reshape(-1)
        if flat.dtype != torch.int64:   # (DeepSpeed's gate gives int32 ids)
            flat = flat.long()
        with self.timed("counts"):
            exchanged = rt.comm.exchange_counts(slot_histogram(flat, gates, shard.num_experts))
            counts = exchanged[:, :shard.num_experts]   # [ranks, experts] int64 on the host: the planner's input
            # (the flags as the stops read them: non-finite, out of range)
            rt.stops.check_gate(exchanged[:, [shard.num_experts + 1, shard.num_experts]], shard.name,
                                shard.num_experts, rt.comm.rank_name)
        plan, gathered = self._plan_and_gather(counts, recompute)
        with self.timed("dispatch"):
            routes = Routes.of(flat, int(counts[rt.rank].sum()), x.shape[0], self.top_k, shard.num_experts,
                               plan.for_rank(rt.rank), rt.comm.alone)
            recv = boundary(self.dispatcher.dispatch(x, routes), self, "compute_bwd", "dispatch_bwd")
        with self.timed("compute"):
            y_recv = self._compute(recv, plan, gathered, routes.pad_rows)
            # the gathers' last reference in this call: with re-materialization the replicas are freed here,
            # before the next layer's prefetch allocates its own (only one layer's replicas are in the budget)
            del gathered
        y_recv = boundary(y_recv, self, "combine_bwd", "compute_bwd")
        with self.timed("combine"):
            out = boundary(self.dispatcher.combine(y_recv, gates, routes, arithmetic), self, None, "combine_bwd")
        if not recompute:   # bookkeeping after the tokens moved: off the critical path (before the next prefetch)
            with self.timed("bookkeeping"):
                self.planner.observe(counts)
                self._record(plan, counts)
            if rt.config.prefetch:
                rt.prefetch_after(self)
        rt.last_layer_end = rt.clock.mark()
        return out

    def _plan_and_gather(self, counts: np.ndarray, recompute: bool) -> Tuple[DispatchPlan, GatheredExperts]:
        """This call's plan and its experts (the prefetched gather waited for, calibration's extras received into
        its reserved rows). A recompute replays its forward's plan and gathers (same rows: checkpointing checks
        every saved shape)."""
        rank = self.runtime.rank
        with self.timed("plan"):
            if recompute:
                self.recomputes += 1
                plan, prefetched, extra = self._cached_plan(counts)
                spare = 0 if extra is None else sum(1 for _, dst in extra.gather_pairs if dst == rank)
                pending = self.gather(prefetched, async_op=False, spare_rows=spare)
            else:
                plan, pending, extra = self._plan(counts)
                # (DeepSpeed's reentrant checkpointing runs the forward under no_grad)
                self.forward_cache.append((counts, plan, pending.placement, extra))
        with self.timed("gather"):
            gathered = pending.wait()
            if extra is not None:
                gathered = self.gather_extras(extra, gathered)
        return plan, gathered

    def _compute(self, recv: torch.Tensor, plan: DispatchPlan, gathered: GatheredExperts,
                 pad_rows: int) -> torch.Tensor:
        """The experts on the received rows (:mod:`.expert_compute`): outputs in the received order, then
        ``pad_rows`` zero rows."""
        rt, kernel = self.runtime, self.shard.kernel
        rows = ExpertRows.of(plan.for_rank(rt.rank), gathered.experts, gathered.owned, recv.device, pad_rows,
                             rt.comm.alone)
        if self.rematerializes:
            return RematerializedExperts.apply(recv, rt.autograd_anchor, self, plan, gathered, rows)
        operands = grouped_operands(kernel, gathered, recv)
        if operands is not None:
            grads = CallGrads(self, gathered)
            recv = Materialize.apply(recv, rt.autograd_anchor, self, plan, gathered.experts, grads)
            return run_parts(kernel, gathered, recv, rows, grads, operands)
        recv, own, replicas = MaterializeWeights.apply(recv, rt.autograd_anchor, self, plan, gathered)
        return run_loop(kernel, own, replicas, recv, rows)

    def _record(self, plan: DispatchPlan, counts: np.ndarray) -> None:
        self.last_plan, self.last_counts = plan, counts
        self.calls += 1
        self.pairs_processed += plan.tokens_processed(self.runtime.rank)
        crossing, avoidable = plan.node_traffic(self.runtime.ranks_per_node)
        self.cross_node_rows += crossing
        self.avoidable_cross_node_rows += avoidable
        for observe in self.runtime.observers:  # ds_hecate.deepspeed_glue.monitor: step metrics, routing trace
            observe(self, plan, counts)

    # -- statistics ----------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        plan, counts = self.last_plan, self.last_counts
        out = {"name": self.shard.name, "num_experts": self.shard.num_experts, "owners": list(self.shard.owners),
               "owned_experts": self.shard.owned, "forward_calls": self.calls, "prefetch_hits": self.prefetch_hits,
               "extensions": self.extensions, "recomputes": self.recomputes, "replica_budget": self.replica_budget(),
               "rematerialize": self.rematerializes,
               "schedule_searches": self.schedule.searches, "schedule_reuses": self.schedule.reuses,
               "remembered_calibrations": self.remembered_calibrations,
               "shadow_calibrations": self.shadow_calibrations,
               "growth_calibrations": self.growth_calibrations,
               "peak_replica_bytes": self.peak_replica_bytes, **self.counters.as_dict(),
               "cross_node_tokens": self.cross_node_rows,
               "avoidable_cross_node_tokens": self.avoidable_cross_node_rows,
               "time_s": {k: round(v, 6) for k, v in self.phase_seconds().items()},
               "host_time_s": {k: round(v, 6) for k, v in self.host_phase_s.items()}}
        if plan is not None and counts is not None:
            world = self.runtime.ep_size
            before = owner_loads(counts, self.shard.owners, world)
            after = plan.loads()
            moved_experts = {e for e, _ in plan.gather_pairs}
            out.update({
                "tokens_per_expert": np.asarray(counts).sum(axis=0).tolist(),
                "compute_per_rank_before": before, "compute_per_rank_after": after,
                "load_imbalance_before": imbalance(before), "load_imbalance_after": imbalance(after),
                "replicas": plan.num_moved, "materialized": [list(m) for m in plan.materialized],
                "lambda": len(moved_experts) / self.shard.num_experts,
                "force_balanced_fraction": self.force_balanced_estimate(plan, counts),
            })
        return out

    def phase_seconds(self) -> Dict[str, float]:
        """Device seconds per phase so far (CUDA events: resolving them is a host synchronisation, so this is for
        step boundaries and statistics, not the layer call)."""
        return {p: self.device_time[p].total() for p in PHASES}

    def force_balanced_estimate(self, plan: DispatchPlan, counts: np.ndarray) -> float:
        """``stats()``'s ``force_balanced_fraction`` of one executed call: the cost model's estimate of the layer with
        the same pairs per rank forced uniform under the owner placement, over its estimate for ``plan``
        (:func:`~ds_hecate.planning.balance.estimated_force_balanced_fraction`). An estimate because a measured one
        would need a second, uniform run; computed only when ``stats()`` asks. The ``hecate`` placement's replicas
        count as prefetched; other placements gather after the gate, fully exposed."""
        rt = self.runtime
        prefetched = None if self.planner.prefetches else tuple(() for _ in range(plan.world_size))
        return estimated_force_balanced_fraction(counts, self.shard.owners, plan.materialized, rt.step_costs(self),
                                                 rt.ranks_per_node, prefetched)
