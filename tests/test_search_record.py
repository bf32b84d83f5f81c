"""Calibration's search runs where it has been paying (planning.search.record): FasterMoE's growth first
(critical_path.growth_calibration), the search beside it while the layer's last searches saved more estimated layer
time below the growth's placement than their own work, else after PROBE_INTERVAL calibrations without one."""
from __future__ import annotations

import numpy as np
import pytest

from ds_hecate.planning.search import critical_path
from ds_hecate.planning.cost_model import StepCostModel, estimate_layer
from ds_hecate.planning.search import SearchSettings, calibration_settings, growth_calibration, plan_after_gate
from ds_hecate.planning.plan import Placement, owned_experts
from ds_hecate.planning.search.reuse import ScheduleReuse
from ds_hecate.planning.search.record import NEGLIGIBLE_SHARE, PROBE_INTERVAL, RECORD_LENGTH, SearchRecord
from ds_hecate.planning.sharding import even_sharding

WORLD, EXPERTS, RPN = 8, 16, 4
OWNERS = tuple(even_sharding(EXPERTS, WORLD))
#: transfers cheap against compute: the growth's hot expert on every rank is what the search finds too
CHEAP = StepCostModel(compute_s_per_pair=1e-5, token_transfer_s=1e-7, expert_transfer_s=1e-4, overlap_s=1e-3)
#: transfers dear: a hot expert on every rank floods its owner's links, a few copies are what pays
DEAR = StepCostModel(compute_s_per_pair=1e-3, token_transfer_s=1e-7, expert_transfer_s=0.3, overlap_s=1e-3)


def _owners_only() -> Placement:
    return Placement(OWNERS, owned_experts(OWNERS, WORLD))


def _moving_hot(call: int, second: bool) -> np.ndarray:
    """A hot expert (and, with ``second``, a warm one beside it) that moves on every call, so the remembered
    calibration never fits the next call."""
    counts = np.full((WORLD, EXPERTS), 10, dtype=np.int64)
    hot = (call * 5) % EXPERTS
    counts[:, hot] = 300 if second else 400
    if second:
        counts[:, (hot + 1) % EXPERTS] = 250
    return counts


@pytest.fixture(autouse=True)
def _no_shadow_move(monkeypatch):
    """The shadow move would take these single hot experts before the growth; these tests are about what follows."""
    monkeypatch.setattr(critical_path, "shadow_calibration", lambda *args, **kwargs: None)


def _calls(costs: StepCostModel, second: bool, n: int, schedule: ScheduleReuse):
    settings = calibration_settings(costs, 4, RPN, None)
    return [plan_after_gate(_moving_hot(call, second), _owners_only(), schedule, settings, 0, True, speculative=False)
            for call in range(n)]


def test_searches_that_do_not_pay_are_skipped_then_probed():
    schedule = ScheduleReuse(0.05)
    calls = _calls(CHEAP, False, 2 * PROBE_INTERVAL + 3, schedule)
    searched = [c.searched for c in calls]
    probe = PROBE_INTERVAL + 1
    assert searched == [i % probe == 0 for i in range(len(calls))], searched
    assert all(c.grown for c in calls if not c.searched)
    # the search found nothing below the growth's placement: each net is its work, negative
    assert all(net < 0 for net in schedule.search_record.nets_us)
    # the growth alone balanced every call: each moving hot expert held beyond its owner
    for call, after in enumerate(calls):
        assert after.plan.placement.holders[:, (call * 5) % EXPERTS].sum() > 1, call


def test_a_search_negligible_against_the_layer_runs_whatever_the_record():
    """CHEAP's calls a hundred times slower: the same decisions by the estimate, but the automatic budget is capped
    (20 ms) far below 5% of the layer, so a search costs under NEGLIGIBLE_SHARE of it and runs on every call, though
    it finds nothing below the growth (each net negative)."""
    slow = StepCostModel(compute_s_per_pair=1e-3, token_transfer_s=1e-5, expert_transfer_s=1e-2, overlap_s=1e-1)
    schedule = ScheduleReuse(0.05)
    calls = _calls(slow, False, PROBE_INTERVAL + 3, schedule)
    start_s = estimate_layer(_moving_hot(0, False), OWNERS, _owners_only().materialized, slow, RPN).time_s
    assert critical_path.AUTO_BUDGET_CAP_US * 1e-6 / start_s <= NEGLIGIBLE_SHARE
    assert all(c.searched for c in calls)
    assert schedule.search_record.nets_us and all(net < 0 for net in schedule.search_record.nets_us)


def test_searches_that_pay_keep_running_and_beat_the_growth():
    schedule = ScheduleReuse(0.05)
    calls = _calls(DEAR, True, PROBE_INTERVAL + 4, schedule)
    assert all(c.searched for c in calls)
    assert sum(schedule.search_record.nets_us) > 0
    for call, after in enumerate(calls):   # each took the search's placement, faster than the growth's
        counts = _moving_hot(call, True)
        grown = growth_calibration(counts, _owners_only(),
                                   SearchSettings(DEAR, 4, RPN, budget_us=critical_path.AUTO_PLAN_BUDGET))
        assert grown is not None
        taken = estimate_layer(counts, OWNERS, after.plan.materialized, DEAR, RPN,
                               prefetched=_owners_only().materialized).time_s
        assert taken < grown.time_s, call


def test_growth_takes_the_hottest_experts_while_the_estimate_falls():
    """FasterMoE's growth, checked against its definition: the prefixes of the experts by load, each on every rank
    with room, up to the first that does not lower the estimate, kept only past the 5% gain."""
    rng = np.random.default_rng(4)
    for trial in range(6):
        counts = rng.integers(0, 30, (WORLD, EXPERTS)).astype(np.int64)
        counts[:, rng.choice(EXPERTS, 3, replace=False)] += rng.integers(100, 400, (WORLD, 3))
        budget = 1 + trial % 3
        placement = _owners_only()
        grown = growth_calibration(counts, placement, SearchSettings(CHEAP, budget, RPN, budget_us=1e9))
        assert grown is not None
        holders = placement.holders

        def estimate(h):
            return estimate_layer(counts, OWNERS, h, CHEAP, RPN, prefetched=holders).time_s

        best, best_s = holders, estimate(holders)
        room = budget - (holders.sum(axis=1) - 2)
        for e in sorted(range(EXPERTS), key=lambda e: (-counts[:, e].sum(), e)):
            open_ranks = ~best[:, e] & (room > 0)
            if not open_ranks.any():
                continue
            candidate = best.copy()
            candidate[open_ranks, e] = True
            if not estimate(candidate) < best_s:
                break
            best, best_s = candidate, estimate(candidate)
            room = room - open_ranks
        if best_s > estimate(holders) * 0.95:
            best = holders
        assert np.array_equal(grown.holders, best), trial
        assert ((grown.holders.sum(axis=1) - 2) <= budget).all()


def test_growth_stays_within_the_calibration_budget():
    counts = _moving_hot(0, True)
    from ds_hecate.planning.search.call_work import CALL_WORK, WorkMeter
    one = CALL_WORK.estimate_cost_us(WORLD, EXPERTS)
    one_try = SearchSettings(CHEAP, 4, RPN, budget_us=1.5 * one)
    assert growth_calibration(counts, _owners_only(), one_try) is None   # not even one try
    meter = WorkMeter()
    growth_calibration(counts, _owners_only(), SearchSettings(CHEAP, 4, RPN, budget_us=2.5 * one), meter=meter)
    assert meter.us == pytest.approx(2 * one)


def test_the_record_travels_with_the_schedule():
    """A run resumed from a checkpoint decides as the uninterrupted one: the record is in the schedule's state."""
    schedule = ScheduleReuse(0.05)
    _calls(CHEAP, False, 3, schedule)
    state = schedule.state_dict()
    assert ScheduleReuse.state_fits(state, WORLD, EXPERTS)
    restored = ScheduleReuse(0.05)
    restored.load_state_dict(state, SearchSettings(CHEAP, 4, RPN))
    assert list(restored.search_record.nets_us) == list(schedule.search_record.nets_us)
    assert restored.search_record.unsearched == schedule.search_record.unsearched == 2
    more = [c.searched for c in _calls(CHEAP, False, PROBE_INTERVAL, restored)]
    assert more == [c.searched for c in _calls(CHEAP, False, PROBE_INTERVAL, schedule)]
    bad = dict(state, search_record={"nets_us": [1.0] * (RECORD_LENGTH + 1), "unsearched": 0})
    assert not ScheduleReuse.state_fits(bad, WORLD, EXPERTS)
    assert not ScheduleReuse.state_fits(dict(state, search_record={"nets_us": []}), WORLD, EXPERTS)


def test_record_rule():
    record = SearchRecord()
    assert record.pays()
    record.searched(100.0, 300.0)
    assert not record.pays()
    assert record.pays(NEGLIGIBLE_SHARE) and not record.pays(2 * NEGLIGIBLE_SHARE)
    for _ in range(PROBE_INTERVAL - 1):
        record.skipped()
    assert not record.pays()
    record.skipped()
    assert record.pays()
    record.searched(900.0, 300.0)   # -200 + 600: the last searches paid
    assert record.pays() and record.unsearched == 0
