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
The moves themselves, and why each exists, are in :mod:`.search_moves`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Generator, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.ma  # noqa: F401  np.unique imports it on its first call (10 ms), which would land on a layer call

from .call_work import WorkMeter
from ..cost_model import LayerEstimate, StepCostModel, estimate_layer, rank_seconds
from ..fanout import relay_transfers
from ..dispatch import dispatch_flows
from ..plan import Materialized, holders_matrix, materialized_of
from .proportional import fill_slots, proportional_fill
from .moves import _candidate_moves, _node_exchange_moves, _quota_move, _round12  # noqa: F401
from .work import (SEARCH_WORK, Progress, RelativeBudget, SearchWork,  # noqa: F401  (re-exported)
                          budget_upper_us, budget_us_for, run_metered, run_to_end)


def _profile(est: LayerEstimate) -> Tuple[float, ...]:
    """Rank times sorted from slowest, rounded so that float noise never decides: the search compares these
    lexicographically, so a move that lowers one of several tied maxima counts as progress."""
    return tuple(float(t) for t in -np.sort(-_round12(est.rank_time_s)))


class _Search:
    """State of :func:`schedule_materialization`'s greedy search, vectorised with numpy.

    Per expert it keeps the dispatch columns (pairs processed, rows sent and received per rank, and the part of
    those that crosses nodes), so a candidate move, which changes the holders of one expert only, is evaluated by
    replacing that expert's columns; all candidate moves of a search step are evaluated in one batch. Rank times
    are :func:`~.cost_model.rank_seconds`, the formula :func:`~.cost_model.estimate_layer` uses.
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
            self.mat |= holders_matrix(start, self.world, self.num_experts)
        if prefetched is None:
            self.early = np.ones_like(self.mat)
        else:
            self.early = holders_matrix(prefetched, self.world, self.num_experts).copy()
        self.owner_mask = np.zeros_like(self.mat)
        self.owner_mask[self.owners, np.arange(self.num_experts)] = True
        flows = dispatch_flows(self.counts.T, self.mat.T, ranks_per_node)
        # [experts, world] each: processed, sent, received, sent across nodes, received across nodes
        self.cols = [flows.processed, flows.sent, flows.received, flows.sent_inter, flows.received_inter]
        early_cols, late_cols = self._transfer_columns(np.arange(self.num_experts), self.mat.T)
        # kept and updated in place by add_many: writable copies where the walk returned read-only zero views
        self.early_cols = early_cols if early_cols.flags.writeable else np.array(early_cols)
        self.late_cols = late_cols if late_cols.flags.writeable else np.array(late_cols)
        self.refresh()

    def refresh(self) -> None:
        self.early_xfer = self.early_cols.sum(axis=1)   # [4, world]
        self.late_xfer = self.late_cols.sum(axis=1)
        self.tot = [c.sum(axis=0) for c in self.cols]
        self.times = self.rank_times(self.tot, self.early_xfer, self.late_xfer)

    def _transfer_columns(self, experts, holders):
        """Expert transfers of ``experts`` with holder rows ``holders`` (``[k, world]``), hidden-capable and
        exposed: two ``[4, k, world]`` arrays (in-intra, out-intra, in-inter, out-inter), the relay trees included:
        the first level of the prefetched copies, then their deeper levels (run at the wait, with their pipeline's
        fill) and every level of the copies gathered after the gate (:func:`~.fanout.relay_transfers`)."""
        early = self.early[:, experts].T
        owners = self.owners[experts]
        relays = self.costs.relays
        first, deeper, _ = relay_transfers(holders & early, owners, self.rpn, *relays)
        late = holders & ~early
        if not late.any():   # nothing gathered after the gate (every search before it): no second tree walk
            return first, deeper
        late_first, late_deeper, _ = relay_transfers(late, owners, self.rpn, *relays)
        return first, deeper + late_first + late_deeper

    @property
    def proc(self):
        return self.cols[0]

    def rank_times(self, tot, early, late):
        """Rank times for ``tot``: processed, sent, received, sent and received across nodes; ``early``/``late``:
        expert transfers (in-intra, out-intra, in-inter, out-inter), stacked on the first axis. Arrays may carry a
        leading move axis."""
        processed, sent, received, sent_i, received_i = tot
        tokens = (received - received_i, sent - sent_i, received_i, sent_i)
        return rank_seconds(self.costs, self.rpn, processed, tokens, tuple(early), tuple(late))

    def _moved_columns(self, experts, added):
        holders = added | self.mat[:, experts].T
        flows = dispatch_flows(self.counts[:, experts].T, holders, self.rpn)
        return [flows.processed, flows.sent, flows.received, flows.sent_inter, flows.received_inter]

    def evaluate(self, moves: Sequence[Tuple[int, Tuple[int, ...]]]):
        """Rank times ``[len(moves), world]`` after each move (expert e added on a rank set), all in one batch."""
        k = len(moves)
        experts = np.fromiter((e for e, _ in moves), dtype=np.int64, count=k)
        added = np.zeros((k, self.world), dtype=bool)
        for i, (_, ranks) in enumerate(moves):
            added[i, list(ranks)] = True
        new = self._moved_columns(experts, added)
        tot = [t - c[experts] + n for t, c, n in zip(self.tot, self.cols, new)]
        early, late = self._transfer_columns(experts, added | self.mat[:, experts].T)
        return self.rank_times(tot, self.early_xfer[:, None, :] - self.early_cols[:, experts] + early,
                               self.late_xfer[:, None, :] - self.late_cols[:, experts] + late)

    def evaluate_many(self, pairs: Sequence[Tuple[int, int]]):
        """Rank times ``[world]`` after adding every (expert, rank) of ``pairs`` at once (several experts: their
        dispatch columns are independent, so the changed columns are summed in one batch)."""
        experts, added = self._grouped(pairs)
        new = self._moved_columns(experts, added)
        tot = [t - c[experts].sum(axis=0) + n.sum(axis=0) for t, c, n in zip(self.tot, self.cols, new)]
        early, late = self._transfer_columns(experts, added | self.mat[:, experts].T)
        return self.rank_times(tot, self.early_xfer - self.early_cols[:, experts].sum(axis=1) + early.sum(axis=1),
                               self.late_xfer - self.late_cols[:, experts].sum(axis=1) + late.sum(axis=1))

    def _grouped(self, pairs: Sequence[Tuple[int, int]]):
        by_expert: dict = {}
        for e, d in pairs:
            by_expert.setdefault(int(e), []).append(int(d))
        experts = np.array(sorted(by_expert), dtype=np.int64)
        added = np.zeros((len(experts), self.world), dtype=bool)
        for i, e in enumerate(experts.tolist()):
            added[i, by_expert[e]] = True
        return experts, added

    def add(self, e: int, ranks: Tuple[int, ...]) -> None:
        self.add_many([(e, d) for d in ranks])

    def add_many(self, pairs: Sequence[Tuple[int, int]]) -> None:
        experts, added = self._grouped(pairs)
        for i, e in enumerate(experts.tolist()):
            self.mat[added[i], e] = True
        flows = dispatch_flows(self.counts[:, experts].T, self.mat[:, experts].T, self.rpn)
        for c, n in zip(self.cols, (flows.processed, flows.sent, flows.received, flows.sent_inter,
                                    flows.received_inter)):
            c[experts] = n
        self.early_cols[:, experts], self.late_cols[:, experts] = self._transfer_columns(experts,
                                                                                         self.mat[:, experts].T)
        self.refresh()

    def frozen(self, mat=None) -> Materialized:
        return materialized_of(self.mat if mat is None else mat)


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


def _step_gain(before, after) -> float:
    """Seconds a search step took off the layer's estimate, ties counted: the drop of the slowest rank's time, or,
    where several ranks tie at the maximum and the step relieves only some of them (the maximum falls once all are
    relieved), their share of that fall: the mean drop over the tied ranks, each capped at the level the maximum can
    fall to (the slowest untied rank). Without the share a plateau of tie-breaking steps counts as no gain and a
    search that weighs its gains against its cost (``critical_path``) stops on it."""
    rounded = _round12(before)
    peak = float(rounded.max())
    tied = rounded == peak
    drop = float(before.max() - after.max())
    floor = float(after[~tied].max()) if (~tied).any() else float(after.min())
    share = float(np.clip(before[tied] - np.maximum(after[tied], floor), 0.0, None).mean())
    return max(0.0, drop, share)


#: steps whose work a critical-path search weighs against their estimated gain (``critical_path``): simulated W6
#: cells gained 2-4% against no such stop. One step alone gained 0.1-0.7% on the 32-GPU W6/W7 cells (host time),
#: but a step of little gain can precede one of much (tie-breaking): ``planner_decisions`` found 4 burst calls
#: 2-9% slower by the estimate (8x64 call 9: 0.057 -> 0.062 s)
PAY_WINDOW = 2
#: compute imbalance (max/mean pairs per rank) the first pass must leave for the second (flow-priced) one to run
FLOW_PASS_IMBALANCE = 1.25


def schedule_materialization(counts: Sequence[Sequence[float]], owners: Sequence[int], costs: StepCostModel,
                             budget_per_rank: int, ranks_per_node: int,
                             start: Optional[Sequence[Sequence[int]]] = None,
                             prefetched: Optional[Sequence[Sequence[int]]] = None,
                             candidate_experts: int = 4, min_gain: float = 0.05,
                             budget_us: Union[float, RelativeBudget, None] = None, candidate_ranks: int = 64,
                             work: SearchWork = SEARCH_WORK, critical_path: bool = False,
                             meter: Optional[WorkMeter] = None) -> Materialized:
    """Replica placement minimising :func:`estimate_layer` under ``budget_per_rank`` extra experts/rank: the greedy
    search :func:`_greedy` (its docstring has the moves, the acceptance rule and the anytime budget).

    With relay trees possible (``costs.fanout`` below the replicas an expert can get), a fresh search (no
    ``start``) whose placement leaves the compute imbalanced (max/mean pairs per rank above
    :data:`FLOW_PASS_IMBALANCE`) runs a second pass: the first prices the trees as the runtime runs them (the
    first level hidden, the deeper ones exposed with their pipeline's fill), the second prices every level as one
    hidden flow (``relay_levels_exposed`` False); the placement with the lower estimate under the first pricing
    wins, ties to it. Why: a replica that deepens an expert's tree costs an exposed level at once and pays off only
    once the expert is replicated widely, a barrier a one-move-at-a-time greedy stops at (64 ranks x 8 experts,
    skewed: 0.175 s, imbalance 3.4, against 0.069 s past it), while the flow pricing walks through it. Each pass
    gets the whole budget: halved, the 256-rank cases of ``python -m benchmarks.planner_decisions`` lost up to 21%
    of layer time. Why only when imbalanced: where the first pass balanced the compute, the second never won on the
    simulated grid and only doubled the search's host time, which the simulator charges. Every rank computes the
    same. Calibration (``start`` given) extends its start with the first pricing alone (it is on the critical
    path).

    ``critical_path``: every rank waits for this search (calibration after the gate), so it also stops once its
    last :data:`PAY_WINDOW` steps' estimated work exceeds what they took off the layer's estimate (both in
    microseconds of the same layer call, the work from the search's work model: every rank stops at the same
    step).

    ``meter``: add the search's work to it (:func:`~.search_work.run_metered`), what the simulator charges."""
    steps = search_steps(counts, owners, costs, budget_per_rank, ranks_per_node, start, prefetched,
                         candidate_experts, min_gain, budget_us, candidate_ranks, work, critical_path)
    if meter is None:
        return run_to_end(steps)
    world, num_experts = len(counts), len(owners)
    upper_us = budget_upper_us(budget_us)
    unsearched = upper_us is not None and work.first_step_us(world, num_experts, candidate_experts,
                                                             candidate_ranks) > upper_us
    return run_metered(steps, meter, 0.0 if unsearched else work.setup_cost_us(world, num_experts))


def search_steps(counts: Sequence[Sequence[float]], owners: Sequence[int], costs: StepCostModel,
                 budget_per_rank: int, ranks_per_node: int,
                 start: Optional[Sequence[Sequence[int]]] = None,
                 prefetched: Optional[Sequence[Sequence[int]]] = None,
                 candidate_experts: int = 4, min_gain: float = 0.05,
                 budget_us: Union[float, RelativeBudget, None] = None, candidate_ranks: int = 64,
                 work: SearchWork = SEARCH_WORK,
                 critical_path: bool = False) -> Generator[Progress, None, Materialized]:
    """:func:`schedule_materialization` as a generator of :class:`Progress` before each search step (both passes;
    during the second the best so far is the first pass's result, the one its estimate is judged against).

    A fresh search before the gate (no ``start``, not ``critical_path``) also judges the proportional start
    (:mod:`.proportional`), first, its work part of the search's setup: the passes' best so far is shown as the
    proportional start wherever that beats it and the sharded placement by ``min_gain``, and the search returns it on
    the same terms. Why first: sliced over calls (:mod:`.sliced_search`), the calls meanwhile prefetch the best so far, and
    judged last it came in only when the passes ended (simulated a100-4x8 gpt-moe-s W4: the proportional start, 18%
    off the estimate, prefetched from the seventh call of a search that takes one step a call; with the node
    exchange's steps, from the fourteenth)."""
    world, num_experts = len(counts), len(owners)
    slots = fill_slots(num_experts, world, budget_per_rank)
    fill_us = work.fill_cost_us(slots * world, world, num_experts)
    limit = budget_upper_us(budget_us)
    judged = start is None and not critical_path and slots > 0 and (limit is None or fill_us <= limit)
    filled = fill_s = None
    if judged:
        filled = proportional_fill(counts, owners, slots)
        fill_s = estimate_layer(counts, owners, materialized_of(filled), costs, ranks_per_node,
                                prefetched=prefetched).time_s
    offset = fill_us if judged else 0.0
    passes = _passes(counts, owners, costs, budget_per_rank, ranks_per_node, start, prefetched, candidate_experts,
                     min_gain, budget_us, candidate_ranks, work, critical_path)
    fill_pays: Optional[bool] = None   # whether it beats the sharded placement (the passes' first best) by min_gain
    yielded = False
    while True:
        try:
            progress = next(passes)
        except StopIteration as end:
            result, done_us, result_s = end.value
            break
        yielded = True
        if filled is not None and fill_pays is None:
            fill_pays = float(_round12(fill_s)) < float(_round12(progress.best_time_s * (1.0 - min_gain)))
        if fill_pays and float(_round12(fill_s)) < float(_round12(progress.best_time_s)):
            progress = replace(progress, best_time_s=fill_s, best=filled)
        yield replace(progress, spent_us=progress.spent_us + offset)
    if filled is None:
        return result
    result_mat = holders_matrix(result, world, num_experts)
    if not yielded:   # the passes took no step: the judgement's work is announced here, so that a meter counts it
        yield Progress(done_us, fill_us, float("nan"), result_mat)
    if result_s is None:
        result_s = estimate_layer(counts, owners, result, costs, ranks_per_node, prefetched=prefetched).time_s
    sharded = int(result_mat.sum()) == num_experts   # the search kept the owners alone
    bar = result_s * (1.0 - min_gain) if sharded else result_s   # a kept result beat the owners by min_gain
    return materialized_of(filled) if float(_round12(fill_s)) < float(_round12(bar)) else result


def _passes(counts, owners, costs: StepCostModel, budget_per_rank: int, ranks_per_node: int, start, prefetched,
            candidate_experts: int, min_gain: float, budget_us, candidate_ranks: int, work: SearchWork,
            critical_path: bool) -> Generator[Progress, None, Tuple[Materialized, float, Optional[float]]]:
    """The greedy passes of :func:`search_steps`: (their placement, the work they took, its estimate where a pass
    computed it, else None)."""
    # the second pass answers the barrier of levels run at the wait: a stream-ordered runtime has none
    relays_possible = (costs.fanout > 0 and costs.relay_levels_exposed and not costs.relay_stream_ordered
                       and len(counts) - 1 > costs.fanout)
    search = dict(candidate_experts=candidate_experts, min_gain=min_gain, candidate_ranks=candidate_ranks, work=work)
    first = _greedy_steps(counts, owners, costs, budget_per_rank, ranks_per_node, start, prefetched,
                          budget_us=budget_us, pay_window=PAY_WINDOW if critical_path else 0, **search)
    done_us = work.setup_cost_us(len(counts), len(owners))   # a pass that yields no step still built its state
    while True:
        try:
            progress = next(first)
        except StopIteration as end:
            priced = end.value
            break
        done_us = progress.spent_us + progress.step_us
        yield progress
    if start is not None or not relays_possible:
        return priced, done_us, None
    estimate = estimate_layer(counts, owners, priced, costs, ranks_per_node, prefetched=prefetched)
    if estimate.imbalance <= FLOW_PASS_IMBALANCE:
        return priced, done_us, estimate.time_s
    second = _greedy_steps(counts, owners, replace(costs, relay_levels_exposed=False), budget_per_rank,
                           ranks_per_node, None, prefetched, budget_us=budget_us, **search)
    priced_mat = holders_matrix(priced, len(counts), len(owners))
    second_us = 0.0
    while True:
        try:
            progress = next(second)
        except StopIteration as end:
            flow = end.value
            break
        second_us = progress.spent_us + progress.step_us
        yield Progress(done_us + progress.spent_us, progress.step_us, estimate.time_s, priced_mat,
                       progress.last_gain_us)
    done_us += second_us
    if flow == priced:
        return priced, done_us, estimate.time_s
    flow_s = estimate_layer(counts, owners, flow, costs, ranks_per_node, prefetched=prefetched).time_s
    if float(_round12(flow_s)) < float(_round12(estimate.time_s)):
        return flow, done_us, flow_s
    return priced, done_us, estimate.time_s


def _next_stage(stage: int, last_stage: int, moved_since_stage0: bool) -> Tuple[int, bool]:
    """Where :func:`_greedy_steps` goes when its stage finds no move: the next stage; after the last, back to the
    first if a later stage moved since the first last stopped (a new placement may open single moves again);
    else ``-1``, the end."""
    if stage < last_stage:
        return stage + 1, moved_since_stage0
    if stage and moved_since_stage0:
        return 0, False
    return -1, moved_since_stage0


def _greedy(*args, **kwargs) -> Materialized:
    """:func:`_greedy_steps` run to its end."""
    return run_to_end(_greedy_steps(*args, **kwargs))


def _greedy_steps(counts: Sequence[Sequence[float]], owners: Sequence[int], costs: StepCostModel,
                  budget_per_rank: int, ranks_per_node: int,
                  start: Optional[Sequence[Sequence[int]]] = None,
                  prefetched: Optional[Sequence[Sequence[int]]] = None,
                  candidate_experts: int = 4, min_gain: float = 0.05,
                  budget_us: Union[float, RelativeBudget, None] = None, candidate_ranks: int = 64,
                  work: SearchWork = SEARCH_WORK, pay_window: int = 0) -> Generator[Progress, None, Materialized]:
    """Greedy replica placement minimising :func:`estimate_layer` under ``budget_per_rank`` extra experts/rank.

    Moves considered for the experts that load the bottleneck rank most: one new replica on one rank, a replica on
    every rank of one node that lacks the expert, and a replica on every rank that lacks it (see
    :func:`_candidate_moves`); when several ranks share the slowest time, one replica for each of them at once
    (:func:`_quota_move`); and, once those find nothing, before the gate only, the node exchange with one then two
    copies a node (:func:`_node_exchange_moves`), after which the moves above are tried again. Single replicas alone get stuck where local-first dispatch makes each new copy
    overload its own rank; the group moves are Algorithm 1's "replicate on all devices" as one option among
    others. A move is taken when it lowers the sorted profile of rank times (see :func:`_profile`); ties break on
    (expert, ranks); the result is the earliest placement on that path with the lowest layer time, kept only if it
    beats the starting placement by ``min_gain`` (a fraction): predicted loads are noisy, and replicas that promise
    a few percent cost more than they return when the routing moves. ``start`` is a placement to extend (the
    prefetched one, for calibration); by default the sharded placement. ``start`` and ``prefetched`` are per-rank
    expert lists or ``[ranks, experts]`` bool matrices.

    Anytime: with ``budget_us`` the search stops before a step whose estimated cost (:class:`SearchWork`, counted
    identically on every rank) would exceed the budget and returns the best placement found so far, never one
    worse than ``start``; a budget below the setup cost returns ``start`` unsearched. A :class:`RelativeBudget`
    becomes microseconds once the setup has estimated the start placement (checked against its cap before).

    The search is vectorised (numpy): a move changes the holders of one expert, so it is evaluated by swapping
    that expert's dispatch columns (:func:`dispatch_flows`, the same rule as :func:`rank_loads`), all moves of a
    search step in one batch. Rank times are those of :func:`estimate_layer` up to float rounding, which
    :func:`_profile`'s 12-digit rounding absorbs.

    A generator: before each step it yields a :class:`Progress` (work so far, the step's, the best placement so
    far), so that a caller may pause between steps and go on at a later call (:mod:`.sliced_search`); it returns
    the placement.
    """
    world, num_experts = len(counts), len(owners)
    spent = work.setup_cost_us(world, num_experts)
    upper_us = budget_upper_us(budget_us)
    if upper_us is not None and work.first_step_us(world, num_experts, candidate_experts,
                                                   candidate_ranks) > upper_us:
        holders = np.zeros((world, num_experts), dtype=bool)
        holders[np.asarray(owners, dtype=np.int64), np.arange(num_experts)] = True
        if start is not None:
            holders |= holders_matrix(start, world, num_experts)
        return materialized_of(holders)
    search = _Search(counts, owners, costs, ranks_per_node, start, prefetched)
    extra = (search.mat & ~search.owner_mask).sum(axis=1)

    best_times = search.times
    best_max = float(best_times.max())
    budget_us = budget_us_for(budget_us, best_max)
    # The search may pass through placements that only break a tie among the slowest ranks; what it returns is the
    # earliest placement with the lowest layer time, so no replica is kept that does not shorten the step.
    result_time, result_mat = best_max, search.mat.copy()
    threshold = best_max * (1.0 - min_gain)
    paid: List[Tuple[float, float]] = []   # (work, estimated gain) of each step taken, microseconds
    last_gain_us = 0.0
    # stage 0: the moves above; 1 and 2: the node exchange with one, then two copies a node, tried once the stage
    # before finds nothing, and only before the gate (a copy gathered after it is exposed, and what it saves on the
    # NICs is less than its weights). Why staged: proposed at every step, it cost the 1,024-rank searches of
    # DeepSeek-V3 a third more work and was never taken (simulated host planning 60 -> 123 ms a step)
    last_stage = 0 if pay_window else 2
    stage, moved_since_stage0 = 0, False
    while True:
        if stage == 0:
            ordered = _candidate_moves(search, best_times, extra, budget_per_rank, ranks_per_node,
                                       candidate_experts, candidate_ranks)
            quota = _quota_move(search, best_times, extra, budget_per_rank)
            exchanges = []
        else:
            ordered, quota = [], None
            exchanges = _node_exchange_moves(search, best_times, extra, budget_per_rank, copies=stage)
        if not ordered and quota is None and not exchanges:
            stage, moved_since_stage0 = _next_stage(stage, last_stage, moved_since_stage0)
            if stage < 0:
                break
            continue
        batched = (len(quota) if quota else 0) + sum(len(pairs) for pairs in exchanges)
        step_us = work.step_cost_us(len(ordered) + batched, world, num_experts)
        if budget_us is not None and spent + step_us > budget_us:
            break
        yield Progress(spent, step_us, result_time, result_mat, last_gain_us)
        spent += step_us
        times = search.evaluate(ordered) if ordered else np.zeros((0, world))
        # the moves of several replicas last: a single move that ties with them wins
        multi = ([quota] if quota is not None else []) + exchanges
        if multi:
            times = np.vstack([times] + [search.evaluate_many(pairs)[None, :] for pairs in multi])
        peaks = _round12(times.max(axis=1))
        tied = np.flatnonzero(peaks == peaks.min())
        profiles = -np.sort(-_round12(times[tied]), axis=1)
        pick = _lex_min(profiles)
        best_profile = -np.sort(-_round12(best_times))
        if not _lex_less(profiles[pick], best_profile):
            stage, moved_since_stage0 = _next_stage(stage, last_stage, moved_since_stage0)
            if stage < 0:
                break
            continue
        moved_since_stage0 = moved_since_stage0 or stage > 0
        chosen = int(tied[pick])
        pairs = multi[chosen - len(ordered)] if chosen >= len(ordered) else [(ordered[chosen][0], d)
                                                                              for d in ordered[chosen][1]]
        search.add_many(pairs)
        for _, d in pairs:
            extra[d] += 1
        gain_us = last_gain_us = _step_gain(best_times, search.times) * 1e6
        best_times = search.times
        best_max = float(best_times.max())
        if float(_round12(best_max)) < float(_round12(result_time)) and best_max <= threshold:
            result_time, result_mat = best_max, search.mat.copy()
        if pay_window:
            # on the critical path every rank waits for this search: stop once its last steps cost more host time
            # than they took off the layer's estimate
            paid.append((step_us, gain_us))
            window = paid[-pay_window:]
            if len(window) == pay_window and sum(g for _, g in window) < sum(c for c, _ in window):
                break
    return search.frozen(result_mat)
