"""The simulated systems, each a stateful per-layer placement rule: expert parallelism and its load-balancing
variants (FasterMoE, SmartMoE, FlexMoE), Hecate (the runtime's own :class:`LayerPlanner`) and the ideal bound."""
from __future__ import annotations

import hashlib
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import HecateError
from ..planning.cost_model import replica_budget
from ..planning.dispatch_plan import rank_tables
from ..planning.layer_planner import LayerPlanner, PlanInputs, PlannerSettings
from ..planning.placement import POLICIES
from ..planning.plan import Placement
from ..planning.predictor import LoadPredictor
from ..planning.sharding import even_sharding
from .context import SimContext
from .machine import LayerTime, layer_time, migration_time, owner_matrix, placement_matrix

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

    def __init__(self, ctx: SimContext) -> None:
        self.ctx = ctx
        self.cache: Dict[Any, Any] = {}

    def step(self, step: int, counts: np.ndarray) -> Tuple[LayerTime, float]:
        """(layer time, rearrangement seconds this step) for this step's counts."""
        raise NotImplementedError


def _groups(ctx: SimContext) -> List[slice]:
    """Expert-parallel groups: ``ep = min(world, experts)`` consecutive ranks each (data parallel across them)."""
    ep = ctx.ep_size
    if ctx.world % ep:
        raise HecateError(f"simulate: world size {ctx.world} is not a multiple of the expert-parallel size {ep} "
                          f"(= min(world size, {ctx.model.num_experts} experts))")
    if ep < ctx.world and ep % min(ctx.rpn, ep):
        raise HecateError(f"simulate: expert-parallel groups of {ep} ranks do not align with nodes of {ctx.rpn}")
    return [slice(g * ep, (g + 1) * ep) for g in range(ctx.world // ep)]


class _EPFamily(_System):
    """Expert parallelism in groups of ``ep`` ranks; subclasses choose owners and replicas per group."""

    mode = "critical"
    uses_loads = False

    def __init__(self, ctx: SimContext) -> None:
        super().__init__(ctx)
        self.groups = _groups(ctx)
        ep = ctx.ep_size
        self.owners = [np.asarray(even_sharding(ctx.model.num_experts, ep)) for _ in self.groups]
        self.predictors = [_Window(ctx.hecate.load_window) for _ in self.groups]

    def group_placement(self, g: int, step: int, counts: np.ndarray) -> Tuple[np.ndarray, float]:
        return owner_matrix(self.owners[g], counts.shape[0]), 0.0

    def dp_allreduce_s(self) -> float:
        """Expert gradients all-reduced across the data-parallel copies of each EP group (world > experts)."""
        ctx = self.ctx
        dp = ctx.world // ctx.ep_size
        if dp == 1:
            return 0.0
        owned = ctx.model.num_experts / ctx.ep_size
        per_rank = 2 * (dp - 1) / dp * owned * ctx.numel * ctx.grad_b
        seconds = per_rank * min(ctx.rpn, ctx.world) / (ctx.cluster.inter_node_gbps * 1e9)
        hidden = 2 * ctx.t_fwd if ctx.cluster.overlaps_compute else 0.0
        return max(0.0, seconds - hidden)

    def step(self, step: int, counts: np.ndarray) -> Tuple[LayerTime, float]:
        worst: Optional[LayerTime] = None
        rearrange = 0.0
        replicas = []
        for g, sl in enumerate(self.groups):
            sub = counts[sl]
            mat, moved = self.group_placement(g, step, sub)
            rearrange = max(rearrange, moved)
            key = (sub.tobytes(), mat.tobytes(), self.owners[g].tobytes())
            if key not in self.cache:
                self.cache[key] = layer_time(self.ctx, sub, mat, self.owners[g], self.mode)
            lt = self.cache[key]
            replicas.append(lt.replicas)
            if worst is None or lt.total > worst.total:
                worst = lt
            if self.uses_loads:
                self.predictors[g].push(sub)
        assert worst is not None
        extra = self.dp_allreduce_s()
        worst = LayerTime(worst.total + extra, worst.compute, worst.a2a, worst.exposed + extra, worst.imbalance,
                           np.concatenate(replicas))
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


class HecateSystem(_System):
    """ds_hecate: the runtime's own planner (:class:`~ds_hecate.planning.layer_planner.LayerPlanner`) on the whole
    world, with the runtime's budget and cost formulas. Per step the planner predicts and places before the gate
    (the SparseAllGather is prefetched), then plans the step's real counts after it; this class only times it."""

    def __init__(self, ctx: SimContext, rematerialize: bool) -> None:
        super().__init__(ctx)
        self.mode = "rm" if rematerialize else "prefetch"
        self.owners = np.asarray(even_sharding(ctx.model.num_experts, ctx.world))
        h = ctx.hecate
        settings = PlannerSettings(policy="hecate", calibration=h.calibration, replan_tolerance=h.replan_tolerance,
                                   load_window=h.load_window, search_budget_us=h.search_budget_us,
                                   plan_budget_us=h.plan_budget_us, ranks_per_node=ctx.rpn)
        self.planner = LayerPlanner(settings, ctx.world, ctx.model.num_experts)
        budget = replica_budget(h.materialize_budget_mb, ctx.numel * ctx.compute_b, ctx.model.moe_layers,
                                rematerialize)
        self.inputs = PlanInputs(tuple(int(o) for o in self.owners), ctx.step_costs(ctx.world), budget)
        self.timings: Dict[Any, LayerTime] = {}
        self.note = ""
        if ctx.world > ctx.model.num_experts and self.planner.start_layout(self.inputs) is None:
            # the budget is a hard cap in the runtime: no layout beyond it
            self.note = (f"{'hecate-rm' if rematerialize else 'hecate'}: the replica budget ({budget} per layer per "
                         f"rank) is below what the expert-data-parallel layout needs with {ctx.world} ranks and "
                         f"{ctx.model.num_experts} experts; raise --materialize-budget-mb")
        self.charge_planning = ctx.charge_planning
        self.planning_s = 0.0             # host planning charged to the last step (measured here)
        self.placements: Dict[Any, Placement] = {}

    def step(self, step, counts):
        started = time.perf_counter()
        placement = self.planner.prefetch_placement(self.inputs)
        search_s = time.perf_counter() - started
        # as the runtime: one Placement object per schedule, its dispatch tables built with the prefetch
        prefetched = self.last_prefetched = self.placements.setdefault(placement.materialized, placement)
        rank_tables(prefetched, self.ctx.rpn, 0)
        mat = prefetched.holders
        started = time.perf_counter()
        after = self.planner.plan_call(counts.astype(np.int64), self.inputs, prefetched, 0)
        critical_s = time.perf_counter() - started
        self.planner.observe(counts)
        late = None
        if after.extras is not None:   # calibration's replicas are gathered after the gate
            cal = after.plan.placement.holders
            late, mat = cal & ~mat, cal
        # host planning on the critical path, and the search where the preceding non-MoE compute does not hide it
        self.planning_s = (critical_s + max(0.0, search_s - self.ctx.t_fwd)) if self.charge_planning else 0.0
        self.last_plan = after.plan
        timing_key = (mat.tobytes(), counts.tobytes(), None if late is None else late.tobytes())
        if timing_key not in self.timings:
            self.timings[timing_key] = layer_time(self.ctx, counts, mat, self.owners, self.mode, late)
        return self.timings[timing_key], 0.0


class _Ideal(_System):
    def step(self, step, counts):
        compute = float(counts.sum()) * self.ctx.s_per_pair / self.ctx.world
        return LayerTime(compute, compute, 0.0, 0.0, 1.0, np.zeros(self.ctx.world)), 0.0


def make_system(system: str, ctx: SimContext) -> _System:
    if system == "ep":
        return _EP(ctx)
    if system == "fastermoe":
        return _FasterMoE(ctx)
    if system == "smartmoe":
        return _SmartMoE(ctx)
    if system == "flexmoe":
        return _FlexMoE(ctx)
    if system in ("hecate", "hecate-rm"):
        return HecateSystem(ctx, rematerialize=system == "hecate-rm")
    if system == "ideal":
        return _Ideal(ctx)
    raise HecateError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
