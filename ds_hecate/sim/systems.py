"""The simulated systems, each a stateful per-layer placement rule: expert parallelism and its load-balancing
variants (FasterMoE, SmartMoE, FlexMoE), Hecate (the runtime's own :class:`LayerPlanner`) and the ideal bound.

Every system but the ideal runs in the same groups of ``G = ctx.ep_size`` consecutive ranks: the expert-parallel
groups of DeepSpeed's ``ep_size`` for the EP family, the Hecate domains (``hecate.ep_size``) for Hecate, each with
one planner per group on the group's ``[G, E]`` counts, as the runtime plans. A layer call waits for its slowest
group; the expert gradients of the ``world / G`` groups are reduced over the expert-data-parallel peers once per
optimizer step (``edp_reduce_s`` per layer, exposed, see :func:`~.machine.edp_reduction_time`)."""
from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import replace
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import HecateError
from ..planning.dispatch_plan import rank_tables
from ..planning.layer_planner import LayerPlanner, PlanInputs, PlannerSettings
from ..planning.placement import POLICIES
from ..planning.plan import Placement
from ..planning.predictor import LoadPredictor
from ..planning.replica_pool import LayerGrant, ReplicaPool
from ..planning.sharding import even_sharding
from .context import SimContext
from .machine import LayerTime, edp_reduction_time, layer_time, migration_time, owner_matrix, placement_matrix

SYSTEMS = ("ep", "fastermoe", "smartmoe", "flexmoe", "hecate", "hecate-rm", "ideal")


class _Window:
    """The runtime's :class:`LoadPredictor`, with its prediction memoised on the window's contents (identified by
    digests of the pushed count matrices): a deterministic function called again on the same window returns the
    same matrix, so stationary routing costs one prediction, not one per step."""

    def __init__(self, window: int) -> None:
        self.predictor = LoadPredictor(window)
        self.keys: Deque[bytes] = deque(maxlen=window)
        self.memo: Dict[Tuple[bytes, ...], Optional[np.ndarray]] = {}

    def push(self, counts: np.ndarray) -> None:
        self.predictor.push(counts.tolist())
        self.keys.append(hashlib.blake2b(counts.tobytes(), digest_size=16).digest())

    @property
    def key(self) -> Tuple[bytes, ...]:
        return tuple(self.keys)

    def predict(self) -> Optional[np.ndarray]:
        if self.key not in self.memo:
            self.memo[self.key] = self.predictor.predict_array()
        return self.memo[self.key]

    def expert_loads(self) -> Optional[List[float]]:
        predicted = self.predict()
        return None if predicted is None else predicted.sum(axis=0).tolist()


class _System:
    """One system on one layer (or on a class of layers with identical routing)."""

    mode = "prefetch"
    edp_reduce_s = 0.0                  # per optimizer step: this layer's expert-gradient reduction over EDP peers

    def __init__(self, ctx: SimContext) -> None:
        self.ctx = ctx
        self.cache: Dict[Any, Any] = {}

    def step(self, step: int, counts: np.ndarray) -> Tuple[LayerTime, float]:
        """(layer time, rearrangement seconds this step) for this step's counts."""
        raise NotImplementedError


def _group_slices(ctx: SimContext) -> List[slice]:
    """The ranks of each group, ``[g*G, (g+1)*G)``."""
    return [slice(ranks[0], ranks[-1] + 1) for ranks in ctx.groups.all_groups()]


def _worst(times: Sequence[LayerTime], extra: Sequence[float], replicas: np.ndarray) -> Tuple[LayerTime, int]:
    """The slowest group's layer time (its own ``extra`` seconds included in the choice), with every group's
    replicas, and its index. Its ranks' ``processed`` pairs stay: the call overhead (core.call_overhead_s) is charged
    on them."""
    i = max(range(len(times)), key=lambda k: (times[k].total + extra[k], -k))
    return replace(times[i], replicas=replicas), i


class _EPFamily(_System):
    """DeepSpeed's expert parallelism in groups of ``ep`` ranks with expert data parallelism across them (its expert
    gradients in the compute dtype, DeepSpeed's default communication dtype, reduced over the EDP group at the
    accumulation boundary); subclasses choose owners and replicas per group."""

    mode = "critical"
    uses_loads = False

    def __init__(self, ctx: SimContext) -> None:
        super().__init__(ctx)
        self.groups = _group_slices(ctx)
        ep = ctx.ep_size
        self.owners = [np.asarray(even_sharding(ctx.model.num_experts, ep)) for _ in self.groups]
        self.predictors = [_Window(ctx.hecate.load_window) for _ in self.groups]
        owned_bytes = ctx.owned_per_rank * ctx.numel * ctx.compute_b
        self.edp_reduce_s = edp_reduction_time(ctx, owned_bytes, owned_bytes)

    def group_placement(self, g: int, step: int, counts: np.ndarray) -> Tuple[np.ndarray, float]:
        return owner_matrix(self.owners[g], counts.shape[0]), 0.0

    def step(self, step: int, counts: np.ndarray) -> Tuple[LayerTime, float]:
        rearrange = 0.0
        times: List[LayerTime] = []
        for g, sl in enumerate(self.groups):
            sub = counts[sl]
            mat, moved = self.group_placement(g, step, sub)
            rearrange = max(rearrange, moved)
            key = (sub.tobytes(), mat.tobytes(), self.owners[g].tobytes())
            if key not in self.cache:
                self.cache[key] = layer_time(self.ctx, sub, mat, self.owners[g], self.mode)
            times.append(self.cache[key])
            if self.uses_loads:
                self.predictors[g].push(sub)
        worst, _ = _worst(times, [0.0] * len(times), np.concatenate([t.replicas for t in times]))
        return worst, rearrange


class _EP(_EPFamily):
    """Plain expert parallelism: the planner's ``owner`` policy."""

    def group_placement(self, g, step, counts):
        owners = tuple(int(o) for o in self.owners[g])
        return placement_matrix(POLICIES["owner"](counts.tolist(), owners, None), len(owners)), 0.0


class _FasterMoE(_EPFamily):
    """FasterMoE shadowing: the planner's ``shadow`` policy (hottest experts broadcast to every rank after the
    gate, as many as its latency model accepts), judged with the scheduler's cost model for this cluster. The
    shadows travel as ring broadcasts (and their gradients as ring reductions) on the critical path."""

    mode = "broadcast"

    def group_placement(self, g, step, counts):
        key = (tuple(self.owners[g]), counts.tobytes())
        if key not in self.cache:
            owners = tuple(int(o) for o in self.owners[g])
            costs = self.ctx.step_costs(counts.shape[0])
            self.cache[key] = placement_matrix(POLICIES["shadow"](counts.tolist(), owners, costs), len(owners))
        return self.cache[key], 0.0


def _lpt_owners(loads: Sequence[float], world: int) -> np.ndarray:
    """SmartMoE-style swap placement: experts by load, descending, each to the least-loaded rank with a free slot
    (every rank keeps its number of experts)."""
    slots = [len(o) for o in np.array_split(np.arange(len(loads)), world)]
    rank_load = [0.0] * world
    owners = np.zeros(len(loads), dtype=np.int64)
    for e in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        r = min((r for r in range(world) if slots[r] > 0), key=lambda r: (rank_load[r], r))
        owners[e] = r
        rank_load[r] += loads[e]
        slots[r] -= 1
    return owners


class _SmartMoE(_EPFamily):
    """SmartMoE-style rearrangement: every ``interval`` steps, experts are re-placed (swapped, no replicas) by the
    window-average loads; the move of weights and optimizer state is on the critical path."""

    mode = "critical"
    interval = 25
    uses_loads = True

    def group_placement(self, g, step, counts):
        moved = 0.0
        loads = self.predictors[g].expert_loads() if step > 0 and step % self.interval == 0 else None
        if loads is not None:
            new = _lpt_owners(loads, counts.shape[0])
            moves = [(int(o), int(n)) for o, n in zip(self.owners[g], new) if o != n]
            moved = migration_time(self.ctx, counts.shape[0], moves)
            self.owners[g] = new
        return owner_matrix(self.owners[g], counts.shape[0]), moved


class _FlexMoE(_EPFamily):
    """FlexMoE-style replication: every ``interval`` steps, reserved slots (``slots`` per rank, full optimizer
    state each) are filled with replicas of the experts with the highest load per copy, each on the least-loaded
    rank with a free slot; replicas persist and all-reduce their gradients every step."""

    mode = "persistent"
    interval = 10
    uses_loads = True

    def __init__(self, ctx: SimContext) -> None:
        super().__init__(ctx)
        self.slots = max(1, ctx.model.num_experts // ctx.ep_size)
        self.mats = [owner_matrix(o, ctx.ep_size) for o in self.owners]

    def group_placement(self, g, step, counts):
        loads = self.predictors[g].expert_loads() if step > 0 and step % self.interval == 0 else None
        moved = 0.0
        if loads is not None:
            world, num_experts = counts.shape
            owners = self.owners[g]
            mat = owner_matrix(owners, world)
            copies = np.ones(num_experts)
            rank_load = np.zeros(world)
            for e in range(num_experts):
                rank_load[owners[e]] += loads[e]
            free = np.full(world, self.slots)
            while True:
                order = sorted(range(num_experts), key=lambda e: (-loads[e] / copies[e], e))
                e = order[0]
                if loads[e] <= 0:
                    break
                cands = [r for r in range(world) if free[r] > 0 and not mat[r, e]]
                if not cands:
                    break
                r = min(cands, key=lambda r: (rank_load[r], r))
                holders = np.flatnonzero(mat[:, e])
                rank_load[holders] -= loads[e] / copies[e]
                copies[e] += 1
                mat[r, e] = True
                free[r] -= 1
                rank_load[np.flatnonzero(mat[:, e])] += loads[e] / copies[e]
            new = mat & ~self.mats[g]
            moves = [(int(owners[e]), int(r)) for r, e in zip(*np.nonzero(new))]
            moved = migration_time(self.ctx, world, moves)
            self.mats[g] = mat
        return self.mats[g], moved


def replica_pool(ctx: SimContext, system: str) -> ReplicaPool:
    """The replica pool a Hecate system's layers share, as the runtime plans it
    (:mod:`ds_hecate.planning.replica_pool`): ``hecate-rm`` re-materializes every layer; ``hecate`` follows the config's ``rematerialize`` (null: per layer,
    where the resident share is too small to help)."""
    layers = ctx.model.moe_layers
    setting = True if system == "hecate-rm" else ctx.hecate.rematerialize
    return ReplicaPool.plan(ctx.hecate.materialize_budget_mb, [ctx.numel * ctx.compute_b] * layers,
                            [ctx.owned_per_rank] * layers, setting)


class _GroupPlanner:
    """Hecate in one group (or one class of groups routed identically at every step): the runtime's own
    :class:`LayerPlanner` on a world of the group's ``G`` ranks, with the runtime's budget and cost formulas."""

    def __init__(self, ctx: SimContext, grant: LayerGrant) -> None:
        ep_size, h = ctx.ep_size, ctx.hecate
        self.ctx = ctx
        self.mode = "rm" if grant.rematerialize else "prefetch"
        self.owners = np.asarray(even_sharding(ctx.model.num_experts, ep_size))
        self.rpn = min(ctx.rpn, ep_size)
        settings = PlannerSettings(policy="hecate", calibration=h.calibration, replan_tolerance=h.replan_tolerance,
                                   load_window=h.load_window, load_predictor=h.load_predictor,
                                   search_budget_us=h.search_budget_us,
                                   plan_budget_us=h.plan_budget_us, ranks_per_node=self.rpn,
                                   search_slice_us=h.search_slice_us)
        self.planner = LayerPlanner(settings, ep_size, ctx.model.num_experts)
        self.budget = grant.replicas
        self.inputs = PlanInputs(tuple(int(o) for o in self.owners), ctx.hecate_step_costs(ep_size, grant.rematerialize),
                                 self.budget)
        self.timings: Dict[Any, LayerTime] = {}
        self.placements: Dict[Any, Placement] = {}
        self.last_prefetched: Optional[Placement] = None   # the last call's prefetched placement and executed plan
        self.last_plan: Any = None

    def starved(self) -> bool:
        """More ranks than experts in the group, and a budget below the layout that gives each rank work."""
        return self.planner.world > self.planner.num_experts and self.planner.start_layout(self.inputs) is None

    def step(self, counts: np.ndarray) -> Tuple[LayerTime, float]:
        """(layer time of this group, host planning seconds charged to its step)."""
        started = time.thread_time()   # CPU time of this thread: not what other processes on the machine take
        placement = self.planner.prefetch_placement(self.inputs)
        search_s = time.thread_time() - started
        # as the runtime: one Placement object per schedule, its dispatch tables built with the prefetch
        prefetched = self.last_prefetched = self.placements.setdefault(placement.materialized, placement)
        rank_tables(prefetched, self.rpn, 0)
        mat = prefetched.holders
        started = time.thread_time()
        after = self.planner.plan_call(counts.astype(np.int64), self.inputs, prefetched, 0)
        critical_s = time.thread_time() - started
        self.planner.observe(counts)
        self.last_plan = after.plan
        late = None
        if after.extras is not None:   # calibration's replicas are gathered after the gate
            cal = after.plan.placement.holders
            late, mat = cal & ~mat, cal
        if self.ctx.planning_clock == "work":   # what the planner did, in its work models' microseconds
            critical_s, search_s = after.work_us * 1e-6, self.planner.last_search_us * 1e-6
        # host planning on the critical path, and the search where the preceding non-MoE compute does not hide it
        planning = (critical_s + max(0.0, search_s - self.ctx.t_fwd)) if self.ctx.charge_planning else 0.0
        timing_key = (mat.tobytes(), counts.tobytes(), None if late is None else late.tobytes())
        if timing_key not in self.timings:
            self.timings[timing_key] = layer_time(self.ctx, counts, mat, self.owners, self.mode, late)
        return self.timings[timing_key], planning


class HecateSystem(_System):
    """ds_hecate: one :class:`_GroupPlanner` per class of identically routed groups. Per step each group's planner
    predicts and places before the gate (the SparseAllGather is prefetched), then plans the step's real counts after
    it; this class only times it. The owners' expert gradients (fp32 accumulators, sent in ``reduce_dtype``) and the
    updated weights travel over the expert-data-parallel peers at the accumulation boundary."""

    def __init__(self, ctx: SimContext, grant: Optional[LayerGrant] = None,
                 group_classes: Optional[Sequence[Sequence[int]]] = None) -> None:
        super().__init__(ctx)
        grant = grant or replica_pool(ctx, "hecate").grants[0]
        self.grant = grant
        self.groups = _group_slices(ctx)
        self.classes = [list(c) for c in (group_classes or [range(len(self.groups))])]
        self.planners = [_GroupPlanner(ctx, grant) for _ in self.classes]
        owned = ctx.owned_per_rank * ctx.numel
        self.edp_reduce_s = edp_reduction_time(ctx, owned * ctx.edp_grad_b, owned * ctx.compute_b)
        self.note = ""
        if self.planners[0].starved():
            # the budget is a hard cap in the runtime: no layout beyond it
            self.note = (f"{'hecate-rm' if grant.rematerialize else 'hecate'}: the replica budget "
                         f"({self.planners[0].budget} per layer per rank) is below what the expert-data-parallel "
                         f"layout needs with {ctx.ep_size} ranks and {ctx.model.num_experts} experts; raise "
                         "--materialize-budget-mb")
        self.planning_s = 0.0             # host planning charged to the last step (measured here)

    # the first group's planner, as one group's runtime sees it (tests/test_planner_identity.py compares them)
    @property
    def inputs(self) -> PlanInputs:
        return self.planners[0].inputs

    @property
    def last_plan(self) -> Any:
        return self.planners[0].last_plan

    @property
    def last_prefetched(self) -> Optional[Placement]:
        return self.planners[0].last_prefetched

    def step(self, step, counts):
        times, planning = [], []
        replicas = np.zeros(self.ctx.world)
        for members, planner in zip(self.classes, self.planners):
            lt, seconds = planner.step(counts[self.groups[members[0]]])
            times.append(lt)
            planning.append(seconds)
            for g in members:
                replicas[self.groups[g]] = lt.replicas
        worst, i = _worst(times, planning, replicas)
        self.planning_s = planning[i]
        return worst, 0.0


class _Ideal(_System):
    def step(self, step, counts):
        compute = float(counts.sum()) * self.ctx.s_per_pair / self.ctx.world
        return LayerTime(compute, compute, 0.0, 0.0, 1.0, np.zeros(self.ctx.world)), 0.0


def make_system(system: str, ctx: SimContext, group_classes: Optional[Sequence[Sequence[int]]] = None,
                grant: Optional[LayerGrant] = None) -> _System:
    """The simulated ``system`` for one layer class. ``group_classes``: groups whose counts are equal at every step
    (each planned once: the planner is deterministic); default every group planned alone. ``grant``: the class's
    slots in the replica pool (Hecate systems; default the pool's first layer's)."""
    if system == "ep":
        return _EP(ctx)
    if system == "fastermoe":
        return _FasterMoE(ctx)
    if system == "smartmoe":
        return _SmartMoE(ctx)
    if system == "flexmoe":
        return _FlexMoE(ctx)
    if system in ("hecate", "hecate-rm"):
        return HecateSystem(ctx, grant or replica_pool(ctx, system).grants[0], group_classes=group_classes)
    if system == "ideal":
        return _Ideal(ctx)
    raise HecateError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
