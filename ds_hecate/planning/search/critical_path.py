"""What a layer call plans after its gate: the host work on the critical path, as one pure function.

Between the count exchange and the token all-to-all every rank runs, on the all-gathered counts: the score of the
load prediction, the decision whether calibration can pay, calibration itself (the remembered placement, the
shadow move, FasterMoE's growth, and an anytime search under ``plan_budget_us`` where the layer's searches pay),
and its own sends, receives and expert-major order (:mod:`.dispatch_plan`). The runtime calls
:func:`plan_after_gate` and then gathers the calibration extras; ``python -m benchmarks.planner`` times the same
call, so the figures in docs/benchmarks.md are the runtime's own code path.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, NamedTuple, Optional, Tuple

import numpy as np

from .call_work import CALL_WORK, WorkMeter
from ..dispatch_plan import DispatchPlan, RankDispatch
from ..placement import grow_hottest
from ..plan import Materialized, Placement, holders_matrix, materialized_of
from ..cost_model import StepCostModel, estimate_layer
from .greedy import schedule_materialization
from .reuse import ScheduleReuse
from .settings import SearchSettings
from .work import RelativeBudget, budget_upper_us, budget_us_for

#: ``plan_budget_us: null``: calibration may spend this share of the layer's estimated time (under the prefetched
#: placement, as the search's setup estimates it), within floor and cap
AUTO_BUDGET_SHARE = 0.05
AUTO_BUDGET_FLOOR_US = 1000.0
AUTO_BUDGET_CAP_US = 20000.0
AUTO_PLAN_BUDGET = RelativeBudget(AUTO_BUDGET_SHARE, AUTO_BUDGET_FLOOR_US, AUTO_BUDGET_CAP_US)


def calibration_settings(costs: StepCostModel, replica_budget: int, ranks_per_node: int,
                         plan_budget_us: Optional[float]) -> SearchSettings:
    """The settings of calibration's search (and of the shadow move and the growth before it): on the critical
    path, within ``hecate.plan_budget_us`` (None: :data:`AUTO_PLAN_BUDGET`)."""
    return SearchSettings(costs, replica_budget, ranks_per_node,
                          budget_us=AUTO_PLAN_BUDGET if plan_budget_us is None else plan_budget_us, critical_path=True)


@dataclass(frozen=True)
class AfterGate:
    """The plan of one call, this rank's part of it, the replicas calibration added (None: none), whether
    calibration searched at all (it may search and keep the prefetched placement), whether it took the
    remembered calibration instead of searching, whether it took the shadow move (:func:`shadow_calibration`)
    instead, and whether it took the growth's placement without a search (:func:`growth_calibration`; the layer's
    searches had not been paying, :mod:`.record`)."""

    plan: DispatchPlan
    mine: RankDispatch
    extras: Optional[Placement]
    searched: bool = False
    remembered: bool = False
    shadowed: bool = False
    work_us: float = 0.0   # what the call's planning did, in estimated microseconds (:mod:`.call_work`)
    grown: bool = False


def calibration_extras(calibrated: Placement, prefetched: np.ndarray) -> Placement:
    """What calibration gathers after the gate: the replicas the prefetched holders lack (owners listed too, as
    every placement does)."""
    extra = calibrated.holders & ~prefetched
    extra[np.asarray(calibrated.owners, dtype=np.int64), np.arange(len(calibrated.owners))] = True
    return Placement(calibrated.owners, materialized_of(extra))


def shadow_calibration(counts: np.ndarray, prefetched: Placement, settings: SearchSettings, tolerance: float,
                       meter: Optional[WorkMeter] = None,
                       planned_imbalance: Optional[Callable[[], float]] = None) -> Optional[np.ndarray]:
    """Calibration's first try, FasterMoE's move: every expert one rank cannot hold alone (its pairs exceed a
    rank's fair share of the call's) added on every rank with a free slot, taken (``[ranks, experts]`` bool holders)
    when its estimate beats the prefetched placement's by ``settings.min_gain`` and leaves the expert compute within
    ``tolerance`` of balanced, or of the balance the prefetched schedule was planned at (``planned_imbalance``, asked
    only then: max/mean, above 1.0 where its replicas keep tokens on their node on purpose; None: balanced); else
    None, and the search runs.

    Why: a burst (W7) or a hot spot that just moved (W6) is one or two experts everywhere, which the search finds
    in its first step and then spends two more confirming that nothing else pays (its pay window), three steps of
    a few milliseconds each on the critical path (simulated a100-4x8 bert-moe W7, 32 ranks x 64 experts: 8.5 ms
    of host time per layer call on a CPU, uncharged a tie with the FasterMoE-style
    baseline, charged 4% behind it); this costs two estimates. Priced as the search prices calibration: the
    added copies gathered after the gate, exposed."""
    world, num_experts = counts.shape
    costs, ranks_per_node = settings.costs, settings.ranks_per_node
    loads = counts.sum(axis=0)
    hot = np.flatnonzero(loads * world > loads.sum())
    if not hot.size:
        return None
    holders = prefetched.holders
    owned = np.bincount(np.asarray(prefetched.owners, dtype=np.int64), minlength=world)
    room = settings.replica_budget - (holders.sum(axis=1) - owned)
    shadows = holders.copy()
    for e in hot[np.argsort(-loads[hot], kind="stable")]:   # hottest first while slots last
        open_ranks = ~shadows[:, e] & (room > 0)
        shadows[open_ranks, e] = True
        room -= open_ranks
    if (shadows == holders).all():
        return None
    estimate_us = CALL_WORK.estimate_cost_us(world, num_experts)
    after = estimate_layer(counts, prefetched.owners, shadows, costs, ranks_per_node, prefetched=holders)
    if meter is not None:
        meter.add(estimate_us)
    if after.imbalance > 1.0 + tolerance:   # not balanced, unless the schedule itself was not: the search's business
        planned = planned_imbalance() if planned_imbalance is not None else 1.0
        if after.imbalance > planned * (1.0 + tolerance):
            return None
    before = estimate_layer(counts, prefetched.owners, holders, costs, ranks_per_node, prefetched=holders)
    if meter is not None:
        meter.add(estimate_us)
    return shadows if after.time_s <= before.time_s * (1.0 - settings.min_gain) else None


class Growth(NamedTuple):
    """What :func:`growth_calibration` placed: holders ``[ranks, experts]`` bool, their estimate and the prefetched
    placement's estimate (seconds)."""

    holders: np.ndarray
    time_s: float
    prefetched_s: float


def growth_calibration(counts: np.ndarray, prefetched: Placement, settings: SearchSettings,
                       meter: Optional[WorkMeter] = None) -> Optional[Growth]:
    """Calibration's second try, FasterMoE's growth: the experts by load, hottest first (ties on the expert id),
    each added on every rank that lacks it and has a free slot, while that lowers :func:`estimate_layer` (priced as
    calibration: the added copies gathered after the gate, exposed); stops at the first expert that does not, or
    before an estimate the calibration budget (``settings.budget_us``, a relative one resolved from the prefetched
    placement's estimate) cannot pay. The grown placement where it beats the prefetched one by ``min_gain``, else
    the prefetched holders; None where the budget cannot pay two estimates (large worlds: the search alone).

    Why beside the search: it costs one estimate per expert it tries (three or four on a burst) where the search
    costs its setup and at least two steps, and on small layers it takes most of what a burst offers; the search
    runs too only where the layer's searches have been paying (:mod:`.record`). Not the search's start: a
    hot expert on every rank spends a slot on each, which the search cannot take back (it only adds), and from there
    it places bursts of 64 ranks x 256 experts half to three quarters slower than the growth does."""
    owners = prefetched.owners
    holders = prefetched.holders
    budget_us = settings.budget_us
    estimate_us = CALL_WORK.estimate_cost_us(*counts.shape)
    upper_us = budget_upper_us(budget_us)   # None: unbounded
    if upper_us is not None and 2 * estimate_us > upper_us:
        return None
    spent_us, limit_us = 0.0, float("inf")

    def estimate(candidate: np.ndarray) -> float:
        nonlocal spent_us, limit_us
        spent_us += estimate_us
        if meter is not None:
            meter.add(estimate_us)
        time_s = estimate_layer(counts, owners, candidate, settings.costs, settings.ranks_per_node,
                                prefetched=holders).time_s
        if limit_us == float("inf"):   # the first estimate, the prefetched placement's, resolves a relative budget
            limit_us = budget_us_for(budget_us, time_s) if budget_us is not None else float("inf")
        return time_s

    owned = np.bincount(np.asarray(owners, dtype=np.int64), minlength=counts.shape[0])
    grown, best_s, start_s = grow_hottest(counts.sum(axis=0), holders,
                                          settings.replica_budget - (holders.sum(axis=1) - owned),
                                          estimate, lambda: spent_us + estimate_us <= limit_us)
    if best_s > start_s * (1.0 - settings.min_gain):
        grown, best_s = holders, start_s
    return Growth(grown, best_s, start_s)


def calibration_affordable(world: int, num_experts: int, settings: SearchSettings) -> bool:
    """Whether calibration's budget (``settings.budget_us``; a relative one's cap) pays the search's setup and a
    first step: beyond that (large worlds) calibration is off."""
    return _affordable(world, num_experts, settings.budget_us, settings.work, settings.candidate_experts,
                       settings.candidate_ranks)


@lru_cache(maxsize=64)
def _affordable(world: int, num_experts: int, budget, work, candidate_experts: int, candidate_ranks: int) -> bool:
    """:func:`calibration_affordable`, one answer per shape and settings (on every call, recomputed, it cost 15 us
    of a 64 x 256 call on a CPU)."""
    upper_us = budget_upper_us(budget)
    return upper_us is None or work.first_step_us(world, num_experts, candidate_experts, candidate_ranks) <= upper_us


def plan_after_gate(counts: np.ndarray, prefetched: Placement, schedule: ScheduleReuse, settings: SearchSettings,
                    rank: int, calibration: bool, speculative: bool = True,
                    start: Optional[np.ndarray] = None) -> AfterGate:
    """Plan one call from the exchanged ``counts`` (``[ranks, experts]`` int64) and the prefetched placement.

    Calibration re-plans only when the prediction missed and the step would run imbalanced
    (:meth:`ScheduleReuse.after_gate`); while the counts stay where the last calibration placed for, it takes that
    placement joined with the prefetched one without a search (:meth:`ScheduleReuse.calibrated_fit`); else, where
    the hot experts on every rank balance the call (:func:`shadow_calibration`), those; else FasterMoE's growth
    (:func:`growth_calibration`), extended by a search within ``settings.budget_us`` (:func:`calibration_settings`)
    where the layer's last searches paid for their host time (:mod:`.record`).
    ``speculative``: the prefetched placement holds replicas for a prediction (False: only the owners and the
    start layout). What calibration placed is remembered (:meth:`ScheduleReuse.remember_calibration`), from a
    speculative start only what it added, with the owners and ``start`` (the start layout, ``[ranks, experts]``
    bool, which every schedule holds): the prediction's leftovers, remembered, would be prefetched again and pile up
    over the moves of a rotating hot spot (simulated W6, 131 replicas a layer instead of 77), while what it added
    lets the next call, prefetched without the prediction, calibrate without a second search (simulated a100-4x8
    bert-moe W6: 10 ms of host time per move of the hot spot on a CPU). Where the budget
    cannot pay the search's setup and a first step (large worlds), calibration is off, as with
    ``calibration: false``: no scoring, no estimate on the critical path.
    """
    placement, extras = prefetched, None
    meter = WorkMeter()
    meter.add(CALL_WORK.call_cost_us(*counts.shape))
    schedule.scored = False
    ranks_per_node = settings.ranks_per_node
    calibrating = (calibration and calibration_affordable(counts.shape[0], counts.shape[1], settings)
                   and schedule.after_gate(counts, prefetched.holders, ranks_per_node, speculative))
    if schedule.scored:
        meter.add(CALL_WORK.score_cost_us(*counts.shape))
    known = shadows = None
    searched = False
    if calibrating:
        holders = prefetched.holders
        known = schedule.calibrated_fit(counts, prefetched.owners, holders, settings.replica_budget)
        shadows = None if known is not None else shadow_calibration(
            counts, prefetched, settings, schedule.tolerance, meter=meter,
            planned_imbalance=(lambda: schedule.planned_imbalance(ranks_per_node, meter)) if speculative else None)
        if known is not None:   # routing that stayed where the last calibration placed for: no search
            calibrated = materialized_of(known)
        elif shadows is not None:   # a burst: its experts everywhere, no search
            calibrated = materialized_of(shadows)
        else:
            calibrated, searched = _grow_then_search(counts, prefetched, schedule, settings, meter)
        if calibrated != prefetched.materialized:
            meter.add(CALL_WORK.tables_cost_us(*counts.shape))   # its dispatch tables are built on this call
            placement = Placement(prefetched.owners, calibrated)
            extras = calibration_extras(placement, holders)
            if known is None:
                remembered = calibrated
                if speculative:   # what calibration added, not the prediction's leftovers
                    kept = extras.holders if start is None else extras.holders | start
                    remembered = materialized_of(kept)
                schedule.remember_calibration(remembered, counts, prefetched.owners)
    plan = DispatchPlan.build(counts, placement, ranks_per_node, counted=True)
    return AfterGate(plan, plan.for_rank(rank), extras, searched, known is not None, shadows is not None, meter.us,
                     calibrating and known is None and shadows is None and not searched)


def _grow_then_search(counts: np.ndarray, prefetched: Placement, schedule: ScheduleReuse, settings: SearchSettings,
                      meter: WorkMeter) -> Tuple[Materialized, bool]:
    """Calibration past the remembered placement and the shadow move: the growth (:func:`growth_calibration`),
    and, where the layer's searches have been paying or the search's budget is a negligible share of the layer
    (:class:`~.record.SearchRecord`), the search from the prefetched placement; the faster of the two by the
    estimate (ties: the growth's), and the search's net over the growth recorded. Each within the calibration
    budget (``settings.budget_us``): the search keeps its whole budget (taking the growth's
    work out of it cut the search short on 8 x 64 bursts, 3% slower placements by the estimate), so calibration's
    work is at most twice it. Where the budget cannot pay the growth, the search alone, as before the growth
    existed. Returns (the placement, whether the search ran)."""
    holders = prefetched.holders
    growth = growth_calibration(counts, prefetched, settings, meter=meter)
    if growth is None:
        return schedule_materialization(counts, prefetched.owners, settings, start=holders, prefetched=holders,
                                        meter=meter), True
    record = schedule.search_record
    budget_s = (float("inf") if settings.budget_us is None
                else budget_us_for(settings.budget_us, growth.prefetched_s) * 1e-6)
    if not record.pays(budget_s / growth.prefetched_s if growth.prefetched_s > 0 else float("inf")):
        record.skipped()
        return materialized_of(growth.holders), False
    before_us = meter.us
    found = schedule_materialization(counts, prefetched.owners, settings, start=holders, prefetched=holders,
                                     meter=meter)
    found_holders = holders_matrix(found, *counts.shape)
    found_s = growth.prefetched_s
    if (found_holders != holders).any():   # what the search found, estimated once to weigh it against the growth
        meter.add(CALL_WORK.estimate_cost_us(*counts.shape))
        found_s = estimate_layer(counts, prefetched.owners, found_holders, settings.costs, settings.ranks_per_node,
                                 prefetched=holders).time_s
    record.searched(max(0.0, growth.time_s - found_s) * 1e6, meter.us - before_us)
    return (found if found_s < growth.time_s else materialized_of(growth.holders)), True
