"""The simulator: per step and MoE layer, each system's placement (from the real planner or the baseline's own
rule), the planner's dispatch of the step's token counts, and a link/compute time model.

Time of one MoE layer (forward + backward), with ``x_r`` per rank and ``max`` over ranks because every all-to-all
is a collective:

    max exposed gather (forward)  +  4 x max all-to-all pass  +  max expert compute  +  max exposed reduce (backward)

- expert compute: pairs processed x ``compute_s_per_pair`` (6 x expert params / device FLOP/s, or measured);
- an all-to-all pass: the larger of the rank's intra-node bytes over its NVLink share and its node's inter-node
  bytes over the node's NICs, plus one latency; four passes (dispatch and combine, forward and backward);
- expert collectives (SparseAllGather / broadcasts of replicas, gradient reduction), same link model, hidden behind
  the non-MoE compute of the block where the system overlaps them (forward: T_nonMoE; backward: 2 x T_nonMoE) and
  the cluster overlaps communication with compute.

A step adds the non-MoE compute of every block (3 x T_nonMoE forward), dense blocks, embeddings and the fixed
per-step time of the cluster, and the rearrangement (migration) time of SmartMoE/FlexMoE on the steps they move
experts. Activations and dense-gradient all-reduce are left out (identical for every system).
"""
from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..config import HecateConfig
from ..errors import HecateError
from ..memory_plan import OptimizerStateLayout, dense_state_bytes, replica_budget, scheduler_costs
from ..planning.balance import force_uniform_steps
from ..planning.placement import POLICIES
from ..planning.predictor import LoadPredictor
from ..planning.critical_path import plan_after_gate
from ..planning.dispatch_plan import rank_tables
from ..planning.plan import Placement, holders_matrix
from ..planning.schedule_reuse import ScheduleReuse
from ..planning.scheduler import StepCostModel, dispatch_flows
from ..planning.sharding import even_sharding
from ..presets import Cluster, ModelShape, resolve_cluster, resolve_model
from ..routing_workloads import WORKLOADS, routing_counts
from ..trace import read_trace

SYSTEMS = ("ep", "fastermoe", "smartmoe", "flexmoe", "hecate", "hecate-rm", "ideal")
ADAM = OptimizerStateLayout("AdamW", (4, 4), 4)   # torch AdamW on fp32 masters: exp_avg, exp_avg_sq, 0-d step


@dataclass
class SystemResult:
    system: str
    step_times_s: List[float]
    step_time_s: float                  # mean over the measured steps (after warm-up)
    peak_memory_bytes: int              # model states + replicas/reserved slots of the largest rank
    imbalance: float                    # mean over layers/steps of max/mean expert compute per rank
    replicas_per_layer: float           # mean (expert, rank) replicas beyond the sharded placement
    breakdown_s: Dict[str, float]       # per step: compute, all_to_all, exposed_comm, non_moe, rearrange
    speedup_vs_ep: float = float("nan")
    fraction_of_ideal: float = float("nan")
    force_balanced_step_s: float = float("nan")     # the same system on the routing forced uniform
    force_balanced_fraction: float = float("nan")   # force_balanced_step_s / step_time_s (UltraEP's metric)


@dataclass
class SimResult:
    cluster: Cluster
    model: ModelShape
    workload: str
    world_size: int
    steps: int
    warmup: int
    systems: Dict[str, SystemResult]
    wall_s: float
    notes: List[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------
# setting
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Ctx:
    cluster: Cluster
    model: ModelShape
    world: int
    rpn: int
    tokens: int
    compute_b: int
    grad_b: int
    s_per_pair: float
    t_fwd: float                        # non-MoE forward time per block (T_nonMoE)
    hecate: HecateConfig
    optimizer: OptimizerStateLayout
    zero_stage: int
    precision: str
    spag: str = "p2p"                   # how Hecate's sparse collectives travel: "p2p" (as collectives.py) or "ring"
    planner_costs: Optional[Dict[str, float]] = None   # what the planners see, when not the time model's costs
    charge_planning: bool = True        # add Hecate's measured host planning time (critical path, exposed search)

    @property
    def numel(self) -> int:
        return self.model.expert_params

    @property
    def row_bytes(self) -> int:
        return self.model.hidden_size * self.compute_b

    @property
    def ep_size(self) -> int:
        return min(self.world, self.model.num_experts)

    @property
    def state_bytes_per_param(self) -> int:
        """fp32 master + fp32 grad + optimizer state: what an owned expert costs (and what migration moves)."""
        return 4 + 4 + self.optimizer.bytes_per_param

    def measured(self, world: int) -> Dict[str, float]:
        if self.planner_costs is not None:
            return dict(self.planner_costs)
        link = self.cluster.inter_node_gbps_per_device if world > self.rpn else self.cluster.intra_node_gbps
        return {"link_gbps": link, "compute_s_per_pair": self.s_per_pair, "non_moe_time_s": self.t_fwd}

    def step_costs(self, world: int) -> StepCostModel:
        """The cost model the runtime would build on this cluster (the runtime's own formula)."""
        return scheduler_costs(self.hecate, self.measured(world), world, self.rpn,
                               expert_bytes=self.numel * (self.compute_b + self.grad_b),
                               token_bytes=4 * self.row_bytes, overlaps_compute=self.cluster.overlaps_compute)


def _links(ctx: _Ctx, world: int, intra_in, intra_out, node_in, node_out, nbytes: float):
    """Per-rank time of one communication phase moving the given per-rank units of ``nbytes``."""
    rpn = ctx.rpn
    node_idx = np.arange(world) // rpn
    c = ctx.cluster
    t_intra = np.maximum(intra_in, intra_out) * nbytes / (c.intra_node_gbps * 1e9)
    t_inter = (np.maximum(node_in, node_out) * nbytes / (c.inter_node_gbps * 1e9))[node_idx]
    busy = (np.maximum(intra_in, intra_out) + np.maximum(node_in, node_out)[node_idx]) > 0
    latency = c.inter_latency_s if world > rpn else c.intra_latency_s
    return np.maximum(t_intra, t_inter) + np.where(busy, latency, 0.0)


def _node_sum(values, world: int, rpn: int):
    return np.add.reduceat(values, np.arange(0, world, rpn))


@dataclass
class _LayerTime:
    total: float
    compute: float
    a2a: float
    exposed: float
    imbalance: float
    replicas: np.ndarray                # per rank


def layer_time(ctx: _Ctx, counts: np.ndarray, mat: np.ndarray, owners: np.ndarray, mode: str,
               late: Optional[np.ndarray] = None) -> _LayerTime:
    """Time of one layer call: ``counts`` [world, experts] routed over placement ``mat`` [world, experts] (bool)
    with sharded placement ``owners``. ``mode`` says how replicas travel: ``prefetch`` (Hecate: SparseAllGather
    before the gate, hidden behind T_nonMoE; SparseReduceScatter behind the backward non-MoE compute), ``rm``
    (the same plus a second gather in backward), ``critical`` (FasterMoE: broadcast after the gate and reduce, both
    exposed), ``persistent`` (FlexMoE: replicas stay; their gradients are all-reduced in backward). ``late``: replicas
    (a subset of ``mat``) gathered after the gate (Hecate's calibration), on the critical path."""
    world, num_experts = counts.shape
    rpn = min(ctx.rpn, world)
    flows = dispatch_flows(counts.T, mat.T, rpn)
    processed = flows.processed.sum(axis=0)
    sent, recv = flows.sent.sum(axis=0), flows.received.sum(axis=0)
    s_inter, r_inter = flows.sent_inter.sum(axis=0), flows.received_inter.sum(axis=0)
    compute = processed * ctx.s_per_pair
    a2a_pass = _links(ctx, world, recv - r_inter, sent - s_inter, _node_sum(r_inter, world, rpn),
                      _node_sum(s_inter, world, rpn), ctx.row_bytes)
    owner_mask = np.zeros_like(mat)
    owner_mask[owners, np.arange(num_experts)] = True
    replicas = mat & ~owner_mask
    node_idx = np.arange(world) // rpn
    same_node = node_idx[:, None] == node_idx[owners][None, :]

    def phase(rep: np.ndarray, nbytes: int) -> np.ndarray:
        if ctx.spag == "ring":
            # what-if: each replicated expert travels as a pipelined ring broadcast (reduce) over its holders:
            # every holder receives and forwards it once; the ring enters and leaves each node holding it once
            moved = rep.any(axis=0)
            hold = mat[:, moved]
            on_node = np.add.reduceat(hold.astype(float), np.arange(0, world, rpn), axis=0) > 0
            crossing = (on_node & (on_node.sum(axis=0) > 1)).sum(axis=1).astype(float)
            return _links(ctx, world, rep.sum(axis=1).astype(float), hold.sum(axis=1).astype(float), crossing,
                          crossing, nbytes)
        i_intra = (rep & same_node).sum(axis=1).astype(float)
        i_inter = (rep & ~same_node).sum(axis=1).astype(float)
        o_intra = np.bincount(owners, weights=(rep & same_node).sum(axis=0), minlength=world)
        o_inter = np.bincount(owners, weights=(rep & ~same_node).sum(axis=0), minlength=world)
        return _links(ctx, world, i_intra, o_intra, _node_sum(i_inter, world, rpn), _node_sum(o_inter, world, rpn),
                      nbytes)

    early = replicas if late is None else replicas & ~late
    gather = phase(early, ctx.numel * ctx.compute_b)
    reduce = phase(replicas, ctx.numel * ctx.grad_b)
    late_gather = phase(late & replicas, ctx.numel * ctx.compute_b) if late is not None else np.zeros(world)
    if mode == "broadcast":
        # NCCL ring broadcast / reduce of each shadowed expert: every rank receives and forwards it once, and
        # the ring crosses each node boundary once.
        shadowed = float((replicas.sum(axis=0) > 0).sum())
        ones = np.full(world, shadowed)
        per_node = np.full(-(-world // rpn), shadowed if world > rpn else 0.0)
        gather = _links(ctx, world, ones, ones, per_node, per_node, ctx.numel * ctx.compute_b)
        reduce = _links(ctx, world, ones, ones, per_node, per_node, ctx.numel * ctx.grad_b)
    hide = ctx.cluster.overlaps_compute
    t_f, t_b = (ctx.t_fwd, 2 * ctx.t_fwd) if hide else (0.0, 0.0)
    if mode in ("critical", "broadcast"):
        exp_f, exp_b = gather, reduce
    elif mode == "persistent":
        exp_f, exp_b = np.zeros(world), np.maximum(0.0, 2 * reduce - t_b)
    elif mode == "rm":
        regather = gather if late is None else phase(replicas, ctx.numel * ctx.compute_b)
        exp_f, exp_b = np.maximum(0.0, gather - t_f), np.maximum(0.0, reduce + regather - t_b)
    elif mode == "prefetch":
        exp_f, exp_b = np.maximum(0.0, gather - t_f), np.maximum(0.0, reduce - t_b)
    else:
        raise ValueError(f"layer_time: unknown mode {mode!r}")
    exp_f = exp_f + late_gather
    c_max, a_max = float(compute.max()), 4 * float(a2a_pass.max())
    exposed = float(exp_f.max()) + float(exp_b.max())
    mean = processed.mean()
    return _LayerTime(c_max + a_max + exposed, c_max, a_max, exposed,
                      float(processed.max() / mean) if mean > 0 else 1.0, replicas.sum(axis=1))


def _placement_matrix(placement: Sequence[Sequence[int]], num_experts: int) -> np.ndarray:
    return holders_matrix(placement, len(placement), num_experts)


def _owner_matrix(owners: Sequence[int], world: int) -> np.ndarray:
    mat = np.zeros((world, len(owners)), dtype=bool)
    mat[np.asarray(owners), np.arange(len(owners))] = True
    return mat


def _migration_time(ctx: _Ctx, world: int, moves: List[Tuple[int, int]]) -> float:
    """Seconds to move whole experts (weights + gradient buffer + optimizer state) ``(src, dst)``, exposed."""
    if not moves:
        return 0.0
    rpn = min(ctx.rpn, world)
    node = lambda r: r // rpn   # noqa: E731
    in_intra, out_intra, in_inter, out_inter = (np.zeros(world) for _ in range(4))
    for src, dst in moves:
        if node(src) == node(dst):
            in_intra[dst] += 1
            out_intra[src] += 1
        else:
            in_inter[dst] += 1
            out_inter[src] += 1
    t = _links(ctx, world, in_intra, out_intra, _node_sum(in_inter, world, rpn), _node_sum(out_inter, world, rpn),
               ctx.numel * (ctx.compute_b + ctx.state_bytes_per_param))
    return float(t.max())


# ---------------------------------------------------------------------------------------------------------------
# systems: per layer, a stateful placement rule
# ---------------------------------------------------------------------------------------------------------------
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

    def __init__(self, ctx: _Ctx) -> None:
        self.ctx = ctx
        self.cache: Dict[Any, Any] = {}

    def step(self, step: int, counts: np.ndarray) -> Tuple[_LayerTime, float]:
        """(layer time, rearrangement seconds this step) for this step's counts."""
        raise NotImplementedError


def _groups(ctx: _Ctx) -> List[slice]:
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

    def __init__(self, ctx: _Ctx) -> None:
        super().__init__(ctx)
        self.groups = _groups(ctx)
        ep = ctx.ep_size
        self.owners = [np.asarray(even_sharding(ctx.model.num_experts, ep)) for _ in self.groups]
        self.predictors = [_Window(ctx.hecate.load_window) for _ in self.groups]

    def group_placement(self, g: int, step: int, counts: np.ndarray) -> Tuple[np.ndarray, float]:
        return _owner_matrix(self.owners[g], counts.shape[0]), 0.0

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

    def step(self, step: int, counts: np.ndarray) -> Tuple[_LayerTime, float]:
        worst: Optional[_LayerTime] = None
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
        worst = _LayerTime(worst.total + extra, worst.compute, worst.a2a, worst.exposed + extra, worst.imbalance,
                           np.concatenate(replicas))
        return worst, rearrange


class _EP(_EPFamily):
    """Plain expert parallelism: the planner's ``owner`` policy."""

    def group_placement(self, g, step, counts):
        owners = tuple(int(o) for o in self.owners[g])
        return _placement_matrix(POLICIES["owner"](counts.tolist(), owners, None), len(owners)), 0.0


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
            self.cache[key] = _placement_matrix(POLICIES["shadow"](counts.tolist(), owners, costs), len(owners))
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
            moved = _migration_time(self.ctx, counts.shape[0], moves)
            self.owners[g] = new
        return _owner_matrix(self.owners[g], counts.shape[0]), moved


class _FlexMoE(_EPFamily):
    """FlexMoE-style replication: every ``interval`` steps, reserved slots (``slots`` per rank, full optimizer
    state each) are filled with replicas of the experts with the highest load per copy, each on the least-loaded
    rank with a free slot; replicas persist and all-reduce their gradients every step."""

    mode = "persistent"
    interval = 10
    uses_loads = True

    def __init__(self, ctx: _Ctx) -> None:
        super().__init__(ctx)
        self.slots = max(1, ctx.model.num_experts // ctx.ep_size)
        self.mats = [_owner_matrix(o, ctx.ep_size) for o in self.owners]

    def group_placement(self, g, step, counts):
        loads = self.predictors[g].expert_loads() if step > 0 and step % self.interval == 0 else None
        moved = 0.0
        if loads is not None:
            world, num_experts = counts.shape
            owners = self.owners[g]
            mat = _owner_matrix(owners, world)
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
            moved = _migration_time(self.ctx, world, moves)
            self.mats[g] = mat
        return self.mats[g], moved


class _Hecate(_System):
    """ds_hecate: the runtime's planner on the whole world. Per step: the load window predicts the counts, the
    scheduler (``schedule_materialization``) builds the placement with the runtime's budget and cost formulas, the
    SparseAllGather is prefetched, and the step's real counts are dispatched over it."""

    def __init__(self, ctx: _Ctx, rematerialize: bool) -> None:
        super().__init__(ctx)
        self.mode = "rm" if rematerialize else "prefetch"
        self.owners = np.asarray(even_sharding(ctx.model.num_experts, ctx.world))
        self.window = _Window(ctx.hecate.load_window)
        self.schedule = ScheduleReuse(ctx.hecate.replan_tolerance, ctx.hecate.load_window)   # the runtime's rule
        self.costs = ctx.step_costs(ctx.world)
        self.timings: Dict[Any, _LayerTime] = {}
        self.budget = replica_budget(ctx.hecate.materialize_budget_mb, ctx.numel * ctx.compute_b,
                                     ctx.model.moe_layers, rematerialize)
        # More ranks than experts: every rank gets work only through replicas; the search starts from the
        # expert-data-parallel layout (ep = experts), which FSSDP has to materialize anyway.
        self.start = None
        self.note = ""
        self.charge_planning = ctx.charge_planning
        self.planning_s = 0.0             # host planning charged to the last step (measured here)
        self.placements: Dict[bytes, Placement] = {}
        if ctx.world > ctx.model.num_experts:
            ep_owners = even_sharding(ctx.model.num_experts, ctx.ep_size)
            start = tuple(tuple(e for e, o in enumerate(ep_owners) if o == r % ctx.ep_size) for r in range(ctx.world))
            needed = max(sum(1 for e in experts if self.owners[e] != r) for r, experts in enumerate(start))
            if self.budget >= needed:
                self.start = start
            else:   # the budget is a hard cap in the runtime: no layout beyond it
                self.note = (f"{'hecate-rm' if rematerialize else 'hecate'}: the replica budget ({self.budget} per "
                             f"layer per rank) is below the {needed} the expert-data-parallel layout needs with "
                             f"{ctx.world} ranks and {ctx.model.num_experts} experts; raise --materialize-budget-mb")

    @staticmethod
    def frozen(mat: np.ndarray):
        return tuple(tuple(int(e) for e in np.flatnonzero(row)) for row in mat)

    def step(self, step, counts):
        predicted = self.window.predict()
        calibration = self.ctx.hecate.calibration
        search_s = 0.0
        if predicted is None or (calibration and not self.schedule.predictions_reliable):
            # as LayerBinding.predicted_placement: nothing speculative before a prediction or while it misses
            if predicted is not None:
                self.schedule.reset()
            mat = _owner_matrix(self.owners, self.ctx.world)
            if self.start is not None:
                mat |= _placement_matrix(self.start, self.ctx.model.num_experts)
        else:
            # as LayerBinding.predicted_placement: search again only when the loads left replan_tolerance
            started = time.perf_counter()
            placement = self.schedule.schedule(predicted, self.owners, self.costs, self.budget, self.ctx.rpn,
                                               start=self.start, budget_us=self.ctx.hecate.search_budget_us)
            search_s = time.perf_counter() - started
            if placement not in self.cache:
                self.cache[placement] = _placement_matrix(placement, self.ctx.model.num_experts)
            mat = self.cache[placement]
        # after the gate: the runtime's own critical path (prediction score, calibration, this rank's dispatch)
        key = mat.tobytes()
        if key not in self.placements:   # as the runtime: one Placement per schedule, tables built with the prefetch
            self.placements[key] = Placement(tuple(int(o) for o in self.owners), self.frozen(mat))
            rank_tables(self.placements[key], self.ctx.rpn, 0)
        prefetched = self.placements[key]
        started = time.perf_counter()
        after = plan_after_gate(counts.astype(np.int64), prefetched, predicted, self.schedule, self.costs,
                                self.budget, self.ctx.rpn, 0, calibration, self.ctx.hecate.plan_budget_us)
        critical_s = time.perf_counter() - started
        late = None
        if after.extras is not None:   # calibration's replicas are gathered after the gate
            cal = after.plan.placement.holders
            late, mat = cal & ~mat, cal
        # host planning on the critical path, and the search where the preceding non-MoE compute does not hide it
        self.planning_s = (critical_s + max(0.0, search_s - self.ctx.t_fwd)) if self.charge_planning else 0.0
        timing_key = (mat.tobytes(), counts.tobytes(), None if late is None else late.tobytes())
        if timing_key not in self.timings:
            self.timings[timing_key] = layer_time(self.ctx, counts, mat, self.owners, self.mode, late)
        self.window.push(counts)
        return self.timings[timing_key], 0.0


class _Ideal(_System):
    def step(self, step, counts):
        compute = float(counts.sum()) * self.ctx.s_per_pair / self.ctx.world
        return _LayerTime(compute, compute, 0.0, 0.0, 1.0, np.zeros(self.ctx.world)), 0.0


def _make(system: str, ctx: _Ctx) -> _System:
    if system == "ep":
        return _EP(ctx)
    if system == "fastermoe":
        return _FasterMoE(ctx)
    if system == "smartmoe":
        return _SmartMoE(ctx)
    if system == "flexmoe":
        return _FlexMoE(ctx)
    if system in ("hecate", "hecate-rm"):
        return _Hecate(ctx, rematerialize=system == "hecate-rm")
    if system == "ideal":
        return _Ideal(ctx)
    raise HecateError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")


# ---------------------------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------------------------
def _workload_counts(workload: str, model: ModelShape, world: int, steps: int, tokens: int,
                     seed: int) -> Tuple[List[List[np.ndarray]], List[str]]:
    """counts[step][layer] as [world, experts] arrays, from a named workload or a trace file."""
    notes: List[str] = []
    if workload in WORKLOADS:
        per_step = [np.asarray(routing_counts(workload, s, world, model.num_experts, tokens, model.top_k, seed),
                               dtype=np.float64) for s in range(steps)]
        return [[c] * model.moe_layers for c in per_step], notes
    trace = read_trace(workload)
    if trace.world_size != world:
        raise HecateError(f"trace {workload} was recorded on {trace.world_size} ranks; simulate it with "
                          f"--world-size {trace.world_size} (got {world})")
    for i, layer in enumerate(trace.layers):
        if layer.num_experts != model.num_experts:
            raise HecateError(f"trace {workload} layer {i} has {layer.num_experts} experts, model {model.name} has "
                              f"{model.num_experts}; pass --model with the trace's sizes")
    groups = list(trace.by_step())
    if not groups:
        raise HecateError(f"trace {workload} has no records")
    out = []
    for s in range(steps):
        records = groups[s % len(groups)]
        by_layer: Dict[int, np.ndarray] = {}
        for r in records:
            by_layer.setdefault(r.layer, np.asarray(r.counts, dtype=np.float64))
        layers = [by_layer.get(l % len(trace.layers), next(iter(by_layer.values()))) for l in range(model.moe_layers)]
        out.append(layers)
    if steps > len(groups):
        notes.append(f"trace has {len(groups)} steps; replayed cyclically for {steps}")
    if len(trace.layers) != model.moe_layers:
        notes.append(f"trace has {len(trace.layers)} MoE layer(s), model {model.moe_layers}: layers reuse the trace's "
                     "layers cyclically")
    return out, notes


def _explicit_counts(counts: Sequence[Sequence[Any]], model: ModelShape, world: int,
                     steps: int) -> List[List[np.ndarray]]:
    """Validate ``counts[step][layer]`` ([world, experts] each) and convert to arrays; layers of a step with equal
    counts share one array, so the simulator's layer classes (identical routing at every step) still form."""
    if len(counts) != steps:
        raise HecateError(f"simulate: counts has {len(counts)} step(s), expected steps={steps}")
    out: List[List[np.ndarray]] = []
    for s, layers in enumerate(counts):
        if len(layers) != model.moe_layers:
            raise HecateError(f"simulate: counts[{s}] has {len(layers)} layer(s), model {model.name} has "
                              f"{model.moe_layers} MoE layers")
        row: List[np.ndarray] = []
        for layer, c in enumerate(layers):
            arr = np.asarray(c, dtype=np.float64)
            if arr.shape != (world, model.num_experts) or (arr < 0).any():
                raise HecateError(f"simulate: counts[{s}][{layer}] must be a non-negative [world={world}, "
                                  f"experts={model.num_experts}] matrix, got shape {arr.shape}")
            same = next((prev for prev in row if np.array_equal(prev, arr)), None)
            row.append(same if same is not None else arr)
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------------------
def _memory(system: str, ctx: _Ctx, replicas_per_layer: List[np.ndarray], flex_slots: int) -> int:
    """Model-state bytes of the largest rank (dense under ZeRO + owned experts + replicas / reserved slots)."""
    dense = sum(dense_state_bytes(ctx.model.dense_params, ctx.world, ctx.zero_stage, ctx.precision,
                                  ctx.optimizer.bytes_per_param))
    per_expert = ctx.numel * ctx.state_bytes_per_param
    layers = ctx.model.moe_layers
    if system in ("hecate", "hecate-rm", "ideal"):
        owners = even_sharding(ctx.model.num_experts, ctx.world)
        owned = max(owners.count(r) for r in range(ctx.world)) * layers
    else:
        owned = int(np.ceil(ctx.model.num_experts / ctx.ep_size)) * layers
    extra = 0.0
    if replicas_per_layer:
        reps = np.stack(replicas_per_layer)          # [layers, world], max over steps per layer
        param, grad = ctx.numel * ctx.compute_b, ctx.numel * ctx.grad_b
        if system == "hecate":
            extra = float((reps.sum(axis=0) * param + reps.max(axis=0) * grad).max())
        elif system == "hecate-rm":
            extra = float((reps.max(axis=0) * (param + grad)).max())
        elif system == "fastermoe":
            extra = float((reps.sum(axis=0) * (param + grad)).max())
    if system == "flexmoe":
        extra = flex_slots * layers * per_expert
    return int(dense + owned * per_expert + extra)


# ---------------------------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------------------------
def simulate(cluster: Union[str, Cluster], model: Union[str, ModelShape], workload: str,
             systems: Sequence[str] = SYSTEMS, steps: int = 30, world_size: Optional[int] = None,
             tokens_per_rank: Optional[int] = None, warmup: int = 1, seed: int = 0,
             hecate: Optional[HecateConfig] = None, materialize_budget_mb: Optional[float] = None,
             zero_stage: int = 1, precision: str = "bf16", optimizer: OptimizerStateLayout = ADAM,
             spag: str = "p2p", counts: Optional[Sequence[Sequence[Any]]] = None,
             planner_costs: Optional[Dict[str, float]] = None, force_balanced: bool = True,
             charge_planning: bool = True) -> SimResult:
    """Simulate ``steps`` training steps of ``model`` on ``cluster`` under ``workload`` for each of ``systems``.

    ``workload``: W0..W7 or a trace file (ds_hecate.trace). ``hecate``: the ``hecate`` config the Hecate systems
    plan with (default: defaults, with ``materialize_budget_mb`` = 10% of device memory unless given).
    ``tokens_per_rank``: default ``seq_len * micro_batch`` of the model. ``spag``: ``p2p`` models Hecate's
    SparseAllGather/SparseReduceScatter as ds_hecate runs them (the owner sends each replica), ``ring`` is a
    what-if with pipelined ring broadcasts/reductions per expert (the paper's NCCL Broadcast/Reduce). Returns per-system results; speedups are
    against ``ep`` and fractions against ``ideal`` when those are among ``systems``.

    ``counts``: explicit routing to replay instead of generating it from ``workload`` (then only a label):
    ``counts[step][layer]`` is a ``[world, experts]`` matrix of token-expert pairs, for every one of ``steps`` steps
    and ``model.moe_layers`` layers. What the benchmark calibration passes (benchmarks/calibration.py), so the
    simulator replays exactly the counts a measured run forced, trace rescaling included. ``planner_costs``: the
    measured costs (``compute_s_per_pair``, ``link_gbps``, ``non_moe_time_s``) the planners decide with, when they
    differ from the cluster's time model: a run's runtime planned with its own measurement, and replaying its
    decisions needs those numbers even where the step time is modelled with other unit costs.

    ``charge_planning``: Hecate's host planning is timed on this machine as the runtime runs it
    (:func:`~ds_hecate.planning.critical_path.plan_after_gate` for one rank, and the prediction-driven search) and
    added to its step: the critical path in full, the search where it outlasts the non-MoE compute that hides it
    (``host_planning`` in the breakdown). False: leave it out (reproducible figures for tests).

    ``force_balanced``: also simulate every system on the same routing forced uniform
    (:func:`ds_hecate.planning.balance.force_uniform`: same pairs per rank, spread evenly over the experts) and
    set ``force_balanced_step_s`` and ``force_balanced_fraction`` (that step time / the system's own).
    """
    start_wall = time.perf_counter()
    cl = resolve_cluster(cluster)
    mdl = resolve_model(model)
    if world_size is not None:
        cl = cl.with_world_size(world_size)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise HecateError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    if steps <= warmup:
        raise HecateError(f"simulate: steps ({steps}) must exceed warm-up steps ({warmup})")
    if spag not in ("p2p", "ring"):
        raise HecateError(f"simulate: spag must be 'p2p' or 'ring', got {spag!r}")
    if precision not in ("bf16", "fp16", "fp32"):
        raise HecateError(f"simulate: precision must be bf16, fp16 or fp32, got {precision!r}")
    world = cl.world_size
    tokens = tokens_per_rank or mdl.tokens_per_rank
    budget = (materialize_budget_mb if materialize_budget_mb is not None
              else 0.1 * cl.device_memory_gb * 1024.0)
    if hecate is None:
        hecate = HecateConfig(enabled=True, materialize_budget_mb=float(budget))
    elif materialize_budget_mb is not None:
        hecate = hecate.model_copy(update={"materialize_budget_mb": float(materialize_budget_mb)})
    compute_b = 4 if precision == "fp32" else 2
    flops = cl.device_tflops * 1e12
    ctx = _Ctx(cluster=cl, model=mdl, world=world, rpn=cl.devices_per_node, tokens=tokens, compute_b=compute_b,
               grad_b=4 if hecate.reduce_dtype == "fp32" else 2,
               s_per_pair=cl.compute_s_per_pair or 6.0 * mdl.expert_params / flops,
               t_fwd=(cl.non_moe_time_s if cl.non_moe_time_s is not None
                      else mdl.non_moe_flops_per_layer(tokens) / 3.0 / flops),
               hecate=hecate, optimizer=optimizer, zero_stage=zero_stage, precision=precision, spag=spag,
               planner_costs=None if planner_costs is None else {k: float(v) for k, v in planner_costs.items()},
               charge_planning=charge_planning)
    if counts is None:
        counts, notes = _workload_counts(workload, mdl, world, steps, tokens, seed)
    else:
        counts, notes = _explicit_counts(counts, mdl, world, steps), []
    # Layers whose routing is identical at every step behave identically (the planner is deterministic):
    # simulate one of each class and weight it by the class size.
    classes: Dict[Tuple[int, ...], List[int]] = {}
    for layer in range(mdl.moe_layers):   # layers sharing the same count arrays at every step
        classes.setdefault(tuple(id(counts[s][layer]) for s in range(steps)), []).append(layer)
    fixed = (3 * ctx.t_fwd * mdl.moe_layers
             + (6.0 * (mdl.attention_params_per_layer + 3 * mdl.hidden_size * mdl.dense_ffn_size) * tokens
                + 12.0 * mdl.seq_len * mdl.hidden_size * tokens) * mdl.dense_layers / flops
             + 6.0 * mdl.vocab_size * mdl.hidden_size * tokens / flops
             + cl.fixed_step_s)
    if cl.non_moe_time_s is not None and cl.compute_s_per_pair is not None:
        # calibrated: the measured T_nonMoE already holds everything between MoE layers
        fixed = 3 * ctx.t_fwd * mdl.moe_layers + cl.fixed_step_s
    results: Dict[str, SystemResult] = {}
    for system in systems:
        totals = np.zeros(steps)
        parts = {k: np.zeros(steps) for k in ("compute", "all_to_all", "exposed_comm", "rearrange", "host_planning")}
        imbalance, reps_sum, reps_n = [], 0.0, 0
        replicas_by_layer: List[np.ndarray] = []
        for layers in classes.values():
            sim = _make(system, ctx)
            if getattr(sim, "note", "") and sim.note not in notes:
                notes.append(sim.note)
            weight = len(layers)
            peak_reps = np.zeros(world)
            for s in range(steps):
                lt, rearrange = sim.step(s, counts[s][layers[0]])
                overhead = cl.layer_overhead_s if system != "ideal" else 0.0
                planning = getattr(sim, "planning_s", 0.0)
                totals[s] += weight * (lt.total + rearrange + overhead + planning)
                parts["host_planning"][s] += weight * planning
                parts["compute"][s] += weight * lt.compute
                parts["all_to_all"][s] += weight * lt.a2a
                parts["exposed_comm"][s] += weight * lt.exposed
                parts["rearrange"][s] += weight * rearrange
                if s >= warmup:
                    imbalance.append(lt.imbalance)
                    reps_sum += float(lt.replicas.sum()) * weight
                    reps_n += weight
                    peak_reps = np.maximum(peak_reps, lt.replicas)
            replicas_by_layer.extend([peak_reps] * weight)
        totals += fixed
        measured = totals[warmup:]
        results[system] = SystemResult(
            system=system, step_times_s=[float(t) for t in totals], step_time_s=float(measured.mean()),
            peak_memory_bytes=_memory(system, ctx, replicas_by_layer, max(1, mdl.num_experts // ctx.ep_size)),
            imbalance=float(np.mean(imbalance)) if imbalance else 1.0,
            replicas_per_layer=reps_sum / reps_n if reps_n else 0.0,
            breakdown_s={**{k: float(v[warmup:].mean()) for k, v in parts.items()}, "non_moe": fixed})
    for r in results.values():
        if "ep" in results:
            r.speedup_vs_ep = results["ep"].step_time_s / r.step_time_s
        if "ideal" in results:
            r.fraction_of_ideal = results["ideal"].step_time_s / r.step_time_s
    if force_balanced:
        forced = force_uniform_steps(counts)
        # routing that is already uniform is its own force-balanced run (re-simulating it would only add noise)
        same = all(np.array_equal(f, c) for fs, cs in zip(forced, counts) for f, c in zip(fs, cs))
        uniform = None if same else simulate(
            cl, mdl, workload, systems=systems, steps=steps, tokens_per_rank=tokens, warmup=warmup, seed=seed,
            hecate=hecate, zero_stage=zero_stage, precision=precision, optimizer=optimizer, spag=spag,
            counts=forced, planner_costs=planner_costs, force_balanced=False, charge_planning=charge_planning)
        for name, r in results.items():
            r.force_balanced_step_s = r.step_time_s if uniform is None else uniform.systems[name].step_time_s
            r.force_balanced_fraction = r.force_balanced_step_s / r.step_time_s
    return SimResult(cluster=cl, model=mdl, workload=workload, world_size=world, steps=steps, warmup=warmup,
                     systems=results, wall_s=time.perf_counter() - start_wall, notes=notes)


def format_table(result: SimResult) -> str:
    """The table ``ds-hecate simulate`` prints."""
    cl, mdl = result.cluster, result.model
    head = (f"cluster {cl.name}: {result.world_size} devices ({cl.nodes} node(s) x {cl.devices_per_node}); model "
            f"{mdl.name}: {mdl.moe_layers} MoE layers x {mdl.num_experts} experts, top-{mdl.top_k}; workload "
            f"{result.workload}; {result.steps} steps ({result.warmup} warm-up not averaged)")
    cols = ("system", "step ms", "vs EP", "of ideal", "of force-balanced", "peak GiB/rank", "imbalance",
            "replicas/layer", "compute ms", "a2a ms", "exposed ms", "rearr ms")
    rows = [cols]
    for r in result.systems.values():
        b = r.breakdown_s
        rows.append((r.system, f"{r.step_time_s * 1e3:.2f}", f"{r.speedup_vs_ep:.2f}x",
                     f"{r.fraction_of_ideal * 100:.1f}%", f"{r.force_balanced_fraction * 100:.1f}%",
                     f"{r.peak_memory_bytes / (1 << 30):.2f}",
                     f"{r.imbalance:.2f}", f"{r.replicas_per_layer:.1f}", f"{b['compute'] * 1e3:.2f}",
                     f"{b['all_to_all'] * 1e3:.2f}", f"{b['exposed_comm'] * 1e3:.2f}",
                     f"{b['rearrange'] * 1e3:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = [head, ""]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"simulated in {result.wall_s:.1f} s wall time")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)
