"""The vectorised planner (planning/dispatch_plan.py, critical_path.py, the search budget) against the explicit
reference: same splits, routes, loads, node traffic and expert-major order on random placements; the search's
anytime budget never returns a placement worse than its start."""
from typing import Any, Dict, List, Set

import numpy as np
import pytest
import torch

from ds_hecate.config import HecateConfig
from ds_hecate.planning.search import (AUTO_PLAN_BUDGET, SEARCH_WORK, ScheduleReuse, SearchSettings, calibration_extras,
                                       calibration_settings, load_shift, plan_after_gate, schedule_materialization)
from ds_hecate.planning.dispatch import topology_aware_routes
from ds_hecate.planning.dispatch_plan import DispatchPlan
from ds_hecate.planning.plan import LayerPlan, Placement
from ds_hecate.planning.cost_model import StepCostModel, estimate_layer
from ds_hecate.planning.sharding import even_sharding
from ds_hecate.runtime.dispatcher import send_order
from ds_hecate.planning.segments import segment_rows


def _random_case(rng):
    n, num_e = int(rng.integers(1, 10)), int(rng.integers(1, 9))
    rpn = int(rng.integers(1, n + 1))
    owners = tuple(int(x) for x in rng.integers(0, n, num_e))
    mat: List[Set[int]] = [set() for _ in range(n)]
    for e, o in enumerate(owners):
        mat[o].add(e)
    for _ in range(int(rng.integers(0, n * num_e + 1))):
        mat[int(rng.integers(0, n))].add(int(rng.integers(0, num_e)))
    counts = rng.integers(0, 12, (n, num_e)) * (rng.random((n, num_e)) < 0.7)
    return n, num_e, rpn, owners, tuple(tuple(sorted(m)) for m in mat), counts


def _reference_order(ref: LayerPlan, rank: int):
    """The pre-vectorisation expert-major order: segment table walked in Python."""
    tm, seg, offset = ref.token_matrix, {}, 0
    for src in range(ref.world_size):
        for e in range(ref.num_experts):
            seg[(src, e)] = offset
            offset += tm[src][rank][e]
    order: List[int] = []
    sizes: List[int] = []
    for e in ref.materialized[rank]:
        size = 0
        for src in range(ref.world_size):
            n = tm[src][rank][e]
            order.extend(range(seg[(src, e)], seg[(src, e)] + n))
            size += n
        sizes.append(size)
    return order, sizes


@pytest.mark.parametrize("seed", range(4))
def test_dispatch_plan_matches_explicit_routes(seed):
    rng = np.random.default_rng(seed)
    for _ in range(100):
        n, num_e, rpn, owners, materialized, counts = _random_case(rng)
        ref = LayerPlan(world_size=n, num_experts=num_e, owners=owners, materialized=materialized,
                        routes=topology_aware_routes(counts.tolist(), materialized, rpn))
        plan = DispatchPlan.build(counts, Placement(owners, materialized), rpn)
        assert plan.loads() == ref.loads()
        assert plan.node_traffic(rpn) == ref.node_traffic(rpn)
        assert plan.routes == ref.routes
        for r in range(n):
            mine = plan.for_rank(r)
            assert mine.send_splits == ref.send_splits(r) and mine.recv_splits == ref.recv_splits(r)
            assert plan.expert_load_on(r) == ref.expert_load_on(r)
            # the sender's per-slot destinations, in route order (expert, then destination)
            want = [d for e in range(num_e) for d, c in ref.routes[r][e] for _ in range(c)]
            got = np.repeat(mine.send_dst, mine.send_rows).tolist()
            assert got == want
            # the send order: the route order sorted by destination, stably
            assert send_order(mine).tolist() == sorted(range(len(want)), key=lambda i: want[i])
            order, sizes = _reference_order(ref, r)
            assert segment_rows(mine.order_starts, mine.order_lengths).tolist() == order and mine.sizes == sizes


def test_no_rank_builds_the_token_matrix_at_scale():
    """1,024 ranks x 256 experts: one rank's plan without the ranks x ranks x experts matrix (it would be 268M
    entries; the explicit path took half a minute)."""
    rng = np.random.default_rng(0)
    n, num_e = 1024, 256
    owners = tuple(even_sharding(num_e, n))
    counts = rng.multinomial(8192 * 8, np.full(num_e, 1 / num_e), size=n)
    placement = Placement(owners, tuple(tuple(e for e in range(num_e) if owners[e] == r) for r in range(n)))
    plan = DispatchPlan.build(counts, placement, 8)
    mine = plan.for_rank(5)
    assert sum(mine.recv_splits) == counts[:, 5].sum() and sum(mine.send_splits) == counts[5].sum()
    assert "explicit" not in plan.__dict__          # the lazy reference was never built
    assert sum(plan.loads()) == counts.sum()


def test_calibration_extras_lists_only_new_replicas_and_owners():
    owners = (0, 1, 1)
    prefetched = Placement(owners, ((0, 2), (1, 2)))
    calibrated = Placement(owners, ((0, 1, 2), (1, 2)))
    assert calibration_extras(calibrated, prefetched.holders).materialized == ((0, 1), (1, 2))


def _search_case(world=8, experts=16, seed=0):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1) ** 1.2
    counts = rng.multinomial(4000, p / p.sum(), size=world).astype(float)
    costs = StepCostModel(compute_s_per_pair=1e-6, token_transfer_s=1e-7, expert_transfer_s=1e-4, overlap_s=1e-3)
    return counts, tuple(even_sharding(experts, world)), costs


def test_budget_cuts_the_search_but_never_returns_worse_than_start():
    counts, owners, costs = _search_case()
    full = schedule_materialization(counts, owners, SearchSettings(costs, 4, 4))
    assert schedule_materialization(counts, owners, SearchSettings(costs, 4, 4, budget_us=1e12)) == full
    unsearched = schedule_materialization(counts, owners, SearchSettings(costs, 4, 4, budget_us=0))
    start_time = estimate_layer(counts, owners, unsearched,
                                costs, 4).time_s
    full_time = estimate_layer(counts, owners, full, costs, 4).time_s
    assert full_time < start_time          # the case has something to gain
    setup = SEARCH_WORK.setup_cost_us(8, 16)
    seen = set()
    for budget in np.linspace(0, setup + 20 * SEARCH_WORK.step_cost_us(100, 8, 16), 25):
        cut = schedule_materialization(counts, owners, SearchSettings(costs, 4, 4, budget_us=float(budget)))
        assert estimate_layer(counts, owners, cut, costs, 4).time_s <= start_time * (1 + 1e-12)
        seen.add(cut)
    assert len(seen) > 2                    # the budget really decides how far the search gets


def test_budget_below_setup_returns_start():
    counts, owners, costs = _search_case()
    start = tuple(tuple(sorted({e for e, o in enumerate(owners) if o == r} | {r})) for r in range(8))
    assert schedule_materialization(counts, owners, SearchSettings(costs, 4, 4, budget_us=0.0), start=start) == start


def test_plan_after_gate_is_deterministic_and_calibrates_within_budget():
    counts, owners, costs = _search_case()
    placement = Placement(owners, tuple(tuple(e for e, o in enumerate(owners) if o == r) for r in range(8)))
    skewed = np.zeros_like(counts, dtype=np.int64)
    skewed[:, 0] = 500                       # a burst on expert 0: the owner placement leaves it on one rank
    outs = []
    for _ in range(2):
        schedule = ScheduleReuse(0.05)
        after = plan_after_gate(skewed, placement, schedule, calibration_settings(costs, 4, 4, 1e9), 3, True)
        assert after.extras is not None
        outs.append((after.plan.materialized, after.extras.materialized, after.mine.send_splits))
    assert outs[0] == outs[1] and outs[0][0] != placement.materialized
    none = plan_after_gate(skewed, placement, ScheduleReuse(0.05), calibration_settings(costs, 4, 4, 0.0), 3, True)
    assert none.extras is None and none.plan.materialized == placement.materialized


def test_invalid_placement_is_refused_before_any_collective():
    counts = np.ones((2, 2), dtype=np.int64)
    with pytest.raises(ValueError, match=r"owner 1 of expert 1 must materialize it"):
        DispatchPlan.build(counts, Placement((0, 1), ((0, 1), ())), 2)
    with pytest.raises(ValueError, match=r"counts must be >= 0"):
        DispatchPlan.build(-counts, Placement((0, 1), ((0,), (1,))), 2)


@pytest.mark.parametrize("key", ["plan_budget_us", "search_budget_us"])
def test_budget_keys_validated(key):
    valid: Dict[str, Any] = {key: 123.0}
    invalid: Dict[str, Any] = {key: -1}
    assert getattr(HecateConfig(**valid), key) == 123.0
    with pytest.raises(Exception, match=key):
        HecateConfig(**invalid)


def test_automatic_calibration_budget_is_a_share_of_the_prefetched_estimate():
    """``plan_budget_us: null``: the search's budget is 5% of the layer's estimate under the prefetched placement
    (replicas already gathered), clamped to [floor, cap], and resolved from the search's own setup."""
    counts, owners, _ = _search_case()
    costs = StepCostModel(compute_s_per_pair=1e-5, token_transfer_s=1e-7, expert_transfer_s=1e-4, overlap_s=1e-3)
    placement = Placement(owners, tuple(tuple(e for e, o in enumerate(owners) if o == r) for r in range(8)))
    rng = np.random.default_rng(1)
    burst = np.zeros_like(counts, dtype=np.int64)
    burst[:, rng.choice(16, 5, replace=False)] = rng.integers(100, 500, (8, 5))   # five hot experts at once
    layer_s = estimate_layer(burst, owners, placement.materialized, costs, 4,
                             prefetched=placement.materialized).time_s
    budget = AUTO_PLAN_BUDGET.resolve(layer_s)
    assert AUTO_PLAN_BUDGET.floor_us < budget < AUTO_PLAN_BUDGET.cap_us     # the share itself decides here
    after = plan_after_gate(burst, placement, ScheduleReuse(0.05), calibration_settings(costs, 4, 4, None), 3, True)
    holders = placement.holders
    want = schedule_materialization(burst, owners, SearchSettings(costs, 4, 4, budget_us=budget), start=holders,
                                    prefetched=holders)
    assert after.searched and after.plan.materialized == want
    # the budget is binding: the cap, or a search to the end, would place differently
    capped = SearchSettings(costs, 4, 4, budget_us=AUTO_PLAN_BUDGET.cap_us)
    assert want != schedule_materialization(burst, owners, capped, start=holders, prefetched=holders)
    assert AUTO_PLAN_BUDGET.resolve(1e3) == AUTO_PLAN_BUDGET.cap_us and AUTO_PLAN_BUDGET.resolve(0.0) == 1000.0


def test_load_shift_with_a_kept_total_equals_the_plain_one():
    rng = np.random.default_rng(3)
    before, after = rng.random((16, 8)) * 50, rng.integers(0, 60, (16, 8))
    assert load_shift(before, after, float(before.sum())) == load_shift(before, after)
