"""The per-layer planner (ds_hecate.planning.layer_planner), pure: policies, the start layout, resume."""
from __future__ import annotations

import numpy as np
import pytest

from ds_hecate.planning.cost_model import StepCostModel
from ds_hecate.planning.layer_planner import LayerPlanner, PlanInputs, PlannerSettings, expert_data_parallel_start
from ds_hecate.planning.placement import PLACEMENT_POLICIES, CostModel, plan_layer
from ds_hecate.planning.sharding import even_sharding

COSTS = StepCostModel(compute_s_per_pair=1e-3, token_transfer_s=1e-6, expert_transfer_s=1e-4)


def _inputs(world: int, experts: int, budget: int = 8) -> PlanInputs:
    return PlanInputs(tuple(even_sharding(experts, world)), COSTS, budget)


def _hot(world: int, experts: int, hot: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = np.ones(experts)
    weights[hot] = 8.0
    return np.stack([rng.multinomial(64, weights / weights.sum()) for _ in range(world)]).astype(np.int64)


@pytest.mark.parametrize("policy", [p for p in PLACEMENT_POLICIES if p != "hecate"])
def test_stateless_policies_place_as_plan_layer(policy):
    world, experts = 4, 8
    planner = LayerPlanner(PlannerSettings(policy=policy, ranks_per_node=2), world, experts)
    counts = _hot(world, experts, 3, 0)
    inputs = _inputs(world, experts)
    cost: CostModel = inputs.costs if policy == "shadow" else None
    if policy == "cost":
        from ds_hecate.planning.cost_model import CommCostModel
        cost = CommCostModel(hidden_size=8, expert_numel=100)
        inputs = PlanInputs(inputs.owners, inputs.costs, inputs.replica_budget, cost)
    after = planner.plan_call(counts, inputs, None, rank=1)
    reference = plan_layer(counts.tolist(), inputs.owners, policy, cost, ranks_per_node=2)
    assert after.plan.placement.materialized == reference.materialized
    assert after.extras is None and not planner.prefetches


def test_unknown_policy_and_missing_prefetch_are_refused():
    with pytest.raises(ValueError, match="unknown placement policy 'nope'"):
        LayerPlanner(PlannerSettings(policy="nope"), 2, 4)
    planner = LayerPlanner(PlannerSettings(), 2, 4)
    with pytest.raises(ValueError, match="prefetched placement"):
        planner.plan_call(_hot(2, 4, 0, 0), _inputs(2, 4), None, rank=0)


def test_more_ranks_than_experts_start_from_the_expert_data_parallel_layout():
    world, experts = 8, 2
    planner = LayerPlanner(PlannerSettings(ranks_per_node=4), world, experts)
    first = planner.prefetch_placement(_inputs(world, experts))   # no prediction yet: owners plus the start layout
    assert all(len(m) == 1 for m in first.materialized)
    assert [m[0] for m in first.materialized] == [r % experts for r in range(world)]
    # a budget below what the layout needs (one replica per rank without an expert) keeps the owners only
    assert expert_data_parallel_start(experts, world, 0, even_sharding(experts, world)) is None
    tight = LayerPlanner(PlannerSettings(ranks_per_node=4), world, experts)
    owners_only = tight.prefetch_placement(_inputs(world, experts, budget=0))
    assert sum(len(m) for m in owners_only.materialized) == experts


@pytest.mark.parametrize("world,experts", [(2, 8), (8, 2)])
def test_restored_schedule_makes_the_same_reuse_decisions(world, experts):
    """A planner restored from another's schedule state re-uses exactly when the original does (resume)."""
    inputs = _inputs(world, experts)
    original = LayerPlanner(PlannerSettings(ranks_per_node=2), world, experts)
    sequence = [_hot(world, experts, 1, s) for s in range(8)]
    for counts in sequence[:4]:
        prefetched = original.prefetch_placement(inputs)
        original.plan_call(counts, inputs, prefetched, 0)
        original.observe(counts)
    resumed = LayerPlanner(PlannerSettings(ranks_per_node=2), world, experts)
    for counts in original.predictor.state_dict()["history"]:
        resumed.observe(np.asarray(counts, dtype=np.int64))
    resumed.restore_schedule(original.schedule.state_dict(), inputs)
    assert original.schedule.placement is not None
    for counts in sequence[4:]:
        before = (original.schedule.searches, original.schedule.reuses)
        a = original.prefetch_placement(inputs)
        b = resumed.prefetch_placement(inputs)
        assert a == b
        assert (original.schedule.searches - before[0], original.schedule.reuses - before[1]) == \
            (resumed.schedule.searches, resumed.schedule.reuses)
        resumed.schedule.searches = resumed.schedule.reuses = 0
        for planner in (original, resumed):
            planner.plan_call(counts, inputs, a, 0)
            planner.observe(counts)
    assert original.schedule.reuses > 0, "the sequence should re-use a schedule at least once"


def test_start_layout_is_kept_while_owners_and_budget_hold():
    """The start layout is built once and handed out as the same object (the schedule's reuse check then compares
    it by identity), and rebuilt when a re-sharding moves owners or the budget changes."""
    world, experts = 8, 2
    planner = LayerPlanner(PlannerSettings(ranks_per_node=4), world, experts)
    inputs = _inputs(world, experts)
    first = planner.start_layout(inputs)
    assert first == expert_data_parallel_start(experts, world, inputs.replica_budget, inputs.owners)
    assert planner.start_layout(PlanInputs(list(inputs.owners), COSTS, inputs.replica_budget)) is first
    moved = PlanInputs((3, 5), COSTS, inputs.replica_budget)       # re-sharded: experts on ranks 3 and 5
    assert planner.start_layout(moved) == expert_data_parallel_start(experts, world, inputs.replica_budget, (3, 5))
    assert planner.start_layout(PlanInputs(inputs.owners, COSTS, 0)) is None    # budget below the layout's need
    assert planner.start_layout(inputs) == first


def test_expert_data_parallel_start_groups_experts_by_expert_parallel_rank():
    # 6 ranks, 4 experts: expert-parallel groups of 4 ranks, the fifth and sixth rank repeat the first two
    start = expert_data_parallel_start(4, 6, 8, (0, 1, 2, 3))
    assert start == ((0,), (1,), (2,), (3,), (0,), (1,))
    assert expert_data_parallel_start(4, 4, 8, (0, 1, 2, 3)) is None
    assert expert_data_parallel_start(4, 6, 0, (0, 1, 2, 3)) is None    # ranks 4 and 5 would need one replica


def _replicas(placement) -> int:
    return sum(len(m) for m in placement.materialized) - len(placement.owners)


@pytest.mark.parametrize("predictor", ["robust", "mean"])
def test_nothing_speculative_is_prefetched_while_the_newest_call_disagrees(predictor):
    """Stationary hot expert 0: replicas are prefetched for it. A one-step burst on expert 5: the next call
    prefetches only the owners (the newest call is an outlier; calibration plans from the counts), and the robust
    window goes back to expert 0's replicas on the call after, where the mean still carries a fifth of the burst."""
    world, experts = 4, 8
    planner = LayerPlanner(PlannerSettings(ranks_per_node=4, load_predictor=predictor), world, experts)
    inputs = _inputs(world, experts)
    for seed in range(5):
        planner.observe(_hot(world, experts, 0, seed))
    steady = planner.prefetch_placement(inputs)
    assert _replicas(steady) > 0
    burst = _hot(world, experts, 5, 99) * 4
    planner.observe(burst)
    after_burst = planner.prefetch_placement(inputs)
    if predictor == "robust":
        assert _replicas(after_burst) == 0                   # the newest call disagrees with the window
        planner.observe(_hot(world, experts, 0, 100))
        assert planner.prefetch_placement(inputs).materialized == steady.materialized
    else:
        assert _replicas(after_burst) > 0                    # the mean's newest call always "agrees"
        assert any(5 in m and planner.prediction is not None for m in after_burst.materialized)


def test_a_reused_schedule_prefetches_the_same_placement_object():
    """While the schedule is reused the planner hands out the same Placement, so the dispatch tables cached on it
    (``rank_tables``) are built once, not on every layer call."""
    from ds_hecate.planning.dispatch_plan import rank_tables
    world, experts = 4, 8
    planner = LayerPlanner(PlannerSettings(ranks_per_node=2), world, experts)
    inputs = _inputs(world, experts)
    counts = _hot(world, experts, 3, 0)
    placements = []
    for _ in range(6):
        prefetched = planner.prefetch_placement(inputs)
        placements.append(prefetched)
        planner.plan_call(counts, inputs, prefetched, rank=0)
        planner.observe(counts)
    reused = placements[2:]    # the first call has no prediction; the second searches
    assert planner.schedule.reuses >= 3
    assert all(p is reused[0] for p in reused)
    assert rank_tables(reused[-1], 2, 0) is rank_tables(reused[0], 2, 0)
