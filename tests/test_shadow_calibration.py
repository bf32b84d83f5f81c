"""Calibration's first try (critical_path.shadow_calibration): a burst's expert on every rank with a free slot,
taken without a search where it balances the call and beats the prefetched placement; otherwise the search runs.
"""
from __future__ import annotations

import numpy as np
import pytest

from ds_hecate.planning.search import critical_path
from ds_hecate.planning.cost_model import StepCostModel, estimate_layer
from ds_hecate.planning.search import (SearchSettings, calibration_settings, plan_after_gate, schedule_materialization,
                                       shadow_calibration)
from ds_hecate.planning.plan import Placement, materialized_of, owned_experts
from ds_hecate.planning.search.reuse import ScheduleReuse
from ds_hecate.planning.sharding import even_sharding

WORLD, EXPERTS, RPN = 8, 16, 4
COSTS = StepCostModel(compute_s_per_pair=1e-5, token_transfer_s=1e-7, expert_transfer_s=1e-4, overlap_s=1e-3)
OWNERS = tuple(even_sharding(EXPERTS, WORLD))


def _owners_only() -> Placement:
    return Placement(OWNERS, owned_experts(OWNERS, WORLD))


def _burst(expert: int = 5, share: int = 600) -> np.ndarray:
    """Balanced routing but for one expert that draws most of every rank's pairs (W7's burst)."""
    counts = np.full((WORLD, EXPERTS), 20, dtype=np.int64)
    counts[:, expert] = share
    return counts


def _no_search(*args, **kwargs):
    raise AssertionError("searched although the shadow move balanced the call")


def test_a_burst_is_calibrated_by_its_expert_everywhere_without_a_search(monkeypatch):
    counts = _burst()
    monkeypatch.setattr(critical_path, "schedule_materialization", _no_search)
    after = plan_after_gate(counts, _owners_only(), ScheduleReuse(0.05), calibration_settings(COSTS, 4, RPN, None), 0,
                            True, speculative=False)
    holders = after.plan.placement.holders
    assert holders[:, 5].all() and after.extras is not None and not after.searched
    assert holders.sum() == EXPERTS + WORLD - 1                      # nothing else added
    estimate = estimate_layer(counts, OWNERS, after.plan.placement.materialized, COSTS, RPN,
                              prefetched=_owners_only().materialized)
    assert estimate.imbalance <= 1.05


def test_the_shadow_move_is_as_good_as_the_search_on_a_burst():
    """What the search would calibrate (its estimate) is not better than the shadow move by more than rounding."""
    counts = _burst()
    start = _owners_only()
    shadows = shadow_calibration(counts, start, SearchSettings(COSTS, 4, RPN), 0.05)
    searched = schedule_materialization(counts, OWNERS, SearchSettings(COSTS, 4, RPN, critical_path=True),
                                        start=start.holders, prefetched=start.holders)
    late = dict(prefetched=start.materialized)
    assert shadows is not None
    shadow_s = estimate_layer(counts, OWNERS, shadows, COSTS, RPN, **late).time_s
    assert shadow_s <= estimate_layer(counts, OWNERS, searched, COSTS, RPN, **late).time_s * (1 + 1e-9)


@pytest.mark.parametrize("case", ["no_hot_expert", "no_free_slot", "costlier_than_it_saves"])
def test_the_search_runs_where_the_shadow_move_does_not_pay(case):
    counts, budget, costs = _burst(), 4, COSTS
    if case == "no_hot_expert":   # no expert beyond a rank's fair share: nothing to shadow
        counts = np.full((WORLD, EXPERTS), 20, dtype=np.int64)
        counts[:, 3] = 40
    elif case == "no_free_slot":
        budget = 0
    else:   # expert copies so slow that moving them costs more than the imbalance
        costs = StepCostModel(compute_s_per_pair=1e-9, token_transfer_s=1e-9, expert_transfer_s=10.0)
    assert shadow_calibration(counts, _owners_only(), SearchSettings(costs, budget, RPN), 0.05) is None


def test_shadows_respect_the_budget_hottest_first():
    """Two bursts (experts 5 and 9, owned by ranks 2 and 4), two slots per rank, one taken by a prefetched replica
    on ranks 0-3: the hotter expert takes a slot everywhere; the other gets the slots left (ranks 2, its owner's
    slot unused, and 5-7), never beyond the budget."""
    counts = _burst(5, 900)
    counts[:, 9] = 400
    holders = [set(r) for r in owned_experts(OWNERS, WORLD)]
    for r in range(4):
        holders[r].add(14)
    prefetched = Placement(OWNERS, tuple(tuple(sorted(h)) for h in holders))
    shadows = shadow_calibration(counts, prefetched, SearchSettings(COSTS, 2, RPN), 1.0)
    assert shadows is not None
    owned = np.bincount(np.asarray(OWNERS), minlength=WORLD)
    assert ((shadows.sum(axis=1) - owned) <= 2).all()
    assert shadows[:, 5].all()                         # the hotter burst everywhere
    assert np.flatnonzero(shadows[:, 9]).tolist() == [2, 4, 5, 6, 7]


def test_the_shadow_move_is_judged_against_the_balance_the_schedule_was_planned_at():
    """A burst whose copies cannot reach rank 7 (its one slot holds a prefetched replica) leaves the compute 1.24
    imbalanced: rejected against a schedule planned balanced (the search's business), taken against one planned at
    1.2 (a node exchange keeps tokens home and runs the compute that imbalanced on purpose)."""
    counts = _burst()
    holders = _owners_only().holders.copy()
    holders[7, 0] = True
    prefetched = Placement(OWNERS, materialized_of(holders))
    assert shadow_calibration(counts, prefetched, SearchSettings(COSTS, 1, RPN), 0.05) is None
    shadows = shadow_calibration(counts, prefetched, SearchSettings(COSTS, 1, RPN), 0.05, planned_imbalance=lambda: 1.2)
    assert shadows is not None and shadows[:, 5].sum() == WORLD - 1


def test_the_planned_balance_is_asked_only_where_the_shadows_leave_the_compute_imbalanced():
    """A burst the shadow move balances within the tolerance never asks for the schedule's planned balance (a
    dispatch estimate on the critical path); one it leaves 1.24 imbalanced does."""
    asked = []

    def planned() -> float:
        asked.append(1)
        return 1.2

    assert shadow_calibration(_burst(), _owners_only(), SearchSettings(COSTS, 4, RPN), 0.05,
                              planned_imbalance=planned) is not None
    assert not asked
    holders = _owners_only().holders.copy()
    holders[7, 0] = True
    shadow_calibration(_burst(), Placement(OWNERS, materialized_of(holders)), SearchSettings(COSTS, 1, RPN), 0.05,
                       planned_imbalance=planned)
    assert asked == [1]
