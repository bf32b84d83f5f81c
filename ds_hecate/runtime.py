"""Hecate runtime: per-layer execution of one MoE call, and the per-step expert update.

One MoE layer call, on every rank, whatever its tokens (:meth:`LayerBinding.run`):

1. (ahead of time, when prefetching) SparseAllGather of the placement predicted from the load window;
2. exchange per-expert token counts (all-gather); optionally calibrate the placement with them (extra gather);
3. route tokens (topology-aware dispatch) and send them to the ranks that process them (ragged all-to-all);
4. run each materialized expert on its rows; send results back (ragged all-to-all) and combine;
5. prefetch the next layer's placement.

The gather/compute pair is an autograd function, so backward issues SparseReduceScatter (and, with
re-materialization, a second SparseAllGather) in the mirror order on every rank.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .collectives import AllToAllTokens, CommCounters, Communicator, PendingGather
from .config import HecateConfig
from .errors import HecateError
from .expert_optimizer import ExpertOptimizer
from .logging_utils import logger
from .planning import CommCostModel, Placement, POLICIES
from .planning.critical_path import plan_after_gate
from .expert_compute import Materialize, RematerializedExperts, expand_segments, expert_major_order, run_experts
from .planning.dispatch_plan import DispatchPlan, rank_tables
from .planning.placement import STEP_COST_POLICIES
from .planning.predictor import LoadPredictor
from .planning.schedule_reuse import ScheduleReuse
from .planning.scheduler import StepCostModel, imbalance, owner_loads
from .memory_plan import replica_budget, scheduler_costs
from .profiling import WARM_PROFILE_STEP, expert_work, measure_costs
from .shard_store import ExpertShardStore, LayerShard
from .timing import DeviceClock, Intervals, PhaseTimer

PHASES = ("counts", "plan", "gather", "dispatch", "compute", "combine", "reduce_scatter", "reduce_wait", "regather")


def _in_backward_pass() -> bool:
    """True while autograd runs a backward pass (activation-checkpoint recompute happens there)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


class LayerBinding:
    """Connects one ``ds_hecate.MoE`` module to the runtime and to its shard."""

    def __init__(self, runtime: "HecateRuntime", shard: LayerShard, hidden_size: int) -> None:
        self.runtime = runtime
        self.shard = shard
        self.hidden_size = hidden_size
        self.cost = runtime.comm_cost_model(shard, hidden_size)
        self.predictor = LoadPredictor(runtime.config.load_window)
        self.schedule = ScheduleReuse(runtime.config.replan_tolerance, runtime.config.load_window)
        self.prediction: Optional[np.ndarray] = None   # the load window's prediction for the next call
        self.counters = CommCounters()
        self.phase_s: Dict[str, float] = {p: 0.0 for p in PHASES}
        self.pending: Optional[PendingGather] = None
        self.forward_cache: List[Tuple[np.ndarray, DispatchPlan]] = []   # counts and plan of each forward call
        self.last_plan: Optional[DispatchPlan] = None
        self.last_counts: Optional[np.ndarray] = None
        self.calls = 0
        self.prefetch_hits = 0
        self.recomputes = 0
        self.pairs_processed = 0
        self.gap_time = Intervals(keep=16)   # device time between the previous MoE layer and this one
        self.device_time = {"compute": Intervals()}   # device time of phases the cost model reads
        self.cross_node_rows = 0
        self.avoidable_cross_node_rows = 0
        self.peak_replica_bytes = 0
        self._live_buffers: List[weakref.ref] = []
        self.top_k = 0  # routes per token, seen at the last call (for the trace header)

    # -- helpers -----------------------------------------------------------------------------------------------
    def timed(self, phase: str) -> PhaseTimer:
        return PhaseTimer(self, phase)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one materialized expert in the compute dtype."""
        return self.shard.kernel.numel * torch.empty((), dtype=self.runtime.compute_dtype).element_size()

    def replica_budget(self) -> int:
        """Replicas this layer may hold per rank within ``materialize_budget_mb``."""
        rt = self.runtime
        return replica_budget(rt.config.materialize_budget_mb, self.expert_bytes, len(rt.bindings),
                              rt.config.rematerialize)

    def owner_placement(self) -> Placement:
        owned = [[] for _ in range(self.runtime.world_size)]
        for e, o in enumerate(self.shard.owners):
            owned[o].append(e)
        return Placement(self.shard.owners, tuple(tuple(x) for x in owned))

    # -- collectives ---------------------------------------------------------------------------------------------
    def gather(self, placement: Placement, async_op: bool) -> PendingGather:
        rt = self.runtime
        pending = rt.comm.start_sparse_all_gather(placement, self.shard.masters, self.shard.kernel.numel,
                                                  rt.compute_dtype, self.counters, async_op=async_op)
        finish = pending.wait

        def tracked():
            flats, buffers = finish()
            self._live_buffers.extend(weakref.ref(t) for t in buffers)
            live = self.replica_bytes_alive()
            self.peak_replica_bytes = max(self.peak_replica_bytes, live)
            rt.note_replica_bytes()
            return flats, buffers
        return PendingGather(placement, tracked)

    def reduce_scatter(self, plan: DispatchPlan, grads: Dict[int, torch.Tensor]) -> None:
        """Issue the layer's SparseReduceScatter asynchronously; the rest of backward runs while it is in flight,
        and :meth:`HecateRuntime.flush_reductions` adds the results to the owners' accumulators."""
        rt = self.runtime
        with self.timed("reduce_scatter"):
            finish = rt.comm.start_sparse_reduce_scatter(plan.placement, grads, self.shard.kernel.numel,
                                                         rt.reduce_dtype, self.counters)
        rt.pending_reductions.append((self, finish))

    def replica_bytes_alive(self) -> int:
        """Bytes of this layer's materialized replicas (experts of other ranks) still alive."""
        total, alive = 0, []
        for ref in self._live_buffers:
            t = ref()
            if t is not None:
                total += t.numel() * t.element_size()
                alive.append(ref)
        self._live_buffers = alive
        return total

    # -- planning -----------------------------------------------------------------------------------------------
    def predicted_placement(self) -> Placement:
        """The 'hecate' placement from the load window (owners only before any observation, and while the window
        keeps mispredicting with calibration on: then calibration plans from the actual counts)."""
        predicted = self.prediction = self.predictor.predict_array()
        rt = self.runtime
        if predicted is None:
            return self.owner_placement()
        if rt.config.calibration and not self.schedule.predictions_reliable:
            self.schedule.reset()   # what is prefetched now is no schedule: calibration must not trust one
            return self.owner_placement()
        materialized = self.schedule.schedule(predicted, self.shard.owners, rt.step_costs(self),
                                              self.replica_budget(), rt.ranks_per_node,
                                              budget_us=rt.config.search_budget_us)
        return Placement(self.shard.owners, materialized)

    def check_saved_schedule(self, state: dict) -> None:
        """Raise if a checkpoint's saved schedule (``ScheduleReuse.state_dict``) cannot belong to this layer."""
        rt = self.runtime
        if not ScheduleReuse.state_fits(state, rt.world_size, self.shard.num_experts):
            raise HecateError(f"MoE layer '{self.shard.name}': the checkpoint's saved schedule does not fit this "
                              f"model ({rt.world_size} ranks, {self.shard.num_experts} experts); the checkpoint's "
                              "meta.json is damaged")

    def restore_schedule(self, state: dict) -> None:
        """Adopt a checkpointed schedule (after owners and measured costs are restored): same reuse decisions."""
        rt = self.runtime
        self.schedule.load_state_dict(state, rt.step_costs(self), self.replica_budget(), rt.ranks_per_node,
                                      budget_us=rt.config.search_budget_us)

    def start_prefetch(self) -> None:
        if self.pending is None and self.runtime.config.placement == "hecate":
            with self.timed("plan"):  # the scheduler's search runs here, after the previous layer
                placement = self.predicted_placement()
                # the dispatch tables of this placement, so the call after the gate only divides counts
                rank_tables(placement, self.runtime.ranks_per_node, self.runtime.rank)
            self.pending = self.gather(placement, async_op=True)

    def _plan(self, counts: np.ndarray) -> Tuple[DispatchPlan, PendingGather, Optional[PendingGather]]:
        """Plan this call; returns (plan, gather of the main placement, gather of calibration extras or None)."""
        rt, owners = self.runtime, self.shard.owners
        if rt.config.placement != "hecate":
            policy = rt.config.placement
            cost = rt.step_costs(self) if policy in STEP_COST_POLICIES else self.cost
            placement = Placement(owners, POLICIES[policy](counts, owners, cost))
            pending, extra = self.gather(placement, async_op=False), None
        else:
            self.prefetch_hits += self.pending is not None
            pending = self.pending or self.gather(self.predicted_placement(), async_op=False)
            self.pending = None
            after = plan_after_gate(counts, pending.placement, self.prediction, self.schedule, rt.step_costs(self),
                                    self.replica_budget(), rt.ranks_per_node, rt.rank, rt.config.calibration,
                                    rt.config.plan_budget_us)
            extra = None if after.extras is None else self.gather(after.extras, async_op=False)
            return after.plan, pending, extra
        return DispatchPlan.build(counts, placement, rt.ranks_per_node), pending, extra

    def _cached_plan(self, counts: np.ndarray) -> DispatchPlan:
        for i, (cached_counts, plan) in enumerate(self.forward_cache):
            if np.array_equal(cached_counts, counts):
                del self.forward_cache[i]
                return plan
        raise HecateError(
            f"MoE layer '{self.shard.name}': activation-checkpoint recompute routed tokens differently from the "
            "forward pass; recompute must reproduce the gate (keep torch.utils.checkpoint's preserve_rng_state=True "
            "and do not change the model between forward and backward)")

    # -- one layer call ---------------------------------------------------------------------------------------
    def run(self, x: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Expert outputs for every (route, token) slot of ``indices`` ([k, S], -1 = dropped); zeros if dropped.

        ``gates`` only feeds the health check: non-finite gate values or expert ids out of range travel with the
        count exchange, so every rank learns of a bad rank at the same collective and all raise together.
        """
        rt, shard = self.runtime, self.shard
        rank, num_experts = rt.rank, shard.num_experts
        recompute = _in_backward_pass()
        rt.note_layer_call(self, recompute)
        if not recompute and rt.last_layer_end is not None:
            self.gap_time.add(rt.last_layer_end, rt.clock.mark())
        num_tokens = x.shape[0]
        self.top_k = indices.shape[0]
        flat = indices.reshape(-1).long()
        valid_slots = torch.nonzero(flat >= 0).squeeze(1)
        experts_of_valid = flat.index_select(0, valid_slots)
        with self.timed("counts"):
            local = torch.bincount(experts_of_valid, minlength=num_experts)
            health = torch.stack([(~torch.isfinite(gates)).any(), (experts_of_valid >= num_experts).any()])
            exchanged = rt.comm.exchange_counts(torch.cat([local[:num_experts], health.to(local.dtype)]))
            counts = exchanged[:, :num_experts]   # [ranks, experts] int64 on the host: the planner's input
            self._check_health(exchanged[:, num_experts:])
        with self.timed("plan"):
            if recompute:
                self.recomputes += 1
                plan = self._cached_plan(counts)
                pending, extra = self.gather(plan.placement, async_op=False), None
            else:
                plan, pending, extra = self._plan(counts)
                self.predictor.push(counts)
                self.forward_cache.append((counts, plan))
                self._record(plan, counts)
        with self.timed("gather"):
            flats = dict(pending.wait()[0])
            if extra is not None:
                flats.update(extra.wait()[0])

        # Send order: by destination, then expert, then slot; the receiver expects (src, expert) segments.
        with self.timed("dispatch"):
            by_expert = valid_slots.index_select(0, torch.argsort(experts_of_valid, stable=True))
            mine_dispatch = plan.for_rank(rank)
            dst_of_sorted = expand_segments(mine_dispatch.send_dst, mine_dispatch.send_rows, x.device)
            send_slots = by_expert.index_select(0, torch.argsort(dst_of_sorted, stable=True))
            send_rows = x.index_select(0, send_slots % max(num_tokens, 1))  # on the graph even when empty
            send_splits, recv_splits = mine_dispatch.send_splits, mine_dispatch.recv_splits
            recv = AllToAllTokens.apply(send_rows, rt.comm, send_splits, recv_splits, self.counters,
                                        f"MoE layer '{self.shard.name}'")

        with self.timed("compute"):
            order_t, sizes = expert_major_order(mine_dispatch, x.device), mine_dispatch.sizes
            if rt.config.rematerialize:
                y_recv = RematerializedExperts.apply(recv, rt.autograd_anchor, self, plan, flats, order_t, sizes)
            else:
                recv, *weights = Materialize.apply(recv, rt.autograd_anchor, self, plan, flats)
                y_recv = run_experts(shard.kernel, recv, weights, order_t, sizes)
            del flats
        with self.timed("combine"):
            y_back = AllToAllTokens.apply(y_recv, rt.comm, recv_splits, send_splits, self.counters,
                                          f"MoE layer '{self.shard.name}'")
            out = y_back.new_zeros(flat.numel(), y_back.shape[-1]).index_copy(0, send_slots, y_back)
        if not recompute and rt.config.prefetch:
            rt.prefetch_after(self)
        rt.last_layer_end = rt.clock.mark()
        return out

    def _check_health(self, flags: List[List[int]]) -> None:
        nonfinite = [r for r, f in enumerate(flags) if f[0]]
        out_of_range = [r for r, f in enumerate(flags) if f[1]]
        if nonfinite or out_of_range:
            problems = []
            if nonfinite:
                problems.append(f"non-finite gate values (NaN/Inf) on rank(s) {nonfinite}")
            if out_of_range:
                problems.append(f"expert indices outside [0, {self.shard.num_experts}) on rank(s) {out_of_range}")
            raise HecateError(f"MoE layer '{self.shard.name}': " + " and ".join(problems) +
                              "; every rank stops here (check the inputs and the learning rate of this layer)")

    def _record(self, plan: DispatchPlan, counts: np.ndarray) -> None:
        self.last_plan, self.last_counts = plan, counts
        self.calls += 1
        self.pairs_processed += plan.tokens_processed(self.runtime.rank)
        crossing, avoidable = plan.node_traffic(self.runtime.ranks_per_node)
        self.cross_node_rows += crossing
        self.avoidable_cross_node_rows += avoidable
        for observe in self.runtime.observers:  # ds_hecate.metrics: step metrics, routing trace
            observe(self, plan, counts)

    # -- statistics ----------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        plan, counts = self.last_plan, self.last_counts
        out = {"name": self.shard.name, "num_experts": self.shard.num_experts, "owners": list(self.shard.owners),
               "owned_experts": self.shard.owned, "forward_calls": self.calls, "prefetch_hits": self.prefetch_hits,
               "recomputes": self.recomputes, "replica_budget": self.replica_budget(),
               "schedule_searches": self.schedule.searches, "schedule_reuses": self.schedule.reuses,
               "peak_replica_bytes": self.peak_replica_bytes, **self.counters.as_dict(),
               "cross_node_tokens": self.cross_node_rows,
               "avoidable_cross_node_tokens": self.avoidable_cross_node_rows,
               "time_s": {k: round(v, 6) for k, v in self.phase_s.items()}}
        if plan is not None and counts is not None:
            from .metrics import force_balanced_estimate   # cost-model estimate, only when stats() asks
            world = self.runtime.world_size
            before = owner_loads(counts, self.shard.owners, world)
            after = plan.loads()
            moved_experts = {e for e, _ in plan.gather_pairs}
            out.update({
                "tokens_per_expert": np.asarray(counts).sum(axis=0).tolist(),
                "compute_per_rank_before": before, "compute_per_rank_after": after,
                "load_imbalance_before": imbalance(before), "load_imbalance_after": imbalance(after),
                "replicas": plan.num_moved, "materialized": [list(m) for m in plan.materialized],
                "lambda": len(moved_experts) / self.shard.num_experts,
                "force_balanced_fraction": force_balanced_estimate(self, plan, counts),
            })
        return out


class HecateRuntime:
    """Everything Hecate holds on one rank: process group, shards, plans, expert optimizer and statistics."""

    def __init__(self, config: HecateConfig, comm: Communicator, compute_dtype: torch.dtype,
                 ranks_per_node: int) -> None:
        self.config = config
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.compute_dtype = compute_dtype
        self.reduce_dtype = torch.float32 if config.reduce_dtype == "fp32" else torch.bfloat16
        self.ranks_per_node = ranks_per_node
        self.device = comm.device   # the rank's working device: every tensor Hecate creates lives there
        self.clock = DeviceClock(self.device)
        self.store = ExpertShardStore(self.device)
        self.autograd_anchor = torch.empty(0, requires_grad=True, device=self.device)
        self.bindings: List[LayerBinding] = []
        self.layer_names: List[str] = []
        self.optimizer: Optional[ExpertOptimizer] = None
        self.layer_group: Dict[int, int] = {}  # layer id -> expert optimizer param group
        self.last_total_norm: Optional[torch.Tensor] = None
        self.steps_applied = 0
        self.steps_skipped = 0
        self.nonfinite_grad_steps = 0
        self.norm_from_optimizer = False  # set by the norm hook when DeepSpeed's optimizer computes the joint norm
        self.last_nonfinite_grads: Optional[dict] = None
        self.reshards = 0
        self.call_order: List[int] = []
        self._order_fixed = False
        self.measured: Dict[str, float] = {}
        self._work_at_profile: Optional[Tuple[int, float]] = None   # expert_work() when costs were last measured
        self.overlaps_compute = torch.cuda.is_available()
        self.last_layer_end: Optional[object] = None   # a DeviceClock mark
        self.peak_replica_bytes = 0
        self.pending_reductions: List[Tuple[LayerBinding, object]] = []
        self.global_steps = 0  # optimizer steps done (engine.global_steps), for the trace's step numbers
        # Called as observe(binding, plan, counts) after each forward call's plan (not recomputes).
        self.observers: List[Callable[[LayerBinding, DispatchPlan, np.ndarray], None]] = []
        from .metrics import install_recorders
        install_recorders(self)

    # -- setup --------------------------------------------------------------------------------------------------
    def add_layer(self, name: str, shard: LayerShard, hidden_size: int) -> LayerBinding:
        self.store.add(shard)
        binding = LayerBinding(self, shard, hidden_size)
        self.bindings.append(binding)
        self.layer_names.append(name)
        return binding

    def comm_cost_model(self, shard: LayerShard, hidden_size: int) -> CommCostModel:
        act = torch.empty((), dtype=self.compute_dtype).element_size()
        grad = torch.empty((), dtype=self.reduce_dtype).element_size()
        return CommCostModel(hidden_size=hidden_size, expert_numel=shard.kernel.numel, activation_bytes=act,
                             param_bytes=act, grad_bytes=grad)

    def step_costs(self, binding: LayerBinding) -> StepCostModel:
        """Cost model for the scheduler: configured values, else measured ones (identical on all ranks)."""
        # One formula for the runtime, ``ds-hecate plan`` and the simulator (ds_hecate.memory_plan).
        return scheduler_costs(self.config, self.measured, self.world_size, self.ranks_per_node,
                               binding.cost.expert_bytes, binding.cost.token_bytes(1), self.overlaps_compute)

    # -- call sequence and prefetch ---------------------------------------------------------------------------
    def note_layer_call(self, binding: LayerBinding, recompute: bool) -> None:
        if recompute or self._order_fixed:
            return
        index = self.bindings.index(binding)
        if index in self.call_order:
            self._order_fixed = True  # a layer called twice: the order of one pass is known
        else:
            self.call_order.append(index)

    def on_model_forward(self) -> None:
        """Start of a model forward (a micro-step): forget stale caches, prefetch the first layer."""
        if _in_backward_pass():
            return
        self.last_layer_end = self.clock.mark()
        for b in self.bindings:
            b.forward_cache.clear()
        if self.call_order:
            self._order_fixed = True
            if self.config.prefetch:
                self.bindings[self.call_order[0]].start_prefetch()

    def prefetch_after(self, binding: LayerBinding) -> None:
        index = self.bindings.index(binding)
        if index in self.call_order:
            pos = self.call_order.index(index)
            if pos + 1 < len(self.call_order):
                self.bindings[self.call_order[pos + 1]].start_prefetch()

    def drop_pending(self) -> None:
        """Complete and discard prefetches (before weights change); every rank holds the same pending set."""
        for b in self.bindings:
            if b.pending is not None:
                b.pending.wait()
                b.pending = None

    def note_replica_bytes(self) -> None:
        live = sum(b.replica_bytes_alive() for b in self.bindings)
        self.peak_replica_bytes = max(self.peak_replica_bytes, live)

    # -- gradient norm and step -------------------------------------------------------------------------------
    def flush_reductions(self) -> None:
        """Wait for every SparseReduceScatter issued in backward (in issue order) and accumulate the results."""
        pending, self.pending_reductions = self.pending_reductions, []
        for binding, finish in pending:
            with binding.timed("reduce_wait"):
                binding.shard.accumulate(finish())

    def expert_grad_norm(self, grad_divisor: float) -> torch.Tensor:
        """L2 norm over all ranks of the (averaged, still loss-scaled) expert gradients. Collective."""
        self.flush_reductions()
        sq = self.store.grad_sq_sum() / (grad_divisor * grad_divisor)
        return self.comm.all_reduce(sq.reshape(1), collective="expert gradient-norm all-reduce").reshape(()).sqrt()

    def apply_step(self, applied: bool, dp_world_size: int, loss_scale: float, clip: float,
                   hyperparameters: Sequence[dict]) -> None:
        """Update expert masters after DeepSpeed's step decided (overflow) and computed the global norm.

        ``loss_scale`` is the factor DeepSpeed unscaled the dense gradients by in this step; ``hyperparameters``
        (scheduled lr/betas per expert group) are the values from before
        DeepSpeed's step, the ones that applied to it.
        """
        self.flush_reductions()
        try:
            self._note_nonfinite_grads()
            if not applied:
                self.steps_skipped += 1
                return
            combined = float(loss_scale)
            if clip > 0 and self.last_total_norm is not None:
                total = float(self.last_total_norm)
                if total == total and total != float("inf"):
                    combined *= max(1.0, (total / loss_scale + 1e-6) / clip)
            if self.optimizer is not None:
                self.optimizer.step(1.0 / (dp_world_size * combined), hyperparameters)
            self.steps_applied += 1
        finally:
            self.store.zero_grads()
            self.last_total_norm = None

    def _note_nonfinite_grads(self) -> None:
        """NaN/Inf in this rank's expert gradients: counted and named in the statistics, and logged. Whether the
        step is applied is DeepSpeed's decision (its overflow check sees them through the global norm, which
        includes the experts). Skipped when this step's joint norm is known and finite; otherwise one host sync
        for all experts."""
        total = self.last_total_norm
        if total is not None and 0 <= float(total) < float("inf"):
            return
        names, checks = [], []
        for binding in self.bindings:
            for e, param in binding.shard.masters.items():
                if param.grad is not None:
                    names.append(f"{binding.shard.name} expert {e}")
                    checks.append(torch.isfinite(param.grad).all())
        if not checks:
            return
        bad = [name for name, ok in zip(names, torch.stack(checks).tolist()) if not ok]
        if bad:
            self.nonfinite_grad_steps += 1
            self.last_nonfinite_grads = {"step": self.steps_applied + self.steps_skipped + 1, "experts": bad}
            logger.warning(f"rank {self.rank}: non-finite (NaN/Inf) gradients in {len(bad)} expert(s) "
                           f"at optimizer step {self.last_nonfinite_grads['step']}: {', '.join(bad[:8])}"
                           f"{' ...' if len(bad) > 8 else ''}")

    def after_step(self, global_steps: int) -> None:
        """Step-boundary work, identical on every rank: cost profiling once, periodic re-sharding."""
        self.global_steps = global_steps
        self.drop_pending()
        if global_steps == 1 and not self.measured:
            self.measure_costs()
        elif (global_steps == WARM_PROFILE_STEP and self._work_at_profile is not None
              and self.measured.get("profiled_at_step", 0.0) < WARM_PROFILE_STEP):
            self.measure_costs(since=self._work_at_profile)   # steady-state figures replace the cold first step's
        interval = self.config.reshard_interval
        if interval and global_steps % interval == 0 and self.config.placement == "hecate":
            from .resharding import reshard
            if reshard(self):
                self.reshards += 1

    def measure_costs(self, since: Optional[Tuple[int, float]] = None) -> None:
        """Profile link bandwidth, expert compute per pair and T_nonMoE; agree on rank 0's numbers."""
        self.measured = measure_costs(self, since)
        self._work_at_profile = expert_work(self)

    # -- consolidation ------------------------------------------------------------------------------------------
    def full_expert_weights(self) -> Dict[str, torch.Tensor]:
        """Every expert of every layer as fp32 ``[num_experts, numel]`` on every rank. Collective.

        A SparseAllGather to the placement 'every rank has every expert'; for export, checks and tests, not for
        training (it materializes everything). Not counted as training traffic.
        """
        out = {}
        for name, binding in zip(self.layer_names, self.bindings):
            shard = binding.shard
            everything = tuple(range(shard.num_experts))
            placement = Placement(shard.owners, (everything,) * self.world_size)
            flats, _ = self.comm.start_sparse_all_gather(placement, shard.masters, shard.kernel.numel,
                                                         torch.float32, CommCounters(), async_op=False).wait()
            out[name] = torch.stack([flats[e].clone() for e in everything])
        return out

    # -- introspection ----------------------------------------------------------------------------------------
    def materialized_bytes(self) -> int:
        return sum(b.replica_bytes_alive() for b in self.bindings)

    def memory_bytes(self) -> Dict[str, int]:
        return {"expert_master": self.store.master_bytes(),
                "expert_optimizer_state": self.optimizer.state_bytes() if self.optimizer else 0,
                "expert_grad": self.store.grad_bytes(),
                "materialized": self.materialized_bytes(),
                "peak_materialized": self.peak_replica_bytes,
                "materialize_budget": int(self.config.materialize_budget_mb * (1 << 20))}

    def stats(self) -> dict:
        """JSON-serialisable statistics; see docs/stats.md."""
        total = CommCounters()
        for b in self.bindings:
            total.add(b.counters)
        return {"world_size": self.world_size, "ranks_per_node": self.ranks_per_node,
                "nodes": self.world_size // self.ranks_per_node, "placement": self.config.placement,
                "layers": [b.stats() for b in self.bindings], "comm": total.as_dict(),
                "memory": self.memory_bytes(), "steps_applied": self.steps_applied,
                "steps_skipped": self.steps_skipped, "reshards": self.reshards,
                "nonfinite_grad_steps": self.nonfinite_grad_steps, "last_nonfinite_grads": self.last_nonfinite_grads,
                "measured_costs": dict(self.measured)}

    def summary(self) -> str:
        experts = sum(s.num_experts for s in self.store.layers)
        params = sum(s.num_experts * s.kernel.numel for s in self.store.layers)
        nodes = self.world_size // self.ranks_per_node
        return (f"Hecate took over {len(self.bindings)} MoE layer(s) with {experts} experts "
                f"({params:,} expert parameters) on {self.world_size} rank(s) in {nodes} node(s); "
                f"placement={self.config.placement}, compute dtype={str(self.compute_dtype).replace('torch.', '')}")

    def __str__(self) -> str:
        return self.summary()
