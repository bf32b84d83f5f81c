"""One MoE layer call on every rank, whatever its tokens (:meth:`LayerBinding.call`), read top to bottom:

1. **counts**: each rank's token-expert pairs per expert, exchanged (the call's one host read of the device);
2. **plan**: the placement gathered ahead of the call (prefetched after the previous layer, from the load window),
   calibrated against the counts where the prediction missed, and this rank's dispatch (:mod:`.call_plan`);
3. **gather**: wait for the SparseAllGather; calibration's extras into the rows it reserved (:mod:`.gathers`);
4. **dispatch**: tokens to the ranks that hold their experts (:mod:`.dispatcher`);
5. **experts**: every materialized expert on its rows, one autograd node whose backward hands the SparseReduceScatter
   to the queue (:mod:`.sharded_experts`);
6. **combine**: outputs back and summed weighted by the gates; then the next layer's prefetch.

Backward mirrors it on every rank. The layer owns its planner, its gathers, its counters and statistics
(:mod:`.layer_stats`); of the runtime it reads only :class:`~.host.LayerHost`.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ..comm.buffers import CommCounters, GatheredExperts, PendingGather
from ..comm.requests import ReduceScatterRequest
from ..planning.balance import estimated_force_balanced_fraction
from ..planning.cost_model import CommCostModel, imbalance, owner_loads
from ..planning.dispatch_plan import DispatchPlan
from ..planning.layer_planner import PlanInputs, PlannerSettings
from .call_monitor import LayerPhases
from .call_plan import CallPlan, CallPlanner
from .dispatcher import Routes, TokenDispatcher, slot_histogram
from .gathers import LayerGathers
from .host import LayerHost
from .layer_stats import CallTally
from .phases import PHASES
from .shard_store import LayerShard, ShardAccumulator
from .sharded_experts import ExpertCall, ExpertCompute, ExpertRows, sharded_experts
from .tensor_parallel import run_layer
from .timing import PhaseTimes, in_backward_pass


class LayerBinding:
    """One ``ds_hecate.MoE`` module's (or taken-over experts module's) layer in the runtime: ``index`` is its place
    in registration order (the replica pool and the call order count in it)."""

    def __init__(self, host: LayerHost, index: int, shard: LayerShard, hidden_size: int) -> None:
        setup = host.setup
        self.host, self.index, self.shard, self.hidden_size = host, index, shard, hidden_size
        act = torch.empty((), dtype=setup.compute_dtype).element_size()
        grad = torch.empty((), dtype=setup.reduce_dtype).element_size()
        self.cost = CommCostModel(hidden_size=hidden_size, expert_numel=shard.kernel.numel, activation_bytes=act,
                                  param_bytes=act, grad_bytes=grad)
        self.counters = CommCounters()
        self.times = PhaseTimes(PHASES)
        self.phases = LayerPhases(host.monitor, setup.comm, self.times, shard.name)
        self.planner = CallPlanner(PlannerSettings.from_config(setup.config, setup.ranks_per_node), setup.ep_size,
                                   shard.num_experts, shard.name)
        self.gathers = LayerGathers(setup, shard, self.counters, host.monitor.memory)
        self.dispatcher = TokenDispatcher(setup.comm, self.counters, f"MoE layer '{shard.name}'",
                                          setup.comm.transport.device_ops.combine)
        self.compute = ExpertCompute(shard.kernel, setup.compute_dtype)
        self.accumulator = ShardAccumulator(shard, setup.device)   # the owned experts' gradient rows
        self._reduce: Optional[ReduceScatterRequest] = None   # the last call's, reused while its inputs hold
        self.tally = CallTally(setup)
        self._inputs: Optional[PlanInputs] = None

    # -- one layer call ---------------------------------------------------------------------------------------
    def run(self, x: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor,
            arithmetic: str = "deepspeed") -> torch.Tensor:
        """The layer's routed-experts output ``[S, H]`` for a data-parallel slice's tokens (the MoE layers call
        this): :meth:`call`, with a model-parallel unit on this tensor-parallel rank's share of them
        (:mod:`.tensor_parallel`)."""
        return run_layer(self.call, self.host.setup.tensor_parallel, self.shard.num_experts, x, indices, gates,
                         arithmetic)

    def call(self, x: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor,
             arithmetic: str = "deepspeed") -> torch.Tensor:
        """The layer's routed-experts output ``[S, H]``: for each token the sum over its routes ``j`` (``indices``:
        ``[k, S]`` expert ids, -1 = dropped) of ``gates[j, t]`` times the expert's output, combined with the caller's
        arithmetic (:mod:`ds_hecate.ops.combine`: ``"deepspeed"`` or ``"hf"``).

        ``gates`` also feeds the health check: non-finite gate values or expert ids out of range travel with the
        count exchange, so every rank of the group learns of a bad rank at the same collective (:mod:`.stops`;
        out-of-range routes are out of every count, so the call runs as if they were dropped)."""
        recompute = in_backward_pass()
        if not recompute:
            self.host.monitor.layer_starts(self.times)
        host, setup, phases = self.host, self.host.setup, self.phases
        host.sequence.called(self.index, recompute)
        x = phases.boundary(x, "dispatch_bwd", None)
        self.tally.top_k = indices.shape[0]
        flat = indices.reshape(-1)
        if flat.dtype != torch.int64:   # (DeepSpeed's gate gives int32 ids)
            flat = flat.long()
        with phases("counts"):
            counts = self._exchange_counts(flat, gates)
        with phases("plan"):
            step, pending = self._plan(counts, recompute)
        with phases("gather"):
            gathered = self._materialize(step, pending)
            del pending   # (it holds the gathered block too: the block's only reference must be the call's)
        with phases("dispatch"):
            routes = Routes.of(flat, sum(counts[setup.rank].tolist()), x.shape[0], indices.shape[0],
                               self.shard.num_experts, step.mine, setup.comm.alone)
            recv = phases.boundary(self.dispatcher.dispatch(x, routes), "compute_bwd", "dispatch_bwd")
        with phases("compute"):
            y_recv = sharded_experts(recv, self._expert_call(step, gathered, recv.device, routes.pad_rows))
            # the gathers' last reference in this call: with re-materialization the replicas are freed here,
            # before the next layer's prefetch allocates its own (only one layer's replicas are in the budget)
            del gathered
        y_recv = phases.boundary(y_recv, "combine_bwd", "compute_bwd")
        with phases("combine"):
            out = phases.boundary(self.dispatcher.combine(y_recv, gates, routes, arithmetic), None, "combine_bwd")
        if not recompute:   # after the tokens moved: off the critical path (before the next prefetch)
            with phases("bookkeeping"):
                self.planner.observe(counts)
                self.tally.record(step.plan, step.mine, counts)
                host.monitor.observe(self, step.plan, counts)
            self._prefetch_next()
        host.monitor.layer_ends()
        return out

    def _exchange_counts(self, flat: torch.Tensor, gates: torch.Tensor) -> np.ndarray:
        """``[ranks, experts]`` int64 on the host, the planner's input; the health flags checked (non-finite,
        out of range), on every rank of the group alike."""
        setup, experts = self.host.setup, self.shard.num_experts
        exchanged = setup.comm.exchange_counts(slot_histogram(flat, gates, experts))
        flags = exchanged[:, experts:]   # out of range, non-finite: one count on the healthy path
        if np.count_nonzero(flags):
            setup.stops.check_gate(flags[:, ::-1], self.shard.name, experts, setup.comm.rank_name)
        return exchanged[:, :experts]

    def _plan(self, counts: np.ndarray, recompute: bool) -> Tuple[CallPlan, PendingGather]:
        """This call's plan and the gather its block comes from: a recompute replays its forward's (same rows:
        checkpointing checks every saved shape); ``hecate`` plans over the prefetched gather (issued now if no
        prefetch was); the other policies gather their whole placement after the gate."""
        planner, gathers, rank = self.planner, self.gathers, self.host.setup.rank
        if recompute:
            step = planner.replay(counts)
            return step, gathers.gather(step.gathered, async_op=False, spare_rows=step.spare_rows(rank))
        inputs = self.plan_inputs()
        if not planner.prefetches:
            step = planner.after_gate(counts, inputs, None, rank)
            return step, gathers.gather(step.gathered, async_op=False)
        pending = gathers.take()
        planner.prefetch_hits += pending is not None
        if pending is None:
            gathers.prefetch(planner.prefetch(inputs, rank), inputs, planner.calibration, async_op=False)
            pending = gathers.take()
        assert pending is not None
        return planner.after_gate(counts, inputs, pending.placement, rank), pending

    def _materialize(self, step: CallPlan, pending: PendingGather) -> GatheredExperts:
        """The call's experts: the gather waited for, calibration's extras received into its reserved rows."""
        gathered = pending.wait()
        return gathered if step.extras is None else self.gathers.extend(step.extras, gathered)

    def _expert_call(self, step: CallPlan, gathered: GatheredExperts, device: torch.device,
                     pad_rows: int) -> ExpertCall:
        """Everything the experts' node needs, where their gradients go and the SparseReduceScatter they issue."""
        setup, placement = self.host.setup, step.plan.placement
        rows = ExpertRows.of(step.mine, gathered.experts, gathered.owned, device, pad_rows, setup.comm.alone)
        reduce = self._reduce
        if reduce is None or reduce.placement is not placement or reduce.experts is not gathered.experts:
            reduce = self._reduce = ReduceScatterRequest(setup.comm, placement, gathered.experts, setup.reduce_dtype,
                                                         self.counters, self.accumulator, self.gathers.relay(placement))
        regather = self.gathers.request(placement) if self.rematerializes else None
        return ExpertCall(self.compute, gathered, rows, step.mine, self.accumulator, reduce, self.host.reductions,
                          self, self.phases, regather, setup.comm.alone)

    # -- prefetch ----------------------------------------------------------------------------------------------
    def _prefetch_next(self) -> None:
        if self.host.setup.config.prefetch:
            following = self.host.sequence.after(self.index)
            if following is not None:
                following.start_prefetch()

    def start_prefetch(self) -> None:
        """Plan this layer's next call before its gate and issue its SparseAllGather (waited for in the call)."""
        if self.gathers.pending is None and self.planner.prefetches:
            with self.phases("plan"):   # the scheduler's search runs here, after the previous layer
                inputs = self.plan_inputs()
                placement = self.planner.prefetch(inputs, self.host.setup.rank)
            with self.phases("gather"):   # issued now, waited for in the call
                self.gathers.prefetch(placement, inputs, self.planner.calibration)

    # -- what planning reads -----------------------------------------------------------------------------------
    def plan_inputs(self) -> PlanInputs:
        """What the planner reads that may change between calls: owners, measured costs, the replica budget (one
        object while they hold)."""
        costs, replicas, owners = self.host.step_costs(self), self.replica_budget(), self.shard.owners
        kept = self._inputs
        if kept is None or kept.owners is not owners or kept.costs is not costs or kept.replica_budget != replicas:
            kept = self._inputs = PlanInputs(owners, costs, replicas, self.cost)
        return kept

    def replica_budget(self) -> int:
        """Replicas this layer may hold per rank: its slots in the replica pool (``materialize_budget_mb``)."""
        return self.host.grant(self).replicas

    @property
    def rematerializes(self) -> bool:
        """Whether this layer frees its replicas after forward and gathers them again in backward (the pool's
        decision, or ``hecate.rematerialize`` when set)."""
        return self.host.grant(self).rematerialize

    @property
    def expert_bytes(self) -> int:
        """Bytes of one materialized expert in the compute dtype."""
        return self.shard.kernel.numel * torch.empty((), dtype=self.host.setup.compute_dtype).element_size()

    def stats(self) -> dict:
        """This layer's entry of ``engine.hecate.stats()["layers"]`` (docs/stats.md)."""
        shard, planner, gathers, tally = self.shard, self.planner, self.gathers, self.tally
        plan, counts = tally.last_plan, tally.last_counts
        out = {"name": shard.name, "num_experts": shard.num_experts, "owners": list(shard.owners),
               "owned_experts": shard.owned, "forward_calls": tally.calls, "prefetch_hits": planner.prefetch_hits,
               "extensions": gathers.extensions, "recomputes": planner.recomputes,
               "replica_budget": self.replica_budget(), "rematerialize": self.rematerializes,
               "schedule_searches": planner.schedule.searches, "schedule_reuses": planner.schedule.reuses,
               "remembered_calibrations": planner.remembered_calibrations,
               "shadow_calibrations": planner.shadow_calibrations,
               "growth_calibrations": planner.growth_calibrations,
               "peak_replica_bytes": self.peak_replica_bytes, **self.counters.as_dict(),
               "cross_node_tokens": tally.cross_node_rows,
               "avoidable_cross_node_tokens": tally.avoidable_cross_node_rows,
               "time_s": {k: round(v, 6) for k, v in self.phase_seconds().items()},
               "host_time_s": {k: round(v, 6) for k, v in self.times.host.items()}}
        if plan is not None and counts is not None:
            before = owner_loads(counts, shard.owners, self.host.setup.ep_size)
            after = plan.loads()
            moved_experts = {e for e, _ in plan.gather_pairs}
            out.update({
                "tokens_per_expert": np.asarray(counts).sum(axis=0).tolist(),
                "compute_per_rank_before": before, "compute_per_rank_after": after,
                "load_imbalance_before": imbalance(before), "load_imbalance_after": imbalance(after),
                "replicas": plan.num_moved, "materialized": [list(m) for m in plan.materialized],
                "lambda": len(moved_experts) / shard.num_experts,
                "force_balanced_fraction": self.force_balanced_estimate(plan, counts),
            })
        return out

    def force_balanced_estimate(self, plan: DispatchPlan, counts: np.ndarray) -> float:
        """``stats()``'s ``force_balanced_fraction`` of one executed call: the cost model's estimate of the layer with
        the same pairs per rank forced uniform under the owner placement, over its estimate for ``plan``
        (:func:`~ds_hecate.planning.balance.estimated_force_balanced_fraction`). An estimate because a measured one
        would need a second, uniform run; computed only when ``stats()`` asks. The ``hecate`` placement's replicas
        count as prefetched; other placements gather after the gate, fully exposed."""
        prefetched = None if self.planner.prefetches else tuple(() for _ in range(plan.world_size))
        return estimated_force_balanced_fraction(counts, self.shard.owners, plan.materialized,
                                                 self.host.step_costs(self), self.host.setup.ranks_per_node,
                                                 prefetched)

    def phase_seconds(self) -> Dict[str, float]:
        """Device seconds per phase so far (resolving CUDA events is a host synchronisation: step boundaries and
        statistics only)."""
        return self.times.seconds()

    def replica_bytes_alive(self) -> int:
        """Bytes of this layer's materialized replicas (experts of other ranks) still alive."""
        return self.gathers.replica_bytes.live

    @property
    def peak_replica_bytes(self) -> int:
        return self.gathers.replica_bytes.peak

    def __repr__(self) -> str:
        return f"LayerBinding({self.shard.name!r}, index={self.index})"


__all__ = ["LayerBinding", "in_backward_pass"]
