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
The moves themselves, and why each exists, are in :mod:`.moves`, the search's state in :mod:`.state`, its settings
in :mod:`.settings`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Generator, List, Optional, Sequence, Tuple

import numpy as np
import numpy.ma  # noqa: F401  np.unique imports it on its first call (10 ms), which would land on a layer call

from ..cost_model import estimate_layer
from ..plan import FloatMatrix, IntMatrix, Materialized, holders_matrix, materialized_of
from .call_work import WorkMeter
from .moves import candidate_moves, node_exchange_moves, quota_move, round12
from .proportional import fill_slots, proportional_fill
from .settings import SearchSettings
from .state import SearchState
from .work import Progress, budget_upper_us, budget_us_for, run_metered, run_to_end


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
    rounded = round12(before)
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


def schedule_materialization(counts: FloatMatrix, owners: Sequence[int], settings: SearchSettings,
                             start: Optional[IntMatrix] = None,
                             prefetched: Optional[IntMatrix] = None,
                             meter: Optional[WorkMeter] = None) -> Materialized:
    """Replica placement minimising :func:`estimate_layer` under ``settings.replica_budget`` extra experts/rank: the
    greedy search :func:`greedy_steps` (its docstring has the moves, the acceptance rule and the anytime budget).
    ``start`` is a placement to extend (the prefetched one, for calibration); by default the sharded placement.
    ``start`` and ``prefetched`` are per-rank expert lists or ``[ranks, experts]`` bool matrices.

    With relay trees possible (``costs.fanout`` below the replicas an expert can get), a fresh search (no
    ``start``) whose placement leaves the compute imbalanced (max/mean pairs per rank above
    :data:`FLOW_PASS_IMBALANCE`) runs a second pass: the first prices the trees as the runtime runs them (the
    first level hidden, the deeper ones exposed with their pipeline's fill), the second prices every level as one
    hidden flow (``relay_levels_exposed`` False); the placement with the lower estimate under the first pricing
    wins, ties to it. Why: a replica that deepens an expert's tree costs an exposed level at once and pays off only
    once the expert is replicated widely, a barrier a one-move-at-a-time greedy stops at (64 ranks x 8 experts,
    skewed: 0.175 s, imbalance 3.4, against 0.069 s past it), while the flow pricing walks through it. Each pass
    gets the whole budget: with half each, the two passes left 256-rank layers up to a fifth slower than with the
    whole. Why only when imbalanced: where the first pass balanced the compute, the second never won on the
    simulated grid and only doubled the search's host time, which the simulator charges. Every rank computes the
    same. Calibration (``start`` given) extends its start with the first pricing alone (it is on the critical
    path).

    ``settings.critical_path``: every rank waits for this search (calibration after the gate), so it also stops
    once its last :data:`PAY_WINDOW` steps' estimated work exceeds what they took off the layer's estimate (both in
    microseconds of the same layer call, the work from the search's work model: every rank stops at the same
    step).

    ``meter``: add the search's work to it (:func:`~.work.run_metered`), what the simulator charges."""
    steps = search_steps(counts, owners, settings, start, prefetched)
    if meter is None:
        return run_to_end(steps)
    world, num_experts = len(counts), len(owners)
    unsearched = not _affords_a_step(settings, world, num_experts)
    return run_metered(steps, meter, 0.0 if unsearched else settings.work.setup_cost_us(world, num_experts))


def _affords_a_step(settings: SearchSettings, world: int, num_experts: int) -> bool:
    """Whether the budget's most (a relative one's cap) pays the setup and a first step."""
    upper_us = budget_upper_us(settings.budget_us)
    return upper_us is None or settings.work.first_step_us(world, num_experts, settings.candidate_experts,
                                                           settings.candidate_ranks) <= upper_us


def search_steps(counts: FloatMatrix, owners: Sequence[int], settings: SearchSettings,
                 start: Optional[IntMatrix] = None,
                 prefetched: Optional[IntMatrix] = None) -> Generator[Progress, None, Materialized]:
    """:func:`schedule_materialization` as a generator of :class:`Progress` before each search step (both passes;
    during the second the best so far is the first pass's result, the one its estimate is judged against).

    A fresh search before the gate (no ``start``, not ``critical_path``) also judges the proportional start
    (:mod:`.proportional`; the best of its fill levels, :func:`_best_fill`), first, its work part of the search's
    setup: the passes' best so far is shown as the proportional start wherever that beats it and the sharded
    placement by ``min_gain``, and the search returns it on the same terms. Why first: sliced over calls
    (:mod:`.sliced`), the calls meanwhile prefetch the best so far, and judged last it came in only when the passes
    ended (simulated a100-4x8 gpt-moe-s W4: the proportional start, 18% off the estimate, prefetched from the seventh
    call of a search that takes one step a call; with the node exchange's steps, from the fourteenth)."""
    s = settings
    world, num_experts = len(counts), len(owners)
    slots = fill_slots(num_experts, world, s.replica_budget)
    fill_us = s.work.fill_cost_us(slots * world, world, num_experts)
    limit = budget_upper_us(s.budget_us)
    judged = start is None and not s.critical_path and slots > 0 and (limit is None or fill_us <= limit)
    filled = fill_s = None
    if judged:
        filled, fill_s, fill_us = _best_fill(counts, owners, slots, s, prefetched, fill_us, limit)
    offset = fill_us if judged else 0.0
    passes = _passes(counts, owners, s, start, prefetched)
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
            fill_pays = float(round12(fill_s)) < float(round12(progress.best_time_s * (1.0 - s.min_gain)))
        if fill_pays and float(round12(fill_s)) < float(round12(progress.best_time_s)):
            assert filled is not None and fill_s is not None   # fill_pays is set only where there is a fill
            progress = replace(progress, best_time_s=fill_s, best=filled)
        yield replace(progress, spent_us=progress.spent_us + offset)
    if filled is None:
        return result
    result_mat = holders_matrix(result, world, num_experts)
    if not yielded:   # the passes took no step: the judgement's work is announced here, so that a meter counts it
        yield Progress(done_us, fill_us, float("nan"), result_mat)
    if result_s is None:
        result_s = estimate_layer(counts, owners, result, s.costs, s.ranks_per_node, prefetched=prefetched).time_s
    sharded = int(result_mat.sum()) == num_experts   # the search kept the owners alone
    bar = result_s * (1.0 - s.min_gain) if sharded else result_s   # a kept result beat the owners by min_gain
    return materialized_of(filled) if float(round12(fill_s)) < float(round12(bar)) else result


def _best_fill(counts, owners, slots: int, settings: SearchSettings, prefetched, full_us: float,
               limit: Optional[float]) -> Tuple[np.ndarray, float, float]:
    """The proportional start: (the holders of its cheapest fill level by the estimate, that estimate, the work of
    the judgement). The full fill (``slots`` replicas a rank, ``full_us`` of work) first, as before any level was
    judged, then the levels from one replica a rank up while their work fits within ``limit`` (None: no limit),
    up to the first level no cheaper than the one below it (past the cheapest level, more copies cost their
    holders more than they balance); ties to the full fill, then to fewer replicas. Every rank judges the same
    levels (the same inputs and work model).

    Why the lower levels: where the budget holds a rank's share of the experts again (small worlds) the full fill
    copies nearly every expert with load everywhere, and each copy costs its holder ``replica_overhead_s``. On two
    CPU ranks with a hot pair of rank 0's experts (8 experts, top-2) the greedy passes stopped at three copies on
    rank 1 (compute max/mean 1.21, 6.22 ms a layer by the estimate): a copy of the second hot expert then
    overloads rank 1 unless rank 0 takes back its own rows of two of rank 1's experts, two moves away, and the
    greedy never drops the cold copies it took first; the full fill (four copies a rank) was dearer still (6.72 ms).
    Two copies a rank is that exchange: 6.00 ms, max/mean 1.02."""
    world, num_experts, work = len(counts), len(owners), settings.work

    def judged(level: int) -> Tuple[np.ndarray, float]:
        held = proportional_fill(counts, owners, level)
        return held, estimate_layer(counts, owners, materialized_of(held), settings.costs, settings.ranks_per_node,
                                    prefetched=prefetched).time_s

    best_held, best_s = judged(slots)
    spent_us, below_s = full_us, None
    for level in range(1, slots):
        level_us = work.fill_level_cost_us(level * world, world, num_experts)
        if limit is not None and spent_us + level_us > limit:
            break
        spent_us += level_us
        held, time_s = judged(level)
        if float(round12(time_s)) < float(round12(best_s)):
            best_held, best_s = held, time_s
        if below_s is not None and float(round12(time_s)) >= float(round12(below_s)):
            break
        below_s = time_s
    return best_held, best_s, spent_us


def _passes(counts, owners, settings: SearchSettings, start,
            prefetched) -> Generator[Progress, None, Tuple[Materialized, float, Optional[float]]]:
    """The greedy passes of :func:`search_steps`: (their placement, the work they took, its estimate where a pass
    computed it, else None)."""
    costs, rpn = settings.costs, settings.ranks_per_node
    # the second pass answers the barrier of levels run at the wait: a stream-ordered runtime has none
    relays_possible = (costs.fanout > 0 and costs.relay_levels_exposed and not costs.relay_stream_ordered
                       and len(counts) - 1 > costs.fanout)
    priced, done = yield from _relayed(greedy_steps(counts, owners, settings, start, prefetched), lambda p: p)
    # a pass that yields no step still built its state
    done_us = settings.work.setup_cost_us(len(counts), len(owners)) if done is None else done
    if start is not None or not relays_possible:
        return priced, done_us, None
    estimate = estimate_layer(counts, owners, priced, costs, rpn, prefetched=prefetched)
    if estimate.imbalance <= FLOW_PASS_IMBALANCE:
        return priced, done_us, estimate.time_s
    flow_settings = replace(settings, costs=replace(costs, relay_levels_exposed=False), critical_path=False)
    priced_mat = holders_matrix(priced, len(counts), len(owners))
    flow, second_us = yield from _relayed(
        greedy_steps(counts, owners, flow_settings, None, prefetched),
        lambda p: Progress(done_us + p.spent_us, p.step_us, estimate.time_s, priced_mat, p.last_gain_us))
    done_us += 0.0 if second_us is None else second_us
    if flow == priced:
        return priced, done_us, estimate.time_s
    flow_s = estimate_layer(counts, owners, flow, costs, rpn, prefetched=prefetched).time_s
    if float(round12(flow_s)) < float(round12(estimate.time_s)):
        return flow, done_us, flow_s
    return priced, done_us, estimate.time_s


def _relayed(steps: Generator[Progress, None, Materialized],
             shown: Callable[[Progress], Progress]) -> Generator[Progress, None, Tuple[Materialized, Optional[float]]]:
    """A pass of :func:`_passes`: yields ``shown(p)`` for each :class:`Progress` ``p`` of ``steps``; returns (its
    placement, the work at the end of the last step it announced, None where it announced none)."""
    done: Optional[float] = None
    while True:
        try:
            progress = next(steps)
        except StopIteration as end:
            return end.value, done
        done = progress.spent_us + progress.step_us
        yield shown(progress)


def _next_stage(stage: int, last_stage: int, moved_since_stage0: bool) -> Tuple[int, bool]:
    """Where :func:`greedy_steps` goes when its stage finds no move: the next stage; after the last, back to the
    first if a later stage moved since the first last stopped (a new placement may open single moves again);
    else ``-1``, the end."""
    if stage < last_stage:
        return stage + 1, moved_since_stage0
    if stage and moved_since_stage0:
        return 0, False
    return -1, moved_since_stage0


def greedy_pass(counts: FloatMatrix, owners: Sequence[int], settings: SearchSettings,
                start: Optional[IntMatrix] = None,
                prefetched: Optional[IntMatrix] = None) -> Materialized:
    """One greedy pass (:func:`greedy_steps`) run to its end: the unit :class:`~.work.SearchWork` prices (a fresh
    :func:`schedule_materialization` may run two, and judges the proportional start)."""
    return run_to_end(greedy_steps(counts, owners, settings, start, prefetched))


def _proposals(search: SearchState, stage: int, best_times, extra,
               settings: SearchSettings) -> Tuple[List[Tuple[int, Tuple[int, ...]]], List[List[Tuple[int, int]]]]:
    """A step's moves at ``stage``: (single-expert moves, moves of several replicas). Stage 0: the moves for the
    bottleneck's experts and the quota move; 1 and 2: the node exchange with one, then two copies a node."""
    if stage == 0:
        ordered = candidate_moves(search, best_times, extra, settings.replica_budget, settings.ranks_per_node,
                                  settings.candidate_experts, settings.candidate_ranks)
        quota = quota_move(search, best_times, extra, settings.replica_budget)
        return ordered, ([quota] if quota is not None else [])
    return [], node_exchange_moves(search, best_times, extra, settings.replica_budget, copies=stage)


def _profiles(times):
    """Rank times sorted from slowest, rounded so that float noise never decides: the search compares these
    lexicographically, so a move that lowers one of several tied maxima counts as progress."""
    return -np.sort(-round12(times), axis=-1)


def _best_move(search: SearchState, ordered, multi, best_times) -> Optional[List[Tuple[int, int]]]:
    """The (expert, rank) pairs of the move with the lowest peak, then the smallest sorted profile (first on
    ties; the moves of several replicas last, so a single move that ties with them wins), or None where it does
    not lower the current profile. All moves are evaluated in one batch."""
    times = search.evaluate(ordered) if ordered else np.zeros((0, search.world))
    if multi:
        times = np.vstack([times] + [search.evaluate_many(pairs)[None, :] for pairs in multi])
    peaks = round12(times.max(axis=1))
    tied = np.flatnonzero(peaks == peaks.min())
    profiles = _profiles(times[tied])
    pick = _lex_min(profiles)
    if not _lex_less(profiles[pick], _profiles(best_times)):
        return None
    chosen = int(tied[pick])
    if chosen >= len(ordered):
        return multi[chosen - len(ordered)]
    return [(ordered[chosen][0], d) for d in ordered[chosen][1]]


def _unsearched(owners: Sequence[int], start, world: int, num_experts: int) -> Materialized:
    """The start (the owners with ``start``'s replicas), for a budget that cannot pay a first step."""
    holders = np.zeros((world, num_experts), dtype=bool)
    holders[np.asarray(owners, dtype=np.int64), np.arange(num_experts)] = True
    if start is not None:
        holders |= holders_matrix(start, world, num_experts)
    return materialized_of(holders)


def greedy_steps(counts: FloatMatrix, owners: Sequence[int], settings: SearchSettings,
                 start: Optional[IntMatrix] = None,
                 prefetched: Optional[IntMatrix] = None) -> Generator[Progress, None, Materialized]:
    """One greedy pass minimising :func:`estimate_layer`, as a generator: before each step a :class:`Progress` (work
    so far, the step's, the best placement so far), so that a caller may pause between steps and go on at a later
    call (:mod:`.sliced`); it returns the placement.

    Each step weighs the moves of :mod:`.moves` (:func:`_proposals`): for the bottleneck's experts, the quota move
    for tied ranks, and, once those find nothing and before the gate only, the node exchange with one then two
    copies a node, after which the moves above are tried again. A move is taken when it lowers the sorted profile
    of rank times (:func:`_best_move`); ties break on (expert, ranks); the result is the earliest placement on that
    path with the lowest layer time, kept only if it beats the start by ``min_gain`` (a fraction): predicted loads
    are noisy, and replicas that promise a few percent cost more than they return when the routing moves.

    Anytime: with ``budget_us`` the search stops before a step whose estimated cost (:class:`SearchWork`, counted
    identically on every rank) would exceed the budget and returns the best placement found so far, never one
    worse than ``start``; a budget below the setup cost returns ``start`` unsearched. A :class:`RelativeBudget`
    becomes microseconds once the setup has estimated the start placement (checked against its cap before).
    Vectorised (:mod:`.state`): rank times are those of :func:`estimate_layer` up to float rounding, which the
    profiles' 12-digit rounding absorbs."""
    s = settings
    world, num_experts = len(counts), len(owners)
    spent = s.work.setup_cost_us(world, num_experts)
    if not _affords_a_step(s, world, num_experts):
        return _unsearched(owners, start, world, num_experts)
    search = SearchState(counts, owners, s.costs, s.ranks_per_node, start, prefetched)
    extra = (search.mat & ~search.owner_mask).sum(axis=1)
    best_times = search.times
    best_max = float(best_times.max())
    budget_us = budget_us_for(s.budget_us, best_max)
    # The search may pass through placements that only break a tie among the slowest ranks; what it returns is the
    # earliest placement with the lowest layer time, so no replica is kept that does not shorten the step.
    result_time, result_mat = best_max, search.mat.copy()
    threshold = best_max * (1.0 - s.min_gain)
    paid: List[Tuple[float, float]] = []   # (work, estimated gain) of each step taken, microseconds
    last_gain_us = 0.0
    pay_window = PAY_WINDOW if s.critical_path else 0
    # stages 1 and 2 (the node exchange) only before the gate: a copy gathered after it is exposed, and what it
    # saves on the NICs is less than its weights. Why staged: proposed at every step, it cost the 1,024-rank
    # searches of DeepSeek-V3 a third more work and was never taken (simulated host planning 60 -> 123 ms a step)
    last_stage = 0 if pay_window else 2
    stage, moved_since_stage0 = 0, False
    while True:
        ordered, multi = _proposals(search, stage, best_times, extra, s)
        pairs = None
        if ordered or multi:
            step_us = s.work.step_cost_us(len(ordered) + sum(len(p) for p in multi), world, num_experts)
            if budget_us is not None and spent + step_us > budget_us:
                break
            yield Progress(spent, step_us, result_time, result_mat, last_gain_us)
            spent += step_us
            pairs = _best_move(search, ordered, multi, best_times)
        if pairs is None:
            stage, moved_since_stage0 = _next_stage(stage, last_stage, moved_since_stage0)
            if stage < 0:
                break
            continue
        moved_since_stage0 = moved_since_stage0 or stage > 0
        search.add_many(pairs)
        for _, d in pairs:
            extra[d] += 1
        gain_us = last_gain_us = _step_gain(best_times, search.times) * 1e6
        best_times = search.times
        best_max = float(best_times.max())
        if float(round12(best_max)) < float(round12(result_time)) and best_max <= threshold:
            result_time, result_mat = best_max, search.mat.copy()
        if pay_window:
            # on the critical path every rank waits for this search: stop once its last steps cost more host time
            # than they took off the layer's estimate
            paid.append((step_us, gain_us))
            if _stopped_paying(paid[-pay_window:], pay_window):
                break
    return search.frozen(result_mat)


def _stopped_paying(window: List[Tuple[float, float]], pay_window: int) -> bool:
    """Whether the last ``pay_window`` steps (work, estimated gain) cost more than they gained."""
    return len(window) == pay_window and sum(g for _, g in window) < sum(c for c, _ in window)
