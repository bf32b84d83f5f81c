"""Tests of the Hecate scheduler's pure planning modules (no torch.distributed).

ds_hecate.planning.search.greedy (StepCostModel, rank_loads,
estimate_layer, schedule_materialization) and ds_hecate.planning.heterogeneous (heterogeneous_sharding, the paper's
Algorithm 2). The balance acceptance criterion checks the compute load per rank through the integer dispatch
(topology_aware_routes + LayerPlan), i.e. exactly what the runtime executes.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List, Sequence, Tuple

import pytest

from strategies import topologies

from standalone import planning_prelude
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_hecate.planning import LayerPlan, even_sharding, topology_aware_routes
from ds_hecate.planning.heterogeneous import heterogeneous_sharding, slots_per_rank
from ds_hecate.planning.plan import check_routes_cover
from ds_hecate.planning.predictor import LoadPredictor
from ds_hecate.planning.cost_model import LayerEstimate, StepCostModel, estimate_layer
from ds_hecate.planning.dispatch import rank_loads
from ds_hecate.planning.search import SearchSettings, schedule_materialization

REPO = Path(__file__).resolve().parents[1]
PLANNING_DIR = REPO / "ds_hecate" / "planning"


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def owner_placement(owners: Sequence[int], world: int) -> Tuple[Tuple[int, ...], ...]:
    """Plain expert parallelism: every rank holds exactly the experts it owns."""
    return tuple(tuple(e for e, o in enumerate(owners) if o == r) for r in range(world))


def replicas_per_rank(materialized, owners) -> List[int]:
    return [sum(1 for e in experts if owners[e] != r) for r, experts in enumerate(materialized)]


def assert_valid_placement(materialized, owners, world: int) -> None:
    assert isinstance(materialized, tuple) and len(materialized) == world
    for r, experts in enumerate(materialized):
        assert isinstance(experts, tuple)
        assert list(experts) == sorted(set(experts)), f"rank {r}: not sorted unique: {experts}"
        assert all(isinstance(e, int) and 0 <= e < len(owners) for e in experts)
    for e, o in enumerate(owners):
        assert e in materialized[o], f"owner {o} of expert {e} does not hold it"


def integer_plan(counts: Sequence[Sequence[int]], owners, materialized, ranks_per_node: int) -> LayerPlan:
    plan = LayerPlan(world_size=len(counts), num_experts=len(owners), owners=tuple(owners),
                     materialized=tuple(materialized),
                     routes=topology_aware_routes(counts, materialized, ranks_per_node))
    check_routes_cover(plan, counts)
    return plan


def compute_imbalance(counts, owners, materialized, ranks_per_node: int) -> float:
    """max/mean over ranks of the token-expert pairs each rank computes, with the real (integer) dispatch."""
    plan = integer_plan(counts, owners, materialized, ranks_per_node)
    loads = [plan.tokens_processed(r) for r in range(plan.world_size)]
    assert sum(loads) == sum(map(sum, counts))
    return max(loads) / (sum(loads) / len(loads))


def hot_workload(world: int, num_experts: int, hot: Tuple[float, float], per_rank: int = 1000) -> List[List[int]]:
    """Every source rank sends the same counts: experts 0 and 1 get ``hot`` shares, the rest is spread evenly."""
    h0, h1 = round(hot[0] * per_rank), round(hot[1] * per_rank)
    rest, cold = per_rank - h0 - h1, num_experts - 2
    row = [h0, h1] + [rest // cold + (1 if i < rest % cold else 0) for i in range(cold)]
    assert sum(row) == per_rank and min(row) > 0
    return [list(row) for _ in range(world)]


# ---------------------------------------------------------------------------------------------------------------
# 2. schedule_materialization invariants
# ---------------------------------------------------------------------------------------------------------------
@st.composite
def schedule_inputs(draw):
    world, num_e, rpn, owners = draw(topologies(8, 12))
    cell = st.one_of(st.just(0.0), st.floats(0, 200, allow_nan=False, allow_infinity=False))
    counts = [draw(st.lists(cell, min_size=num_e, max_size=num_e)) for _ in range(world)]
    budget = draw(st.integers(0, 4))

    def log_uniform(lo_exp, hi_exp):   # mantissa in [1, 10) times 10**-k: spans the regimes where replicas pay or not
        return draw(st.floats(1, 9.99)) * 10.0 ** -draw(st.integers(lo_exp, hi_exp))

    costs = StepCostModel(compute_s_per_pair=log_uniform(3, 6), token_transfer_s=log_uniform(5, 9),
                          expert_transfer_s=log_uniform(1, 6),
                          overlap_s=log_uniform(1, 5) if draw(st.booleans()) else 0.0)
    return counts, owners, costs, budget, rpn


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule_inputs())
def test_schedule_invariants(inputs):
    counts, owners, costs, budget, rpn = inputs
    world = len(counts)
    result = schedule_materialization(counts, owners, SearchSettings(costs, budget, rpn))
    assert_valid_placement(result, owners, world)
    assert all(n <= budget for n in replicas_per_rank(result, owners))
    base = owner_placement(owners, world)
    est = estimate_layer(counts, owners, result, costs, rpn)
    est_base = estimate_layer(counts, owners, base, costs, rpn)
    assert est.time_s <= est_base.time_s          # never worse than plain expert parallelism
    if result != base:                            # a replica is only added when it strictly helps
        assert est.time_s < est_base.time_s
    # deterministic: identical inputs (also as fresh copies / tuples) give the identical placement
    settings = SearchSettings(costs, budget, rpn)
    assert schedule_materialization([list(r) for r in counts], tuple(owners), settings) == result
    assert schedule_materialization(tuple(map(tuple, counts)), list(owners), settings) == result
    # budget 0: exactly the owner placement
    assert schedule_materialization(counts, owners, SearchSettings(costs, 0, rpn)) == base
    # the integer dispatch accepts the placement
    int_counts = [[int(round(c)) for c in row] for row in counts]
    integer_plan(int_counts, owners, result, rpn)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule_inputs(), st.data())
def test_schedule_with_start_extends_start(inputs, data):
    counts, owners, costs, budget, rpn = inputs
    world, num_e = len(counts), len(owners)
    start = tuple(tuple(sorted(set(data.draw(st.lists(st.integers(0, num_e - 1), max_size=3)))
                               | {e for e, o in enumerate(owners) if o == r})) for r in range(world))
    prefetched = start if data.draw(st.booleans()) else None
    result = schedule_materialization(counts, owners, SearchSettings(costs, budget, rpn), start=start,
                                      prefetched=prefetched)
    assert_valid_placement(result, owners, world)
    for r in range(world):
        assert set(start[r]) <= set(result[r])
    start_extra, extra = replicas_per_rank(start, owners), replicas_per_rank(result, owners)
    for r in range(world):
        if extra[r] > start_extra[r]:            # new replicas only within the budget
            assert extra[r] <= budget
    est = estimate_layer(counts, owners, result, costs, rpn, prefetched)
    assert est.time_s <= estimate_layer(counts, owners, start, costs, rpn, prefetched).time_s
    assert schedule_materialization(counts, owners, SearchSettings(costs, budget, rpn), start=start,
                                    prefetched=prefetched) == result
    if budget == 0 and all(n == 0 for n in start_extra):
        assert result == owner_placement(owners, world)


def test_schedule_budget_zero_on_hot_workload_is_owner_placement():
    counts = hot_workload(4, 8, (0.5, 0.3))
    owners = even_sharding(8, 4)
    costs = StepCostModel(1e-4, 1e-7, 1e-4, 1e-3)
    assert schedule_materialization(counts, owners, SearchSettings(costs, 0, 1)) == owner_placement(owners, 4)


def test_schedule_does_not_replicate_expert_only_its_owner_uses():
    # expert 0 is hot but only rank 0 (its owner) sends to it: under local-first dispatch a replica cannot help.
    counts = [[1000.0, 0.0], [0.0, 10.0]]
    costs = StepCostModel(compute_s_per_pair=1e-4, token_transfer_s=1e-7, expert_transfer_s=1e-6, overlap_s=1.0)
    assert schedule_materialization(counts, (0, 1), SearchSettings(costs, 4, 1)) == ((0,), (1,))


# ---------------------------------------------------------------------------------------------------------------
# 3. Balance acceptance criterion
# ---------------------------------------------------------------------------------------------------------------
COMPUTE_DOMINATED = StepCostModel(compute_s_per_pair=1e-4, token_transfer_s=1e-7, expert_transfer_s=1e-4,
                                  overlap_s=1e-3)
COMM_DOMINATED = StepCostModel(compute_s_per_pair=1e-4, token_transfer_s=1e-7, expert_transfer_s=1e3,
                               overlap_s=0.0)
BUDGET = 4
EP_MIN = {2: 1.6, 4: 2.5}
BALANCED_MAX = 1.15

# (world, experts, (hot share of expert 0, of expert 1), ranks_per_node)
BALANCED_WORKLOADS = [
    (2, 8, (0.45, 0.30), 1),
    (2, 16, (0.50, 0.30), 1),
    (4, 8, (0.40, 0.25), 1),
    (4, 16, (0.40, 0.25), 1),
    (4, 8, (0.40, 0.25), 2),
    (4, 16, (0.40, 0.25), 2),
    (4, 8, (0.45, 0.25), 2),
    (4, 16, (0.45, 0.30), 2),
    (4, 16, (0.60, 0.20), 1),
]
# Workloads of the same family (same criterion, same cost model and budget) where the greedy stops in a local
# optimum: no single added replica lowers the estimated max, although replicating both hot experts on every rank
# (budget 2) reaches max/mean <= 1.122 and a lower estimate. See test_hot_replication_is_feasible below.
UNBALANCED_WORKLOADS = [
    (4, 8, (0.50, 0.30), 1),     # scheduler: 1.267
    (4, 8, (0.60, 0.10), 2),     # scheduler: 1.600 (two tied bottlenecks on node 0: a single replica cannot help)
    (4, 8, (0.45, 0.20), 2),     # scheduler: 1.250
    (4, 16, (0.50, 0.25), 1),    # scheduler: 1.203
    (4, 16, (0.50, 0.25), 2),    # scheduler: 1.216
]

def _workload_id(w):
    world, num_e, hot, rpn = w
    return f"{world}r-{num_e}e-hot{int(hot[0] * 100)}+{int(hot[1] * 100)}-rpn{rpn}"


def _check_hot_workload(world, num_e, hot, rpn):
    counts = hot_workload(world, num_e, hot)
    owners = even_sharding(num_e, world)
    assert owners[0] == owners[1] == 0
    total = sum(map(sum, counts))
    assert sum(row[0] + row[1] for row in counts) > total / 2
    ep = compute_imbalance(counts, owners, owner_placement(owners, world), rpn)
    assert ep >= EP_MIN[world], f"plain EP max/mean {ep:.3f}"
    return counts, owners, ep


@pytest.mark.parametrize("workload", BALANCED_WORKLOADS, ids=_workload_id)
def test_balance_acceptance(workload):
    world, num_e, hot, rpn = workload
    counts, owners, ep = _check_hot_workload(world, num_e, hot, rpn)
    mat = schedule_materialization(counts, owners, SearchSettings(COMPUTE_DOMINATED, BUDGET, rpn))
    assert_valid_placement(mat, owners, world)
    assert max(replicas_per_rank(mat, owners)) <= BUDGET
    assert set(mat[0]) >= {0, 1}
    # the hot experts are replicated (the only way to unload their owner)
    assert any(0 in mat[r] for r in range(1, world)) and any(1 in mat[r] for r in range(1, world))
    scheduled = compute_imbalance(counts, owners, mat, rpn)
    assert scheduled <= BALANCED_MAX, f"EP {ep:.3f} -> scheduled {scheduled:.3f}: {mat}"
    # the fractional estimate the scheduler optimises agrees with the integer dispatch
    est = estimate_layer(counts, owners, mat, COMPUTE_DOMINATED, rpn)
    assert est.imbalance == pytest.approx(scheduled, abs=0.01)


@pytest.mark.parametrize("budget", [BUDGET, 16])
@pytest.mark.parametrize("workload", UNBALANCED_WORKLOADS, ids=_workload_id)
def test_balance_acceptance_where_single_replicas_stall(workload, budget):
    """Workloads where every single new replica overloads its own rank (local-first dispatch): the scheduler's
    group moves (a replica on every rank of a node / of the job) must still reach the target."""
    world, num_e, hot, rpn = workload
    counts, owners, ep = _check_hot_workload(world, num_e, hot, rpn)
    mat = schedule_materialization(counts, owners, SearchSettings(COMPUTE_DOMINATED, budget, rpn))
    assert max(replicas_per_rank(mat, owners)) <= budget
    scheduled = compute_imbalance(counts, owners, mat, rpn)
    assert scheduled <= BALANCED_MAX, f"EP {ep:.3f} -> scheduled {scheduled:.3f}: {mat}"


def _hot_replicated(owners, world):
    """The paper's Algorithm 1 placement for t >= 2: the two hot experts on every rank (2 replicas per rank)."""
    return tuple(tuple(sorted(set(experts) | {0, 1})) for experts in owner_placement(owners, world))


@pytest.mark.parametrize("workload", UNBALANCED_WORKLOADS, ids=_workload_id)
def test_hot_replication_is_feasible(workload):
    """The balance target is reachable within the budget with the paper's top-t replication (a yardstick)."""
    world, num_e, hot, rpn = workload
    counts, owners, _ = _check_hot_workload(world, num_e, hot, rpn)
    alt = _hot_replicated(owners, world)
    assert max(replicas_per_rank(alt, owners)) <= 2 <= BUDGET
    assert compute_imbalance(counts, owners, alt, rpn) <= BALANCED_MAX


@pytest.mark.parametrize("workload", UNBALANCED_WORKLOADS + [(4, 16, (0.40, 0.25), 1)], ids=_workload_id)
def test_schedule_not_worse_than_hot_replication(workload):
    """The cost-driven greedy should never be worse, by its own estimate, than the paper's top-t replication when
    that fits the budget. (4r-16e-hot40+25-rpn1 meets the 1.15 criterion, 1.083, but hot replication is better:
    1.050, estimate 0.1050 s vs 0.1084 s.)"""
    world, num_e, hot, rpn = workload
    counts, owners, _ = _check_hot_workload(world, num_e, hot, rpn)
    mat = schedule_materialization(counts, owners, SearchSettings(COMPUTE_DOMINATED, BUDGET, rpn))
    alt = _hot_replicated(owners, world)
    assert (estimate_layer(counts, owners, mat, COMPUTE_DOMINATED, rpn).time_s
            <= estimate_layer(counts, owners, alt, COMPUTE_DOMINATED, rpn).time_s)


@pytest.mark.parametrize("workload", BALANCED_WORKLOADS + UNBALANCED_WORKLOADS, ids=_workload_id)
def test_comm_dominated_adds_no_replica(workload):
    world, num_e, hot, rpn = workload
    counts, owners, _ = _check_hot_workload(world, num_e, hot, rpn)
    for budget in (BUDGET, 100):
        assert (schedule_materialization(counts, owners, SearchSettings(COMM_DOMINATED, budget, rpn))
                == owner_placement(owners, world))


# ---------------------------------------------------------------------------------------------------------------
# 4. estimate_layer / rank_loads / StepCostModel
# ---------------------------------------------------------------------------------------------------------------
UNIT = StepCostModel(compute_s_per_pair=1.0, token_transfer_s=0.5, expert_transfer_s=3.0, overlap_s=0.0)


def test_estimate_compute_and_token_terms():
    # src0: e0 local (10), e1 -> r1 (4).  src1: e0 -> r0 (6), e1 local (2).
    counts = [[10, 4], [6, 2]]
    est = estimate_layer(counts, (0, 1), ((0,), (1,)), UNIT, 1)
    assert isinstance(est, LayerEstimate)
    assert est.compute_pairs == (16.0, 6.0)
    # r0: 16 compute + max(sent 4, received 6) * 0.5 = 19; r1: 6 + max(sent 6, received 4) * 0.5 = 9
    assert est.rank_time_s == (19.0, 9.0)
    assert est.time_s == 19.0
    assert est.imbalance == pytest.approx(16 / 11)
    # token term alone
    tok = StepCostModel(compute_s_per_pair=0.0, token_transfer_s=0.25, expert_transfer_s=1.0)
    assert estimate_layer(counts, (0, 1), ((0,), (1,)), tok, 1).rank_time_s == (1.5, 1.5)
    assert estimate_layer([[10, 0], [6, 0]], (0, 1), ((0,), (1,)), tok, 1).rank_time_s == (1.5, 1.5)
    assert estimate_layer([[10, 8], [0, 2]], (0, 1), ((0,), (1,)), tok, 1).rank_time_s == (2.0, 2.0)


def _three_expert_case(overlap_s):
    # owners (0, 0, 1); rank 1 holds replicas of experts 0 and 1 (2 moved in), rank 0 sends 2 experts.
    counts = [[1, 2, 3], [4, 5, 6]]
    owners = (0, 0, 1)
    mat = ((0, 1), (0, 1, 2))
    costs = StepCostModel(compute_s_per_pair=1.0, token_transfer_s=0.5, expert_transfer_s=3.0, overlap_s=overlap_s)
    return counts, owners, mat, costs


def test_estimate_exposed_gather_beyond_overlap():
    counts, owners, mat, costs = _three_expert_case(overlap_s=4.0)
    est = estimate_layer(counts, owners, mat, costs, 1)
    # processed: r0 = 1 + 2 = 3; r1 = 4 + 5 + 6 + 3 (src0's expert 2) = 18; token term 3 * 0.5 on both ranks
    assert est.compute_pairs == (3.0, 18.0)
    # 2 experts * 3 s = 6 s of gather, 4 s hidden: 2 s exposed on sender r0 and receiver r1
    assert est.rank_time_s == (3 + 1.5 + 2.0, 18 + 1.5 + 2.0)
    assert est.time_s == 21.5
    for overlap, exposed in [(0.0, 6.0), (6.0, 0.0), (100.0, 0.0)]:
        counts, owners, mat, costs = _three_expert_case(overlap)
        assert estimate_layer(counts, owners, mat, costs, 1).rank_time_s == (3 + 1.5 + exposed, 18 + 1.5 + exposed)


def test_estimate_calibration_extras_fully_exposed():
    counts, owners, mat, costs = _three_expert_case(overlap_s=4.0)
    # everything prefetched: same as no prefetched list
    full = estimate_layer(counts, owners, mat, costs, 1, prefetched=mat)
    assert full.rank_time_s == estimate_layer(counts, owners, mat, costs, 1).rank_time_s
    # expert 0 prefetched on rank 1, expert 1 not: 3 s hidden (< 4 s), 3 s fully exposed
    part = estimate_layer(counts, owners, mat, costs, 1, prefetched=((0, 1), (0,)))
    assert part.rank_time_s == (3 + 1.5 + 3.0, 18 + 1.5 + 3.0)
    # nothing prefetched: both gathers exposed although they would fit in the overlap window
    none = estimate_layer(counts, owners, mat, costs, 1, prefetched=((), ()))
    assert none.rank_time_s == (3 + 1.5 + 6.0, 18 + 1.5 + 6.0)
    assert none.compute_pairs == part.compute_pairs == full.compute_pairs


def test_estimate_hidden_and_exposed_use_max_of_in_and_out():
    # rank 0 owns 0,1; rank 1 owns 2,3. Rank 0 receives 2 and 3; rank 1 receives 0 only. 1 s per expert.
    costs = StepCostModel(compute_s_per_pair=0.0, token_transfer_s=0.0, expert_transfer_s=1.0, overlap_s=0.5)
    counts = [[0, 0, 0, 0], [0, 0, 0, 0]]
    mat = ((0, 1, 2, 3), (0, 2, 3))
    est = estimate_layer(counts, (0, 0, 1, 1), mat, costs, 1)
    # r0: in 2, out 1 -> 2 s - 0.5 = 1.5; r1: in 1, out 2 -> 1.5
    assert est.rank_time_s == (1.5, 1.5)
    est = estimate_layer(counts, (0, 0, 1, 1), mat, costs, 1, prefetched=((), ()))
    assert est.rank_time_s == (2.0, 2.0)
    assert est.imbalance == 1.0                     # no compute at all


def test_rank_loads_topology_fractional_split():
    # 4 ranks, 2 per node. Expert 0 owned by rank 0 and replicated on rank 1 (both node 0).
    counts = [[2.0], [4.0], [6.0], [9.0]]
    processed, sent, received = rank_loads(counts, ((0,), (0,), (), ()), 2)
    # src0, src1 local; src2, src3 (node 1, no holder there) split evenly over {0, 1}
    assert processed == [[2.0 + 7.5], [4.0 + 7.5], [0.0], [0.0]]
    assert sent == [0.0, 0.0, 6.0, 9.0]
    assert received == [7.5, 7.5, 0.0, 0.0]
    # a replica on rank 2 (node 1) captures all of node 1's traffic
    processed, sent, received = rank_loads(counts, ((0,), (), (0,), ()), 2)
    assert processed == [[6.0], [0.0], [15.0], [0.0]]
    assert sent == [0.0, 4.0, 0.0, 9.0]
    assert received == [4.0, 0.0, 9.0, 0.0]


@pytest.mark.parametrize("overlap,transfer,expected", [
    (1e-3, 1e-4, 10), (10.0, 3.0, 3), (0.0, 1.0, 0), (2.9, 3.0, 0), (6.0, 3.0, 2), (1.0, 1e-3, 1000)])
def test_overlap_degree_examples(overlap, transfer, expected):
    c = StepCostModel(compute_s_per_pair=1.0, token_transfer_s=1.0, expert_transfer_s=transfer, overlap_s=overlap)
    assert c.overlap_degree == expected == int(overlap / transfer)


@settings(max_examples=100, deadline=None)
@given(overlap=st.floats(0, 10), transfer=st.floats(1e-6, 10))
def test_overlap_degree_property(overlap, transfer):
    c = StepCostModel(compute_s_per_pair=1.0, token_transfer_s=1.0, expert_transfer_s=transfer, overlap_s=overlap)
    assert c.overlap_degree == int(overlap / transfer)


def test_overlap_degree_free_transfers():
    c = StepCostModel(compute_s_per_pair=1.0, token_transfer_s=1.0, expert_transfer_s=0.0, overlap_s=0.0)
    assert c.overlap_degree >= 1 << 20


# ---------------------------------------------------------------------------------------------------------------
# 5. heterogeneous_sharding
# ---------------------------------------------------------------------------------------------------------------
@st.composite
def sharding_inputs(draw):
    world = draw(st.integers(1, 8))
    rpn = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    sizes = draw(st.lists(st.integers(1, 16), min_size=1, max_size=5))
    load = st.one_of(st.just(0.0), st.floats(0, 1000, allow_nan=False, allow_infinity=False))
    layer_loads = [draw(st.lists(load, min_size=n, max_size=n)) for n in sizes]
    if draw(st.booleans()):
        degree = draw(st.integers(0, 20))
    else:
        degree = [draw(st.integers(0, n + 2)) for n in sizes]
    return layer_loads, world, rpn, degree


def _top_t(loads, t):
    return set(sorted(range(len(loads)), key=lambda e: (-loads[e], e))[:max(0, min(t, len(loads)))])


@settings(max_examples=150, deadline=None)
@given(sharding_inputs())
def test_heterogeneous_sharding_properties(inputs):
    layer_loads, world, rpn, degree = inputs
    owners = heterogeneous_sharding(layer_loads, world, rpn, degree)
    assert len(owners) == len(layer_loads)
    for layer, loads in zip(owners, layer_loads):
        assert isinstance(layer, tuple) and len(layer) == len(loads)
        assert all(isinstance(o, int) and 0 <= o < world for o in layer)
    total = sum(len(loads) for loads in layer_loads)
    per_rank = [sum(layer.count(r) for layer in owners) for r in range(world)]
    assert sum(per_rank) == total
    assert max(per_rank) - min(per_rank) <= 1
    assert per_rank == slots_per_rank(total, world)
    # deterministic
    assert heterogeneous_sharding([list(loads) for loads in layer_loads], world, rpn, degree) == owners
    # a per-layer list with the same value everywhere is the same as the scalar
    if isinstance(degree, int):
        assert heterogeneous_sharding(layer_loads, world, rpn, [degree] * len(layer_loads)) == owners
    # the top-t experts are placed last, into whatever slots remain: their loads cannot influence anything
    # (doubling them keeps them the top-t, exactly, and must not change a single owner)
    degrees = [degree] * len(layer_loads) if isinstance(degree, int) else degree
    scaled = [[x * 2 if e in _top_t(loads, t) else x for e, x in enumerate(loads)]
              for loads, t in zip(layer_loads, degrees)]
    assert heterogeneous_sharding(scaled, world, rpn, degree) == owners


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(0.001, 1000, allow_nan=False), min_size=2, max_size=16), st.sampled_from([1, 2]))
def test_heterogeneous_underloaded_balance_two_ranks(loads, rpn):
    # rpn=1: two nodes of one rank (node choice balances); rpn=2: one node (rank choice within the node balances)
    (owners,) = heterogeneous_sharding([loads], 2, rpn, 0)
    order = sorted(range(len(loads)), key=lambda e: (-loads[e], e))
    assert owners[order[0]] != owners[order[1]]
    rank_load = [sum(x for x, o in zip(loads, owners) if o == r) for r in range(2)]
    assert abs(rank_load[0] - rank_load[1]) <= max(loads) * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4).flatmap(lambda k: st.lists(st.floats(0.001, 1000, allow_nan=False),
                                                    min_size=4 * k, max_size=4 * k)))
def test_heterogeneous_underloaded_spread_over_nodes(loads):
    (owners,) = heterogeneous_sharding([loads], 4, 2, 0)
    order = sorted(range(len(loads)), key=lambda e: (-loads[e], e))
    assert owners[order[0]] // 2 != owners[order[1]] // 2       # the two heaviest on different nodes
    node_load = [sum(x for x, o in zip(loads, owners) if o // 2 == n) for n in range(2)]
    assert abs(node_load[0] - node_load[1]) <= max(loads) * (1 + 1e-9)
    assert all(owners.count(r) == len(loads) // 4 for r in range(4))


def test_heterogeneous_hand_computed():
    # 2 ranks, t=0: LPT with slots. 10 -> r0, 9 -> r1, 1 -> r1 (9 < 10), 1 -> r0 (r1 full)
    assert heterogeneous_sharding([[10, 9, 1, 1]], 2, 1, 0) == [(0, 1, 1, 0)]
    # 4 ranks, 2 per node, t=0: node first. 8 -> node0/r0, 4 -> node1/r2, 2 -> node1/r3, 1 -> node0/r1
    assert heterogeneous_sharding([[8, 4, 2, 1]], 4, 2, 0) == [(0, 2, 3, 1)]
    # rank-level LPT would have put 4 on rank 1 (same node as 8); with one rank per node it does
    assert heterogeneous_sharding([[8, 4, 2, 1]], 4, 1, 0) == [(0, 1, 2, 3)]
    # t=2: the hot 100 and 90 are placed last into the remaining slots; the underloaded 5,4,3,2 balance (7 / 7)
    assert heterogeneous_sharding([[100, 90, 5, 4, 3, 2]], 2, 1, 2) == [(0, 1, 0, 1, 1, 0)]
    assert heterogeneous_sharding([[100, 90, 5, 4, 3, 2]], 2, 1, 0) == [(0, 1, 1, 1, 0, 0)]
    # the overlappable experts go, in id order, to the rank with the most free slots (lowest id on ties), whatever
    # their load: underloaded 3 -> r0, 2 -> r1, 1 -> r2, then 100 -> r0, 90 -> r1, 80 -> r2
    assert heterogeneous_sharding([[100, 90, 80, 3, 2, 1]], 3, 1, 3) == [(0, 1, 2, 0, 1, 2)]
    assert heterogeneous_sharding([[80, 90, 100, 3, 2, 1]], 3, 1, 3) == [(0, 1, 2, 0, 1, 2)]
    # one node of two ranks: the rank choice inside the node balances (same as two single-rank nodes)
    assert heterogeneous_sharding([[10, 9, 1, 1]], 2, 2, 0) == [(0, 1, 1, 0)]


def test_heterogeneous_per_layer_degrees():
    loads = [[1, 9, 3], [10, 2, 2]]
    # degrees [0, 1]: layer 1's expert 0 is overlappable. Layer 0 (hottest underloaded: 9) first:
    # 9 -> r0, 3 -> r1, 1 -> r1; layer 1: 2 -> r0 (tie on load, more free slots), 2 -> r1; then 10 -> r0.
    assert heterogeneous_sharding(loads, 2, 1, [0, 1]) == [(1, 0, 1), (0, 0, 1)]
    assert heterogeneous_sharding(loads, 2, 1, [0, 0]) == heterogeneous_sharding(loads, 2, 1, 0)
    assert heterogeneous_sharding(loads, 2, 1, [1, 1]) == heterogeneous_sharding(loads, 2, 1, 1)
    assert heterogeneous_sharding(loads, 2, 1, (0, 1)) == [(1, 0, 1), (0, 0, 1)]
    assert heterogeneous_sharding(loads, 2, 1, [0, 1]) != heterogeneous_sharding(loads, 2, 1, 0)


def test_heterogeneous_layers_may_be_uneven_per_rank():
    # totals are balanced across layers, not per layer: 3 + 1 experts on 2 ranks
    owners = heterogeneous_sharding([[5, 5, 5], [1]], 2, 1, 0)
    assert [sum(layer.count(r) for layer in owners) for r in range(2)] == [2, 2]
    assert sorted(owners[0].count(r) for r in range(2)) == [1, 2]


@pytest.mark.parametrize("world,rpn", [(4, 3), (6, 4), (3, 2), (2, 4)])
def test_heterogeneous_rejects_ranks_per_node_not_dividing(world, rpn):
    with pytest.raises(ValueError, match="ranks_per_node"):
        heterogeneous_sharding([[1.0] * 8], world, rpn, 0)


# ---------------------------------------------------------------------------------------------------------------
# 6. No torch needed
# ---------------------------------------------------------------------------------------------------------------
# One example run of all three modules; executed both here and in a process where torch cannot be imported.
_EXAMPLE = textwrap.dedent("""
    counts = [[400, 250, 59, 59, 58, 58, 58, 58] for _ in range(4)]
    owners = (0, 0, 1, 1, 2, 2, 3, 3)
    costs = StepCostModel(compute_s_per_pair=1e-4, token_transfer_s=1e-7, expert_transfer_s=1e-4, overlap_s=1e-3)
    predictor = LoadPredictor(2)
    predictor.push(counts)
    predictor.push([[0] * 8 for _ in range(4)])
    placement = schedule_materialization(predictor.predict(), owners, SearchSettings(costs, 4, 2))
    sharding = heterogeneous_sharding([predictor.expert_loads(), [1.0, 2.0, 3.0]], 4, 2, [1, 0])
    result = repr((placement, predictor.expert_loads(), sharding))
""")

_STANDALONE = planning_prelude() + textwrap.dedent("""
    search = importlib.import_module("standalone_planning.search")
    cost_model = importlib.import_module("standalone_planning.cost_model")
    predictor_mod = importlib.import_module("standalone_planning.predictor")
    heterogeneous = importlib.import_module("standalone_planning.heterogeneous")
    StepCostModel, SearchSettings = cost_model.StepCostModel, search.SearchSettings
    schedule_materialization = search.schedule_materialization
    LoadPredictor, heterogeneous_sharding = predictor_mod.LoadPredictor, heterogeneous.heterogeneous_sharding
""")


def test_scheduler_modules_need_no_torch():
    proc = subprocess.run([sys.executable, "-c", _STANDALONE + _EXAMPLE + "print(result)"], capture_output=True,
                          text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    ns = dict(StepCostModel=StepCostModel, SearchSettings=SearchSettings,
              schedule_materialization=schedule_materialization,
              LoadPredictor=LoadPredictor, heterogeneous_sharding=heterogeneous_sharding)
    exec(_EXAMPLE, ns)
    assert proc.stdout.strip() == ns["result"]
    placement, loads, sharding = eval(ns["result"])
    assert loads == [800.0, 500.0, 118.0, 118.0, 116.0, 116.0, 116.0, 116.0]
    for hot in (0, 1):                                                  # hot experts replicated on node 1
        assert any(hot in placement[r] for r in (2, 3))
    assert [sum(layer.count(r) for layer in sharding) for r in range(4)] == [3, 3, 3, 2]


def test_critical_path_search_stops_when_its_steps_cost_more_than_they_save():
    """Calibration after the gate (``critical_path``) stops once its last two steps' estimated work (microseconds of
    search, SearchWork) exceeds what they took off the layer's estimate: with a layer of a few hundred microseconds,
    where a step costs about as much host time as it can save, it keeps fewer replicas than the same search
    without that stop; with a layer of seconds it is within 1% of it. Every rank stops at the same step (the
    work model, not a clock)."""
    import numpy as np
    world, experts = 16, 32
    owners = tuple(even_sharding(experts, world))
    counts = np.full((world, experts), 4.0)
    counts[:, :4] = 400.0                                  # rank 0's experts hot
    start = [[e for e, o in enumerate(owners) if o == r] for r in range(world)]

    def added(compute_s_per_pair: float, critical: bool) -> int:
        costs = StepCostModel(compute_s_per_pair=compute_s_per_pair, token_transfer_s=1e-9, expert_transfer_s=1e-6)
        found = schedule_materialization(counts, owners, SearchSettings(costs, 8, 8, critical_path=critical),
                                         start=start, prefetched=start)
        return sum(len(r) for r in found) - experts
    assert added(2e-7, True) < added(2e-7, False), (added(2e-7, True), added(2e-7, False))
    # a layer of seconds: the stopped search ends on a plateau of steps that take nanoseconds off (spreading cold
    # experts), within 1% of the unstopped one
    assert added(2e-3, True) > 0
    costs = StepCostModel(compute_s_per_pair=2e-3, token_transfer_s=1e-9, expert_transfer_s=1e-6)
    stopped, full = (estimate_layer(counts, owners, schedule_materialization(
        counts, owners, SearchSettings(costs, 8, 8, critical_path=c), start=start, prefetched=start), costs, 8,
        prefetched=start).time_s
        for c in (True, False))
    assert stopped <= 1.01 * full, (stopped, full)

