"""Load-aware sparse materialization (the paper's Algorithm 1, reworked as a cost-driven greedy search).

The paper replicates the top-t experts on all devices when memory allows, else gives replicas in proportion to
load. We optimise the quantity the paper only argues about: the estimated layer time

    max over ranks of (expert compute + token all-to-all + SparseAllGather not hidden by the preceding compute)

Starting from the sharded placement (plain expert parallelism), we repeatedly add the single replica
(expert, rank) that lowers this estimate the most, considering the experts the current bottleneck rank processes,
until no replica helps or every rank's memory budget is used. The overlap degree t enters through the hidden
communication window: a rank can receive or send ``t`` experts for free, beyond that transfers are exposed and a
replica must earn its cost. Compared with the paper this (1) never replicates an expert whose replica would not
shorten the step (e.g. hot but sourced on its owner's rank under local-first dispatch), (2) trades replicas
against the token traffic they save, and (3) respects a per-rank budget rather than one global slot count. Every
input is identical on all ranks and ties break on (expert id, rank), so all ranks compute the same placement.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Sequence, Tuple

import numpy as np

Placement = Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per unit of work; profiled or configured, identical on every rank.

    compute_s_per_pair: one token through one expert, forward + backward.
    token_transfer_s: one token row leaving (or entering) a rank, all four all-to-all passes together.
    expert_transfer_s: one expert through SparseAllGather + SparseReduceScatter on one rank's link.
    overlap_s: communication time hidden behind the non-MoE compute before the layer (T_nonMoE).
    """

    compute_s_per_pair: float
    token_transfer_s: float
    expert_transfer_s: float
    overlap_s: float = 0.0

    @property
    def overlap_degree(self) -> int:
        """t in the paper: experts a rank can move while the preceding non-MoE compute runs."""
        if self.expert_transfer_s <= 0:
            return 1 << 30
        return int(self.overlap_s / self.expert_transfer_s)


@dataclass(frozen=True)
class LayerEstimate:
    time_s: float
    compute_pairs: Tuple[float, ...]   # token-expert pairs processed per rank
    rank_time_s: Tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """max/mean of per-rank expert compute (1.0 = perfectly balanced)."""
        loads = self.compute_pairs
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0


def owner_loads(counts: Sequence[Sequence[int]], owners: Sequence[int], world_size: int) -> List[int]:
    """Token-expert pairs per rank when every expert runs only on its owner (plain expert parallelism)."""
    loads = [0] * world_size
    for row in counts:
        for e, n in enumerate(row):
            loads[owners[e]] += n
    return loads


def imbalance(loads: Sequence[float]) -> float:
    """max/mean of per-rank loads (1.0 when there is no load at all)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def rank_loads(counts: Sequence[Sequence[float]], materialized: Sequence[Sequence[int]], ranks_per_node: int):
    """Fractional version of the topology-aware dispatch.

    Returns (pairs processed per rank and expert ``[world][experts]``, rows sent per rank, rows received per rank).
    Computed by :func:`dispatch_flows` (numpy, all experts at once); the rule is
    :func:`~ds_hecate.planning.dispatch.eligible_ranks`.
    """
    world = len(counts)
    num_experts = len(counts[0]) if world else 0
    if not world or not num_experts:
        return [[0.0] * num_experts for _ in range(world)], [0.0] * world, [0.0] * world
    holders = np.zeros((num_experts, world), dtype=bool)
    for rank, experts in enumerate(materialized):
        holders[list(experts), rank] = True
    if (~holders.any(axis=1) & (np.asarray(counts, dtype=np.float64).sum(axis=0) != 0)).any():
        # an expert with pairs but no holder: the pure-Python rule cannot route it either
        raise ValueError("rank_loads: an expert with token-expert pairs is materialized nowhere")
    flows = dispatch_flows(np.asarray(counts, dtype=np.float64).T, holders, ranks_per_node)
    return flows.processed.T.tolist(), flows.sent.sum(axis=0).tolist(), flows.received.sum(axis=0).tolist()


def estimate_layer(counts: Sequence[Sequence[float]], owners: Sequence[int], materialized: Sequence[Sequence[int]],
                   costs: StepCostModel, ranks_per_node: int,
                   prefetched: Optional[Sequence[Sequence[int]]] = None) -> LayerEstimate:
    """Estimated time of one layer under a placement.

    Replicas listed in ``prefetched`` were gathered ahead of time (hidden up to ``overlap_s``); others are gathered
    on the critical path (calibration), fully exposed.
    """
    world = len(counts)
    per_expert, sent, received = rank_loads(counts, materialized, ranks_per_node)
    processed = [sum(row) for row in per_expert]
    moved_in = [0] * world
    moved_out = [0] * world
    exposed_in = [0] * world
    exposed_out = [0] * world
    for r, experts in enumerate(materialized):
        early = set(prefetched[r]) if prefetched is not None else None
        for e in experts:
            o = owners[e]
            if o == r:
                continue
            if early is None or e in early:
                moved_in[r] += 1
                moved_out[o] += 1
            else:
                exposed_in[r] += 1
                exposed_out[o] += 1
    times = []
    for r in range(world):
        hidden_comm = max(moved_in[r], moved_out[r]) * costs.expert_transfer_s
        exposed = max(0.0, hidden_comm - costs.overlap_s)
        exposed += max(exposed_in[r], exposed_out[r]) * costs.expert_transfer_s
        tokens = max(sent[r], received[r]) * costs.token_transfer_s
        times.append(processed[r] * costs.compute_s_per_pair + tokens + exposed)
    return LayerEstimate(max(times), tuple(processed), tuple(times))


def _round12(values):
    """Round to 12 significant digits (as ``float(f"{t:.12g}")``), elementwise on a numpy array."""
    values = np.asarray(values, dtype=np.float64)
    out = values.copy()
    magnitude = np.abs(values)
    normal = np.isfinite(values) & (magnitude > 1e-280) & (magnitude < 1e280)
    if normal.any():
        v = values[normal]
        scale = 10.0 ** (11 - np.floor(np.log10(np.abs(v))))
        out[normal] = np.round(v * scale) / scale
    extreme = np.flatnonzero(~normal & (values != 0))
    if extreme.size:   # denormals, huge values, inf/nan: the exact string rounding, elementwise
        flat = out.reshape(-1)
        for i in extreme:
            flat[i] = float(f"{flat[i]:.12g}")
    return out


def _profile(est: LayerEstimate) -> Tuple[float, ...]:
    """Rank times sorted from slowest, rounded so that float noise never decides: the search compares these
    lexicographically, so a move that lowers one of several tied maxima counts as progress."""
    return tuple(float(t) for t in -np.sort(-_round12(est.rank_time_s)))


@dataclass(frozen=True)
class DispatchFlows:
    """Fractional topology-aware dispatch as arrays (numpy), per expert column: what :func:`rank_loads` computes,
    plus the part of the traffic that crosses nodes (for the simulator's link model).

    Arrays are ``[K, world]`` for K candidate holder sets of one expert, or ``[experts, world]`` when evaluated for
    all experts of a placement at once.
    """

    processed: "np.ndarray"
    sent: "np.ndarray"
    received: "np.ndarray"
    sent_inter: "np.ndarray"
    received_inter: "np.ndarray"


def dispatch_flows(pairs, holders, ranks_per_node: int) -> DispatchFlows:
    """Vectorised :func:`rank_loads` (the same rule: :func:`~ds_hecate.planning.dispatch.eligible_ranks`).

    ``pairs``: ``[K, world]`` (or ``[world]``, broadcast) token-expert pairs each source rank has for the expert;
    ``holders``: ``[K, world]`` bool, ranks that materialize it. A source holding the expert keeps its pairs;
    otherwise they split evenly over the holders on its node, or over all holders when its node has none.
    """
    holders = np.asarray(holders, dtype=bool)
    k, world = holders.shape
    n = np.broadcast_to(np.asarray(pairs, dtype=np.float64), (k, world))
    starts = np.arange(0, world, ranks_per_node)
    node_idx = np.arange(world) // ranks_per_node
    hf = holders.astype(np.float64)
    node_cnt = np.add.reduceat(hf, starts, axis=1)
    node_has = (node_cnt > 0)[:, node_idx]
    positive = n > 0
    outsider = positive & ~holders
    same = outsider & node_has
    remote = outsider & ~node_has
    node_mass = np.add.reduceat(np.where(same, n, 0.0), starts, axis=1)
    remote_mass = np.where(remote, n, 0.0).sum(axis=1)
    total_holders = np.maximum(hf.sum(axis=1), 1.0)
    from_node = (node_mass / np.maximum(node_cnt, 1.0))[:, node_idx]
    from_remote = (remote_mass / total_holders)[:, None]
    received = hf * (from_node + from_remote)
    processed = np.where(holders, n, 0.0) + received
    sent = np.where(outsider, n, 0.0)
    return DispatchFlows(processed, sent, received, np.where(remote, n, 0.0), hf * from_remote)


class _Search:
    """State of :func:`schedule_materialization`'s greedy search, vectorised with numpy.

    Per expert it keeps the dispatch columns (pairs processed, rows sent and received per rank), so a candidate
    move, which changes the holders of one expert only, is evaluated by replacing that expert's columns; all
    candidate moves of a search step are evaluated in one batch.
    """

    def __init__(self, counts, owners, costs: StepCostModel, ranks_per_node: int, start, prefetched) -> None:
        self.counts = np.asarray(counts, dtype=np.float64).reshape(len(counts), len(owners))
        self.world, self.num_experts = self.counts.shape
        self.owners = np.asarray(owners, dtype=np.int64)
        self.costs = costs
        self.rpn = ranks_per_node
        self.mat = np.zeros((self.world, self.num_experts), dtype=bool)
        self.mat[self.owners, np.arange(self.num_experts)] = True
        if start is not None:
            for r, experts in enumerate(start):
                self.mat[r, list(experts)] = True
        if prefetched is None:
            self.early = np.ones_like(self.mat)
        else:
            self.early = np.zeros_like(self.mat)
            for r, experts in enumerate(prefetched):
                self.early[r, list(experts)] = True
        self.owner_mask = np.zeros_like(self.mat)
        self.owner_mask[self.owners, np.arange(self.num_experts)] = True
        flows = dispatch_flows(self.counts.T, self.mat.T, ranks_per_node)
        self.proc, self.sent, self.recv = flows.processed, flows.sent, flows.received   # [experts, world]
        self.refresh()

    def refresh(self) -> None:
        replicas = self.mat & ~self.owner_mask
        early, late = replicas & self.early, replicas & ~self.early
        self.moved_in = early.sum(axis=1).astype(np.float64)
        self.exposed_in = late.sum(axis=1).astype(np.float64)
        self.moved_out = np.bincount(self.owners, weights=early.sum(axis=0), minlength=self.world)
        self.exposed_out = np.bincount(self.owners, weights=late.sum(axis=0), minlength=self.world)
        self.tot = (self.proc.sum(axis=0), self.sent.sum(axis=0), self.recv.sum(axis=0))
        self.times = self.rank_times(*self.tot, self.moved_in, self.moved_out, self.exposed_in, self.exposed_out)

    def rank_times(self, processed, sent, received, moved_in, moved_out, exposed_in, exposed_out):
        c = self.costs
        hidden = np.maximum(moved_in, moved_out) * c.expert_transfer_s
        exposed = np.maximum(0.0, hidden - c.overlap_s) + np.maximum(exposed_in, exposed_out) * c.expert_transfer_s
        return processed * c.compute_s_per_pair + np.maximum(sent, received) * c.token_transfer_s + exposed

    def evaluate(self, moves: Sequence[Tuple[int, Tuple[int, ...]]]):
        """Rank times ``[len(moves), world]`` after each move (expert e added on a rank set), all in one batch."""
        k = len(moves)
        experts = np.fromiter((e for e, _ in moves), dtype=np.int64, count=k)
        added = np.zeros((k, self.world), dtype=bool)
        for i, (_, ranks) in enumerate(moves):
            added[i, list(ranks)] = True
        holders = added | self.mat[:, experts].T
        flows = dispatch_flows(self.counts[:, experts].T, holders, self.rpn)
        p, s, r = self.tot
        processed = p - self.proc[experts] + flows.processed
        sent = s - self.sent[experts] + flows.sent
        received = r - self.recv[experts] + flows.received
        early = self.early[:, experts].T
        add_early, add_late = added & early, added & ~early
        moved_in, exposed_in = self.moved_in + add_early, self.exposed_in + add_late
        # only the expert's owner sends more
        rows, owners = np.arange(k), self.owners[experts]
        moved_out = np.tile(self.moved_out, (k, 1))
        exposed_out = np.tile(self.exposed_out, (k, 1))
        moved_out[rows, owners] += add_early.sum(axis=1)
        exposed_out[rows, owners] += add_late.sum(axis=1)
        return self.rank_times(processed, sent, received, moved_in, moved_out, exposed_in, exposed_out)

    def add(self, e: int, ranks: Tuple[int, ...]) -> None:
        self.mat[list(ranks), e] = True
        flows = dispatch_flows(self.counts[:, e], self.mat[:, e][None, :], self.rpn)
        self.proc[e], self.sent[e], self.recv[e] = flows.processed[0], flows.sent[0], flows.received[0]
        self.refresh()

    def frozen(self, mat=None) -> Placement:
        mat = self.mat if mat is None else mat
        return tuple(tuple(int(e) for e in np.flatnonzero(row)) for row in mat)


def _lex_min(profiles) -> int:
    """Index of the lexicographically smallest row (first such row on ties) of a 2-D array of sorted profiles."""
    idx = np.arange(profiles.shape[0])
    for col in range(profiles.shape[1]):
        column = profiles[idx, col]
        idx = idx[column == column.min()]
        if len(idx) == 1:
            break
    return int(idx[0])


def _lex_less(a, b) -> bool:
    diff = np.flatnonzero(a != b)
    return bool(diff.size) and bool(a[diff[0]] < b[diff[0]])


def schedule_materialization(counts: Sequence[Sequence[float]], owners: Sequence[int], costs: StepCostModel,
                             budget_per_rank: int, ranks_per_node: int,
                             start: Optional[Sequence[Sequence[int]]] = None,
                             prefetched: Optional[Sequence[Sequence[int]]] = None,
                             candidate_experts: int = 4, min_gain: float = 0.05) -> Placement:
    """Greedy replica placement minimising :func:`estimate_layer` under ``budget_per_rank`` extra experts/rank.

    Moves considered for the experts that load the bottleneck rank most: one new replica on one rank, a replica on
    every rank of one node that lacks the expert, and a replica on every rank that lacks it. Single replicas alone
    get stuck where local-first dispatch makes each new copy overload its own rank; the group moves are Algorithm
    1's "replicate on all devices" as one option among others. A move is taken when it lowers the sorted profile
    of rank times (see :func:`_profile`); ties break on (expert, ranks); the result is the earliest placement on
    that path with the lowest layer time, kept only if it beats the starting placement by ``min_gain`` (a
    fraction): predicted loads are noisy, and replicas that promise a few percent cost more than they return
    when the routing moves. ``start`` is a placement to extend (the prefetched one, for calibration); by default
    the sharded placement.

    The search is vectorised (numpy): a move changes the holders of one expert, so it is evaluated by swapping
    that expert's dispatch columns (:func:`dispatch_flows`, the same rule as :func:`rank_loads`), all moves of a
    search step in one batch. Rank times are those of :func:`estimate_layer` up to float rounding, which
    :func:`_profile`'s 12-digit rounding absorbs.
    """
    search = _Search(counts, owners, costs, ranks_per_node, start, prefetched)
    world = search.world
    extra = (search.mat & ~search.owner_mask).sum(axis=1)
    num_nodes = max(1, world // ranks_per_node)

    best_times = search.times
    best_max = float(best_times.max())
    # The search may pass through placements that only break a tie among the slowest ranks; what it returns is the
    # earliest placement with the lowest layer time, so no replica is kept that does not shorten the step.
    result_time, result_mat = best_max, search.mat.copy()
    threshold = best_max * (1.0 - min_gain)
    while True:
        bottleneck = int(np.argmax(best_times))   # first (lowest) rank among the slowest
        load_on_bottleneck = search.proc[:, bottleneck]
        loaded = np.flatnonzero(load_on_bottleneck > 0)
        hot = sorted(loaded.tolist(), key=lambda e: (-load_on_bottleneck[e], e))[:candidate_experts]
        moves = set()
        for e in hot:
            open_ranks = np.flatnonzero(~search.mat[:, e] & (extra < budget_per_rank)).tolist()
            moves.update((e, (d,)) for d in open_ranks)
            for n in range(num_nodes):
                in_node = tuple(d for d in open_ranks if d // ranks_per_node == n)
                if in_node:
                    moves.add((e, in_node))
            if open_ranks:
                moves.add((e, tuple(open_ranks)))
        if not moves:
            break
        ordered = sorted(moves)
        times = search.evaluate(ordered)
        peaks = _round12(times.max(axis=1))
        tied = np.flatnonzero(peaks == peaks.min())
        profiles = -np.sort(-_round12(times[tied]), axis=1)
        pick = _lex_min(profiles)
        best_profile = -np.sort(-_round12(best_times))
        if not _lex_less(profiles[pick], best_profile):
            break
        e, ranks = ordered[int(tied[pick])]
        search.add(e, ranks)
        extra[list(ranks)] += 1
        best_times = search.times
        best_max = float(best_times.max())
        if float(_round12(best_max)) < float(_round12(result_time)) and best_max <= threshold:
            result_time, result_mat = best_max, search.mat.copy()
    return search.frozen(result_mat)


def load_shift(before: Sequence[Sequence[float]], after: Sequence[Sequence[float]]) -> float:
    """How far the (source rank, expert) loads moved: L1 distance over the total of ``before`` (0 = unchanged).

    An empty ``before`` counts as moved entirely unless ``after`` is empty too.
    """
    a = np.asarray(before, dtype=np.float64)
    b = np.asarray(after, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    total = float(a.sum())
    diff = float(np.abs(b - a).sum())
    if total <= 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / total


class ScheduleReuse:
    """The last schedule and what it was computed for, so an unchanged situation does not pay for a new search.

    Why: the greedy search costs milliseconds per layer and call, while the predicted loads (a window average) move
    by about a percent a step once routing settles; re-planning then returns the same placement, or one whose
    estimate differs by noise. A schedule is reused while the owners, the cost model and the replica budget are
    unchanged and the loads moved by at most ``tolerance`` (:func:`load_shift`) from the loads it was computed for;
    ``tolerance`` 0 re-plans on every change. All inputs are identical on every rank, so every rank makes the same
    choice. ``planned_for`` tells calibration which loads the prefetched placement assumed.

    It also keeps score of the prediction (:meth:`after_gate`): a call *missed* when its actual counts moved more
    than ``tolerance`` from the predicted loads and would leave the ranks' compute imbalanced under the prefetched
    placement. While more than half of the last ``window`` calls missed, :attr:`predictions_reliable` is false and
    the runtime prefetches no speculative replica (calibration plans from the actual counts instead): replicas
    gathered for loads that do not come cost transfers and leave calibration less room.
    """

    def __init__(self, tolerance: float, window: int = 5) -> None:
        if not 0.0 <= tolerance <= 1.0:
            raise ValueError(f"ScheduleReuse: tolerance must be in [0, 1], got {tolerance}")
        self.tolerance = tolerance
        self.planned_for: Optional[List[List[float]]] = None
        self.placement: Optional[Placement] = None
        self._key: Optional[tuple] = None
        self.searches = 0
        self.reuses = 0
        self.misses: Deque[bool] = deque(maxlen=max(1, window))

    def schedule(self, counts: Sequence[Sequence[float]], owners: Sequence[int], costs: StepCostModel,
                 budget_per_rank: int, ranks_per_node: int,
                 start: Optional[Sequence[Sequence[int]]] = None) -> Placement:
        """:func:`schedule_materialization` of ``counts``, or the previous result when it still applies."""
        start_key = None if start is None else tuple(tuple(int(e) for e in r) for r in start)
        key = (tuple(int(o) for o in owners), costs, budget_per_rank, ranks_per_node) + (
            (start_key,) if start_key is not None else ())
        if (self.placement is not None and key == self._key
                and load_shift(self.planned_for, counts) <= self.tolerance):
            self.reuses += 1
            return self.placement
        self.searches += 1
        self.placement = schedule_materialization(counts, owners, costs, budget_per_rank, ranks_per_node,
                                                  start=start)
        self.planned_for = np.asarray(counts, dtype=np.float64).tolist()
        self._key = key
        return self.placement

    def still_fits(self, counts: Sequence[Sequence[float]]) -> bool:
        """Whether ``counts`` are within the tolerance of the loads the current schedule was computed for."""
        return self.planned_for is not None and load_shift(self.planned_for, counts) <= self.tolerance

    @property
    def predictions_reliable(self) -> bool:
        """Whether at most half of the recent calls missed their prediction (see the class docstring)."""
        return 2 * sum(self.misses) <= len(self.misses)

    def after_gate(self, predicted: Optional[Sequence[Sequence[float]]], counts: Sequence[Sequence[float]],
                   materialized: Sequence[Sequence[int]], ranks_per_node: int) -> bool:
        """Score this call's prediction and say whether calibration (a re-plan after the gate) can pay.

        Calibration can pay when the actual ``counts`` left the tolerance of the loads the prefetched placement was
        planned for *and* under that placement they leave the ranks' expert compute imbalanced (max/mean) by more
        than the tolerance: a balanced step has nothing to fix, and the search would only cost time (about a
        millisecond per layer on a CPU). ``predicted``: the load window's prediction for this call (None before the
        first observation: not scored)."""
        mispredicted = predicted is not None and load_shift(predicted, counts) > self.tolerance
        off_plan = not self.still_fits(counts)
        imbalanced = False
        if mispredicted or off_plan:   # the usual case, a held prediction, needs no dispatch estimate
            per_expert, _, _ = rank_loads(counts, materialized, ranks_per_node)
            imbalanced = imbalance([sum(row) for row in per_expert]) > 1.0 + self.tolerance
        if predicted is not None:
            self.misses.append(mispredicted and imbalanced)
        return off_plan and imbalanced

    def reset(self) -> None:
        self.planned_for, self.placement, self._key = None, None, None

    def state_dict(self) -> dict:
        """What a resumed run needs to make the same reuse decisions (bitwise resume)."""
        state: dict = {"misses": [bool(m) for m in self.misses]}
        if self.placement is not None:
            state.update(planned_for=self.planned_for, placement=[list(r) for r in self.placement],
                         owners=list(self._key[0]))
        return state

    @staticmethod
    def state_fits(state: dict, world_size: int, num_experts: int) -> bool:
        """Whether ``state`` (from :meth:`state_dict`, e.g. read back from a checkpoint) can belong to a layer of
        ``num_experts`` experts on ``world_size`` ranks: shapes, expert and rank ranges, owners inside the
        placement."""
        try:
            if not all(isinstance(m, bool) for m in state.get("misses", [])):
                return False
            if "placement" not in state:
                return True
            placement = [{int(e) for e in r} for r in state["placement"]]
            loads = [[float(v) for v in row] for row in state["planned_for"]]
            owners = [int(o) for o in state["owners"]]
        except (AttributeError, KeyError, TypeError, ValueError):
            return False
        return (len(placement) == len(loads) == world_size and len(owners) == num_experts
                and all(0 <= o < world_size for o in owners)
                and all(len(row) == num_experts for row in loads)
                and all(0 <= e < num_experts for r in placement for e in r)
                and all(e in placement[o] for e, o in enumerate(owners)))

    def load_state_dict(self, state: dict, costs: StepCostModel, budget_per_rank: int, ranks_per_node: int) -> None:
        """Restore :meth:`state_dict`; the owners come from the state (the schedule may predate a re-sharding, which
        the next call then notices), the rest of the situation from the caller."""
        self.reset()
        self.misses.clear()
        self.misses.extend(bool(m) for m in state.get("misses", []))
        if "placement" in state:
            self.planned_for = [[float(v) for v in row] for row in state["planned_for"]]
            self.placement = tuple(tuple(int(e) for e in r) for r in state["placement"])
            self._key = (tuple(int(o) for o in state["owners"]), costs, budget_per_rank, ranks_per_node)
