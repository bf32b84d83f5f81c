"""The search spread over layer calls (planning/search/sliced.py, ScheduleReuse.schedule's ``slice_us``): the same
placement as the whole search in the end, interim placements within the budget meanwhile, the remembered
calibration prefetched where it is estimated faster, dropped when the prediction moves, resumed exactly from a
checkpoint; and ``hecate.search_slice_us`` resolved as documented."""
from __future__ import annotations

import numpy as np
import pytest

from ds_hecate.config import HecateConfig
from ds_hecate.planning.cost_model import StepCostModel, estimate_layer
from ds_hecate.planning.layer_planner import search_slice
from ds_hecate.planning.plan import holders_matrix, owned_experts
from ds_hecate.planning.search.reuse import ScheduleReuse
from ds_hecate.planning.search import SEARCH_WORK, SearchSettings, schedule_materialization
from ds_hecate.planning.sharding import even_sharding

WORLD, EXPERTS, RPN, BUDGET = 16, 32, 4, 3
COSTS = StepCostModel(compute_s_per_pair=1e-5, token_transfer_s=1e-7, expert_transfer_s=1e-4, overlap_s=1e-3,
                      token_transfer_inter_s=4e-7, expert_transfer_inter_s=4e-4, fanout=2, relay_chunks=2)
OWNERS = tuple(even_sharding(EXPERTS, WORLD))
SEARCH_BUDGET = 1e6
#: one step's work at this size: a slice this small takes one step per call
ONE_STEP = SEARCH_WORK.step_cost_us(1, WORLD, EXPERTS)


def _skewed(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = np.ones(EXPERTS)
    weights[[0, 1, 5, 9]] = [30.0, 20.0, 12.0, 8.0]
    return np.stack([rng.multinomial(400, weights / weights.sum()) for _ in range(WORLD)]).astype(np.float64)


def _replicas(placement) -> np.ndarray:
    holders = holders_matrix(placement, WORLD, EXPERTS)
    return holders.sum(axis=1) - np.bincount(np.asarray(OWNERS), minlength=WORLD)


def _calls(schedule: ScheduleReuse, loads: np.ndarray, calls: int, slice_us=ONE_STEP):
    return [schedule.schedule(loads, OWNERS, SearchSettings(COSTS, BUDGET, RPN, budget_us=SEARCH_BUDGET),
                              slice_us=slice_us)
            for _ in range(calls)]


def test_a_sliced_search_ends_where_the_whole_search_does():
    loads = _skewed()
    whole = schedule_materialization(loads, OWNERS, SearchSettings(COSTS, BUDGET, RPN, budget_us=SEARCH_BUDGET))
    schedule = ScheduleReuse(0.05)
    placed, in_progress = [], []
    for _ in range(40):
        placed += _calls(schedule, loads, 1)
        in_progress.append(schedule.pending is not None)
    ended = in_progress.index(False)
    assert ended >= 2, "one step a call: a search of several steps needs several calls"
    assert not any(in_progress[ended:]) and all(p == whole for p in placed[ended:])
    assert schedule.searches == 1 and schedule.reuses == 40 - ended - 1
    for p in placed:   # every interim placement is a placement within the budget, owners included
        assert int(_replicas(p).max()) <= BUDGET
        assert all(e in p[o] for e, o in enumerate(OWNERS))
    # the interim placements improve by the estimate (anytime), never worse than the owners'
    times = [estimate_layer(loads, OWNERS, p, COSTS, RPN).time_s for p in placed[:ended + 1]]
    owners_only = estimate_layer(loads, OWNERS, owned_experts(OWNERS, WORLD), COSTS, RPN).time_s
    assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:])) and times[0] <= owners_only


def test_without_a_slice_the_search_ends_in_one_call():
    loads = _skewed()
    whole = schedule_materialization(loads, OWNERS, SearchSettings(COSTS, BUDGET, RPN, budget_us=SEARCH_BUDGET))
    schedule = ScheduleReuse(0.05)
    assert _calls(schedule, loads, 1, slice_us=None) == [whole] and schedule.pending is None


def test_a_moved_prediction_drops_the_search_in_progress():
    schedule = ScheduleReuse(0.05)
    _calls(schedule, _skewed(), 2)
    assert schedule.pending is not None
    moved = np.roll(_skewed(), 7, axis=1)
    placed = _calls(schedule, moved, 60)
    whole = schedule_materialization(moved, OWNERS, SearchSettings(COSTS, BUDGET, RPN, budget_us=SEARCH_BUDGET))
    assert placed[-1] == whole and schedule.searches == 2


def test_the_search_starts_from_the_remembered_calibration():
    """A search for routing calibration placed for starts from that placement: it is what every call prefetches
    (the search finds nothing better here), and the search ends calls sooner than one from the start layout."""
    loads = _skewed()
    whole = schedule_materialization(loads, OWNERS, SearchSettings(COSTS, BUDGET, RPN, budget_us=SEARCH_BUDGET))
    schedule = ScheduleReuse(0.05)
    schedule.remember_calibration(whole, loads, OWNERS)     # as if calibration had placed this for the routing
    placed, calls = [], 0
    for _ in range(40):
        placed += _calls(schedule, loads, 1)
        pending = schedule.pending
        if pending is not None:
            assert pending.begun_from == whole
            calls += 1
    assert all(p == whole for p in placed)   # the remembered placement, refined by nothing better
    fresh, fresh_calls = ScheduleReuse(0.05), 0
    for _ in range(40):
        _calls(fresh, loads, 1)
        fresh_calls += fresh.pending is not None
    assert calls < fresh_calls, (calls, fresh_calls)
    # a remembered calibration for other routing, or beyond the budget, is not used
    other = ScheduleReuse(0.05)
    other.remember_calibration(whole, np.roll(loads, 7, axis=1), OWNERS)
    _calls(other, loads, 1)
    assert other.pending is not None
    assert other.pending.begun_from is None
    tight = ScheduleReuse(0.05)
    tight.remember_calibration(whole, loads, OWNERS)
    tight.schedule(loads, OWNERS, SearchSettings(COSTS, int(_replicas(whole).max()) - 1, RPN, budget_us=SEARCH_BUDGET),
                   slice_us=ONE_STEP)
    assert tight.pending is not None
    assert tight.pending.begun_from is None


@pytest.mark.parametrize("first_calls", [1, 2, 3, 5])
def test_a_checkpoint_resumes_the_search_in_progress_exactly(first_calls):
    """Checkpointed after calls whose slices took several steps each (the first ones gain more than they cost):
    the resumed search replays the same steps and goes on as the original."""
    loads = _skewed()
    original = ScheduleReuse(0.05)
    _calls(original, loads, first_calls)
    assert original.pending is not None and original.pending.taken >= first_calls
    state = original.state_dict()
    assert ScheduleReuse.state_fits(state, WORLD, EXPERTS)
    assert not ScheduleReuse.state_fits(dict(state, pending=dict(state["pending"], taken=-1)), WORLD, EXPERTS)
    resumed = ScheduleReuse(0.05)
    resumed.load_state_dict(state, SearchSettings(COSTS, BUDGET, RPN, budget_us=SEARCH_BUDGET))
    assert resumed.pending is not None and original.pending is not None
    assert resumed.pending.taken == original.pending.taken
    assert _calls(resumed, loads, 30) == _calls(original, loads, 30)


def test_search_slice_setting():
    windowless = StepCostModel(compute_s_per_pair=1e-5, token_transfer_s=1e-7, expert_transfer_s=1e-4)
    assert search_slice(None, COSTS) == pytest.approx(1000.0)       # T_nonMoE of 1 ms
    assert search_slice(None, windowless) is None                  # nothing hidden (a CPU): the whole search
    assert search_slice(0.0, COSTS) is None and search_slice(250.0, windowless) == 250.0
    assert HecateConfig(search_slice_us=5.0).search_slice_us == 5.0
    with pytest.raises(Exception, match="search_slice_us"):
        HecateConfig(search_slice_us=-1)


def test_beyond_its_slice_a_search_goes_on_while_a_step_pays_on_this_call():
    """A layer of milliseconds: each of the search's first steps takes more off the layer's estimate than its work
    costs, so the first call goes past its one-step slice; the same layer a thousand times faster gains less than
    a step costs and the first call stops at one."""
    loads = _skewed()
    fast = StepCostModel(compute_s_per_pair=1e-8, token_transfer_s=1e-10, expert_transfer_s=1e-7, overlap_s=1e-6,
                         token_transfer_inter_s=4e-10, expert_transfer_inter_s=4e-7, fanout=2, relay_chunks=2)
    taken = {}
    for name, costs in (("fast", fast), ("slow", COSTS)):
        schedule = ScheduleReuse(0.05)
        schedule.schedule(loads, OWNERS, SearchSettings(costs, BUDGET, RPN, budget_us=SEARCH_BUDGET), slice_us=ONE_STEP)
        taken[name] = schedule.pending.taken if schedule.pending is not None else None
    assert taken["fast"] == 1, taken
    assert taken["slow"] is None or taken["slow"] > 1, taken
