"""The remembered calibration (ScheduleReuse.calibrated): after routing moves for good, calibration places once
and the calls after it take that placement instead of searching again after the gate; from a speculative start
only what it added, never beyond the budget, kept across a checkpoint. And the schedule outlives an outlier call: routing back
after a burst reuses it."""
from __future__ import annotations

import numpy as np
import pytest

from ds_hecate.planning.search import critical_path
from ds_hecate.planning.cost_model import StepCostModel
from ds_hecate.planning.search import SearchSettings, calibration_settings, plan_after_gate
from ds_hecate.planning.layer_planner import LayerPlanner, PlanInputs, PlannerSettings
from ds_hecate.planning.plan import Placement, owned_experts
from ds_hecate.planning.search.reuse import ScheduleReuse
from ds_hecate.planning.search.record import SearchRecord
from ds_hecate.planning.sharding import even_sharding

WORLD, EXPERTS, RPN = 8, 16, 4
COSTS = StepCostModel(compute_s_per_pair=1e-5, token_transfer_s=1e-7, expert_transfer_s=1e-4, overlap_s=1e-3)
OWNERS = tuple(even_sharding(EXPERTS, WORLD))


def _hot_on(owner: int) -> np.ndarray:
    """Every rank sends most of its pairs to the experts of ``owner`` (W6's hot set on one owner)."""
    counts = np.full((WORLD, EXPERTS), 10, dtype=np.int64)
    for e in owned_experts(OWNERS, WORLD)[owner]:
        counts[:, e] = 400
    return counts


def _owners_only() -> Placement:
    return Placement(OWNERS, owned_experts(OWNERS, WORLD))


@pytest.fixture(autouse=True)
def _searching_calibration(monkeypatch):
    """These tests are about the memory and the search: hot sets that the shadow move alone would balance
    (critical_path.shadow_calibration, tests/test_shadow_calibration.py) go to the search here, whatever the layer's
    record of what its searches saved (search_record, tests/test_search_record.py)."""
    monkeypatch.setattr(critical_path, "shadow_calibration", lambda *args, **kwargs: None)
    monkeypatch.setattr(SearchRecord, "pays", lambda self, budget_share=float("inf"): True)


def _no_search(*args, **kwargs):
    raise AssertionError("searched although the remembered calibration fits")


def test_calibration_from_the_owners_is_remembered_and_taken_again_without_a_search(monkeypatch):
    schedule = ScheduleReuse(0.05)
    hot = _hot_on(2)
    first = plan_after_gate(hot, _owners_only(), schedule, calibration_settings(COSTS, 4, RPN, None), 0, True,
                            speculative=False)
    assert first.searched and first.extras is not None
    assert schedule.calibrated is not None and schedule.calibrated[0] == first.plan.materialized
    monkeypatch.setattr(critical_path, "schedule_materialization", _no_search)
    again = plan_after_gate(hot, _owners_only(), schedule, calibration_settings(COSTS, 4, RPN, None), 0, True,
                            speculative=False)
    assert again.remembered and not again.searched and not first.remembered
    assert again.plan.materialized == first.plan.materialized
    assert again.extras is not None and first.extras is not None
    assert again.extras.materialized == first.extras.materialized


def test_other_counts_search_again(monkeypatch):
    schedule = ScheduleReuse(0.05)
    plan_after_gate(_hot_on(2), _owners_only(), schedule, calibration_settings(COSTS, 4, RPN, None), 0, True,
                    speculative=False)
    monkeypatch.setattr(critical_path, "schedule_materialization", _no_search)
    with pytest.raises(AssertionError, match="searched although"):
        plan_after_gate(_hot_on(5), _owners_only(), schedule, calibration_settings(COSTS, 4, RPN, None), 0, True,
                        speculative=False)


def test_from_a_speculative_start_only_what_calibration_added_is_remembered(monkeypatch):
    """Calibration that extends a prediction's replicas (the old hot spot's, on owner 5's experts) keeps them for
    this call, but remembers only what it added, with the owners: remembered, the prediction's leftovers would be
    prefetched again and pile up. The next call, prefetched without the prediction, takes the remembered placement
    without a search (a second search per move of the hot spot, before)."""
    schedule = ScheduleReuse(0.05)
    old_hot = owned_experts(OWNERS, WORLD)[5]
    speculative = [list(r) for r in owned_experts(OWNERS, WORLD)]
    for r in (0, 1, 2, 3):
        speculative[r] = sorted(set(speculative[r]) | set(old_hot))
    prefetched = Placement(OWNERS, tuple(tuple(r) for r in speculative))
    after = plan_after_gate(_hot_on(2), prefetched, schedule, calibration_settings(COSTS, 4, RPN, None), 0, True)
    assert after.extras is not None
    assert all(set(old_hot) <= set(after.plan.placement.materialized[r]) for r in (0, 1, 2, 3))   # kept this call
    assert schedule.calibrated is not None
    remembered = schedule.calibrated[0]
    added = after.extras.holders
    assert not any(e in remembered[r] for r in (0, 1, 2, 3) for e in old_hot)   # not remembered
    assert all(set(np.flatnonzero(added[r])) == set(remembered[r]) for r in range(WORLD))
    monkeypatch.setattr(critical_path, "schedule_materialization", _no_search)
    again = plan_after_gate(_hot_on(2), _owners_only(), schedule, calibration_settings(COSTS, 4, RPN, None), 0, True,
                            speculative=False)
    assert again.remembered and again.extras is not None


def test_the_join_with_the_prefetched_placement_respects_the_budget():
    schedule = ScheduleReuse(0.05)
    hot = _hot_on(2)
    after = plan_after_gate(hot, _owners_only(), schedule, calibration_settings(COSTS, 4, RPN, None), 0, True,
                            speculative=False)
    holders = after.plan.placement.holders
    budget = int((holders.sum(axis=1) - 2).max())     # two owned experts a rank
    assert schedule.calibrated_fit(hot, OWNERS, _owners_only().holders, budget) is not None
    # prefetched replicas of other experts on the busiest rank push the join over the budget
    busiest = int(np.argmax(holders.sum(axis=1)))
    crowded = _owners_only().holders.copy()
    free = np.flatnonzero(~holders[busiest])
    crowded[busiest, free[0]] = True
    assert schedule.calibrated_fit(hot, OWNERS, crowded, budget) is None
    assert schedule.calibrated_fit(hot, OWNERS, crowded, budget + 1) is not None
    # other owners (a re-sharding): never
    assert schedule.calibrated_fit(hot, tuple(reversed(OWNERS)), _owners_only().holders, budget + 1) is None


def test_the_remembered_calibration_survives_a_checkpoint():
    schedule = ScheduleReuse(0.05)
    plan_after_gate(_hot_on(2), _owners_only(), schedule, calibration_settings(COSTS, 4, RPN, None), 0, True,
                    speculative=False)
    state = schedule.state_dict()
    assert ScheduleReuse.state_fits(state, WORLD, EXPERTS)
    assert not ScheduleReuse.state_fits(state, WORLD, EXPERTS + 1)
    broken = dict(state, calibrated=dict(state["calibrated"], owners=[WORLD] * EXPERTS))
    assert not ScheduleReuse.state_fits(broken, WORLD, EXPERTS)
    restored = ScheduleReuse(0.05)
    restored.load_state_dict(state, SearchSettings(COSTS, 4, RPN))
    assert restored.calibrated is not None and schedule.calibrated is not None
    assert restored.calibrated[0] == schedule.calibrated[0] and restored.calibrated[2] == schedule.calibrated[2]
    assert np.array_equal(restored.calibrated[1], schedule.calibrated[1])


def test_a_rotating_hot_spot_calibrates_with_a_search_once_per_move():
    """W6 in small: the hot set moves to another owner and stays. The first call after the move extends the old
    routing's prefetched replicas (a search; what it added is remembered); the next ones, prefetching only the
    owners (the window disagrees with its newest call), take the remembered placement without a search until the
    window follows."""
    planner = LayerPlanner(PlannerSettings(ranks_per_node=RPN), WORLD, EXPERTS)
    inputs = PlanInputs(OWNERS, COSTS, 4)
    searched, remembered = [], []
    for step in range(24):
        counts = _hot_on(1 if step < 12 else 5)
        prefetched = planner.prefetch_placement(inputs)
        after = planner.plan_call(counts, inputs, prefetched, 0)
        planner.observe(counts)
        searched.append(after.searched)
        remembered.append(after.remembered)
        # every call's plan balances the hot set: its experts are held beyond their owner
        held = after.plan.placement.holders[:, list(owned_experts(OWNERS, WORLD)[1 if step < 12 else 5])]
        assert held.sum() > 2, step
    assert [s for s in range(12, 24) if searched[s]] == [12], searched
    assert remembered[13] and remembered[14], remembered     # the window still disagrees: from the memory


def test_routing_back_after_a_burst_reuses_the_schedule_without_a_search():
    """W7 in small: skewed routing with a schedule, one call's burst on another owner's experts, then the old routing
    again. The burst call prefetches nothing speculative and calibrates; the schedule made before it stays, so the
    calls after the burst reuse it instead of searching again."""
    planner = LayerPlanner(PlannerSettings(ranks_per_node=RPN), WORLD, EXPERTS)
    inputs = PlanInputs(OWNERS, COSTS, 4)
    searches = []
    for step in range(16):
        counts = _hot_on(6) if step == 10 else _hot_on(1)
        prefetched = planner.prefetch_placement(inputs)
        after = planner.plan_call(counts, inputs, prefetched, 0)
        planner.observe(counts)
        searches.append(planner.schedule.searches)
        if step == 10:
            assert after.searched, "the burst calibrates after the gate"
        # every call balances its hot set, the call after the burst too (it prefetched only the owners, and
        # calibration must not take the kept schedule for what was prefetched)
        hot = list(owned_experts(OWNERS, WORLD)[6 if step == 10 else 1])
        assert after.plan.placement.holders[:, hot].sum() > 2, step
    # one search before the gate for the steady routing, none after the burst
    assert searches[-1] == searches[9] == 1, searches
