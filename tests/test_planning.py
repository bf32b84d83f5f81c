"""Tests of the Hecate planner (ds_hecate.planning) without torch.distributed.

Pure planning code: sharded placement P, materialized placement P' for the three policies, topology-aware
dispatch, the LayerPlan derived quantities the collectives rely on, validate_plan and the cost model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List, Set, Tuple

import pytest

from strategies import topologies

from standalone import planning_prelude
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
PLANNING_DIR = REPO / "ds_hecate" / "planning"

# Modules of ds_hecate that use torch.distributed (directly or through the runtime); the planner must not pull
# them in.
DISTRIBUTED_MODULES = ("ds_hecate.comm.collectives", "ds_hecate.runtime.hecate", "ds_hecate.deepspeed_glue.convert", "ds_hecate.deepspeed_glue.engine",
                       "ds_hecate.runtime.shard_store")


def _fresh_import_report() -> dict:
    code = textwrap.dedent("""
        import json, sys
        import ds_hecate.planning
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("ds_hecate"))))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    return {"modules": json.loads(proc.stdout.strip().splitlines()[-1])}


def _standalone_planning_without_torch() -> str:
    """Load ds_hecate/planning as a top-level package in a subprocess where torch and deepspeed cannot be
    imported at all; return the repr of a plan computed there."""
    code = planning_prelude() + textwrap.dedent("""
        plan = planning.plan_layer([[3, 0], [1, 4]], planning.even_sharding(2, 2), "cost",
                                   planning.CommCostModel(hidden_size=1, expert_numel=1), 1)
        print(repr(plan))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


# ---- module-level check: importing the planner must not import the torch.distributed-using modules ------------
_IMPORT_REPORT = _fresh_import_report()
assert "ds_hecate.planning" in _IMPORT_REPORT["modules"]
_LEAKED = [m for m in DISTRIBUTED_MODULES if m in _IMPORT_REPORT["modules"]]
assert not _LEAKED, f"importing ds_hecate.planning imported torch.distributed-using modules: {_LEAKED}"

from ds_hecate.planning import CommCostModel, LayerPlan, POLICIES, even_sharding, plan_layer  # noqa: E402
from ds_hecate.planning.dispatch import split_evenly, topology_aware_routes  # noqa: E402
from ds_hecate.planning.plan import check_routes_cover, validate_plan  # noqa: E402


def test_import_does_not_pull_distributed_modules():
    assert "ds_hecate.planning.plan" in _IMPORT_REPORT["modules"]
    for m in DISTRIBUTED_MODULES:
        assert m not in _IMPORT_REPORT["modules"]


def test_planning_package_runs_without_torch_at_all():
    out = _standalone_planning_without_torch()
    # hidden=1, numel=1: expert_bytes=8, token_bytes(n)=16n > 8 for any n>=1: every rank materializes what it uses.
    assert out == ("LayerPlan(world_size=2, num_experts=2, owners=(0, 1), materialized=((0,), (0, 1)), "
                   "routes=((((0, 3),), ()), (((1, 1),), ((1, 4),))))")


# ---------------------------------------------------------------------------------------------------------------
# even_sharding
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_experts,world,expected", [
    (8, 4, (0, 0, 1, 1, 2, 2, 3, 3)),
    (5, 2, (0, 0, 0, 1, 1)),
    (7, 3, (0, 0, 0, 1, 1, 2, 2)),
    (3, 5, (0, 1, 2)),
    (1, 1, (0,)),
    (1, 8, (0,)),
    (4, 1, (0, 0, 0, 0)),
])
def test_even_sharding_examples(num_experts, world, expected):
    assert even_sharding(num_experts, world) == expected


@pytest.mark.parametrize("world", range(1, 11))
@pytest.mark.parametrize("num_experts", range(1, 21))
def test_even_sharding_properties(num_experts, world):
    owners = even_sharding(num_experts, world)
    assert isinstance(owners, tuple)
    assert len(owners) == num_experts
    assert all(0 <= o < world for o in owners)
    # contiguous blocks: non-decreasing, so each rank's experts form one interval
    assert list(owners) == sorted(owners)
    sizes = [owners.count(r) for r in range(world)]
    assert max(sizes) - min(sizes) <= 1
    # the larger blocks come first (rank r holds [r*E/N, (r+1)*E/N) rounded DeepSpeed's way)
    assert sizes == sorted(sizes, reverse=True)
    if num_experts < world:
        assert sizes[:num_experts] == [1] * num_experts
        assert sizes[num_experts:] == [0] * (world - num_experts)
    else:
        assert min(sizes) >= 1


@pytest.mark.parametrize("num_experts,world", [(0, 1), (1, 0), (0, 0), (-1, 2), (4, -2)])
def test_even_sharding_rejects_bad_inputs(num_experts, world):
    with pytest.raises(ValueError, match="even_sharding"):
        even_sharding(num_experts, world)


# ---------------------------------------------------------------------------------------------------------------
# Cost model
# ---------------------------------------------------------------------------------------------------------------
def test_cost_model_bytes():
    c = CommCostModel(hidden_size=8, expert_numel=64, activation_bytes=2, param_bytes=2, grad_bytes=4)
    assert c.token_bytes(1) == 4 * 8 * 2
    assert c.token_bytes(0) == 0
    assert c.expert_bytes == 64 * 6


def test_cost_model_threshold_exact():
    c = CommCostModel(hidden_size=8, expert_numel=64, activation_bytes=2, param_bytes=2, grad_bytes=4)
    # 4*n*8*2 = 64n  vs  64*(2+4) = 384: equal at n=6, which is NOT cheaper (strict inequality)
    assert not c.materialize_is_cheaper(0)
    assert not c.materialize_is_cheaper(5)
    assert not c.materialize_is_cheaper(6)
    assert c.materialize_is_cheaper(7)
    d = CommCostModel(hidden_size=1, expert_numel=5)  # defaults: 4 bytes each: 16n vs 40
    assert [d.materialize_is_cheaper(n) for n in range(5)] == [False, False, False, True, True]


@settings(max_examples=300, deadline=None)
@given(hidden=st.integers(1, 8192), numel=st.integers(1, 10 ** 9), act=st.sampled_from([1, 2, 4, 8]),
       pb=st.sampled_from([1, 2, 4, 8]), gb=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 10 ** 6))
def test_cost_model_threshold_property(hidden, numel, act, pb, gb, n):
    c = CommCostModel(hidden_size=hidden, expert_numel=numel, activation_bytes=act, param_bytes=pb, grad_bytes=gb)
    assert c.materialize_is_cheaper(n) == (4 * n * hidden * act > numel * (pb + gb))
    # exactly at the crossing point: the smallest n with 4*n*hidden*act > numel*(pb+gb)
    n_star = numel * (pb + gb) // (4 * hidden * act) + 1
    assert c.materialize_is_cheaper(n_star)
    assert not c.materialize_is_cheaper(n_star - 1)


# ---------------------------------------------------------------------------------------------------------------
# Invariant checker shared by hand-built, adversarial and property tests
# ---------------------------------------------------------------------------------------------------------------
def expected_materialized(counts, owners, policy, cost):
    world = len(counts)
    sets: List[Set[int]] = [set() for _ in range(world)]
    for e, o in enumerate(owners):
        sets[o].add(e)
    for r in range(world):
        for e, n in enumerate(counts[r]):
            if n <= 0:
                continue
            if policy == "local" or (policy == "cost" and 4 * n * cost.hidden_size * cost.activation_bytes
                                     > cost.expert_numel * (cost.param_bytes + cost.grad_bytes)):
                sets[r].add(e)
    return tuple(tuple(sorted(s)) for s in sets)


def check_plan_invariants(plan, counts, owners, policy, cost, ranks_per_node):
    world, num_e = len(counts), len(owners)
    rpn = ranks_per_node or world
    node = lambda r: r // rpn  # noqa: E731
    assert plan.world_size == world and plan.num_experts == num_e and plan.owners == tuple(owners)
    mat = plan.materialized
    assert mat == expected_materialized(counts, owners, policy, cost)
    # P subset of P'
    for e, o in enumerate(owners):
        assert e in mat[o]
    for r in range(world):
        assert list(mat[r]) == sorted(set(mat[r]))
    holders = [[r for r in range(world) if e in mat[r]] for e in range(num_e)]

    for src in range(world):
        for e in range(num_e):
            n = counts[src][e]
            routes = plan.routes[src][e]
            # every (src, expert) count is routed exactly once
            assert sum(c for _, c in routes) == n
            dsts = [d for d, _ in routes]
            assert dsts == sorted(set(dsts)), "one entry per destination, sorted"
            assert all(c > 0 for _, c in routes), "no empty routes"
            # tokens only go to ranks that materialized the expert
            for d in dsts:
                assert e in mat[d]
            if n == 0:
                assert routes == ()
                continue
            if e in mat[src]:
                assert routes == ((src, n),), "token must stay local when its expert is on its rank"
                continue
            same_node = [r for r in holders[e] if node(r) == node(src)]
            if same_node:
                assert all(node(d) == node(src) for d in dsts), "must not cross nodes when the node has it"
                eligible = same_node
            else:
                assert all(node(d) != node(src) for d in dsts)
                eligible = holders[e]
            per = dict(routes)
            loads = [per.get(r, 0) for r in eligible]
            assert set(per) <= set(eligible)
            assert max(loads) - min(loads) <= 1, "spread over eligible replicas must be even"
            assert sum(loads) == n

    # token matrix and splits
    for r in range(world):
        assert sum(plan.send_splits(r)) == sum(counts[r])
        for d in range(world):
            assert plan.send_splits(r)[d] == plan.recv_splits(d)[r]
    total = sum(map(sum, counts))
    assert sum(plan.tokens_processed(r) for r in range(world)) == total
    for e in range(num_e):
        assert sum(plan.expert_load_on(r)[e] for r in range(world)) == sum(counts[s][e] for s in range(world))
        for r in range(world):
            if e not in mat[r]:
                assert plan.expert_load_on(r)[e] == 0

    # SparseAllGather pairs
    expected_pairs = tuple(sorted((e, d) for d in range(world) for e in mat[d] if owners[e] != d))
    assert plan.gather_pairs == expected_pairs
    assert plan.num_moved == len(plan.gather_pairs) == sum(len(m) for m in mat) - num_e
    seen: List[Tuple[int, int]] = []
    for owner in range(world):
        sends = plan.gather_sends(owner)
        for dst, experts in sends.items():
            assert experts == sorted(experts)
            assert all(owners[e] == owner for e in experts)
            seen.extend((e, dst) for e in experts)
        for dst in range(world):
            assert sends.get(dst, []) == plan.gather_recvs(dst).get(owner, [])
    assert sorted(seen) == list(expected_pairs)

    # deterministic: same inputs -> equal plan
    again = plan_layer(counts, owners, policy, cost, ranks_per_node)
    assert again == plan and repr(again) == repr(plan) and hash(again) == hash(plan)
    validate_plan(plan)


# ---------------------------------------------------------------------------------------------------------------
# plan_layer on hand-built counts
# ---------------------------------------------------------------------------------------------------------------
# 4 ranks in 2 nodes of 2, 4 experts, expert e owned by rank e.
COUNTS_A = [[5, 0, 3, 0],
            [0, 2, 0, 7],
            [1, 1, 1, 1],
            [0, 0, 0, 0]]
OWNERS_A = (0, 1, 2, 3)
# hidden=1, numel=5, 4 bytes each: 16n > 40  <=>  n >= 3
COST_A = CommCostModel(hidden_size=1, expert_numel=5)


def test_plan_owner_policy_hand_built():
    plan = plan_layer(COUNTS_A, OWNERS_A, "owner", None, 2)
    assert plan.materialized == ((0,), (1,), (2,), (3,))
    assert plan.routes == (
        (((0, 5),), (), ((2, 3),), ()),
        ((), ((1, 2),), (), ((3, 7),)),
        (((0, 1),), ((1, 1),), ((2, 1),), ((3, 1),)),
        ((), (), (), ()),
    )
    assert plan.gather_pairs == () and plan.num_moved == 0
    assert plan.send_splits(0) == [5, 0, 3, 0]
    assert plan.recv_splits(3) == [0, 7, 1, 0]
    assert plan.tokens_processed(3) == 8
    check_plan_invariants(plan, COUNTS_A, OWNERS_A, "owner", None, 2)


def test_plan_local_policy_hand_built():
    plan = plan_layer(COUNTS_A, OWNERS_A, "local", None, 2)
    assert plan.materialized == ((0, 2), (1, 3), (0, 1, 2, 3), (3,))
    assert plan.routes == (
        (((0, 5),), (), ((0, 3),), ()),
        ((), ((1, 2),), (), ((1, 7),)),
        (((2, 1),), ((2, 1),), ((2, 1),), ((2, 1),)),
        ((), (), (), ()),
    )
    # no token leaves its rank
    for r in range(4):
        assert plan.send_splits(r) == [sum(COUNTS_A[r]) if d == r else 0 for d in range(4)]
    assert plan.gather_pairs == ((0, 2), (1, 2), (2, 0), (3, 1), (3, 2))
    assert plan.gather_sends(0) == {2: [0]}
    assert plan.gather_sends(3) == {1: [3], 2: [3]}
    assert plan.gather_recvs(2) == {0: [0], 1: [1], 3: [3]}
    assert plan.num_moved == 5
    check_plan_invariants(plan, COUNTS_A, OWNERS_A, "local", None, 2)


def test_plan_cost_policy_hand_built():
    plan = plan_layer(COUNTS_A, OWNERS_A, "cost", COST_A, 2)
    # rank 0 gathers expert 2 (3 tokens: 48 > 40), rank 1 expert 3 (7 tokens); rank 2's single tokens do not pay
    assert plan.materialized == ((0, 2), (1, 3), (2,), (3,))
    assert plan.routes == (
        (((0, 5),), (), ((0, 3),), ()),
        ((), ((1, 2),), (), ((1, 7),)),
        # e0: held only on node 0 -> crosses; e1: only rank 1; e2 local; e3: held by 1 and 3, 3 is on rank 2's node
        (((0, 1),), ((1, 1),), ((2, 1),), ((3, 1),)),
        ((), (), (), ()),
    )
    assert plan.gather_pairs == ((2, 0), (3, 1))
    assert plan.gather_sends(2) == {0: [2]} and plan.gather_sends(3) == {1: [3]}
    assert plan.gather_recvs(0) == {2: [2]} and plan.gather_recvs(1) == {3: [3]}
    check_plan_invariants(plan, COUNTS_A, OWNERS_A, "cost", COST_A, 2)


def test_plan_cost_policy_single_node_prefers_nothing_but_holders():
    # one node of 4: rank 2 sends its expert-3 token to a holder; both 1 and 3 are on its node.
    plan = plan_layer(COUNTS_A, OWNERS_A, "cost", COST_A, 4)
    # split_evenly(1, [1, 3], src=2): start = 2 % 2 = 0 -> the single token goes to rank 1
    assert plan.routes[2][3] == ((1, 1),)
    check_plan_invariants(plan, COUNTS_A, OWNERS_A, "cost", COST_A, 4)


def test_plan_spreads_over_same_node_replicas():
    # 1 expert owned by rank 0; ranks 1 and 2 have enough tokens to gather it, rank 3 does not.
    cost = CommCostModel(hidden_size=1, expert_numel=100)  # 16n > 800 <=> n >= 51
    counts = [[0], [60], [60], [7]]
    plan = plan_layer(counts, (0,), "cost", cost, 4)
    assert plan.materialized == ((0,), (0,), (0,), ())
    # 7 over [0, 1, 2]: base 2, remainder 1 given to rotation start 3 % 3 = 0
    assert plan.routes[3][0] == ((0, 3), (1, 2), (2, 2))
    check_plan_invariants(plan, counts, (0,), "cost", cost, 4)
    # two nodes of 2: rank 3 only sees rank 2 on its node
    plan2 = plan_layer(counts, (0,), "cost", cost, 2)
    assert plan2.routes[3][0] == ((2, 7),)
    check_plan_invariants(plan2, counts, (0,), "cost", cost, 2)
    # one rank per node: no holder on rank 3's node -> spread over all holders
    plan3 = plan_layer(counts, (0,), "cost", cost, 1)
    assert plan3.routes[3][0] == ((0, 3), (1, 2), (2, 2))
    check_plan_invariants(plan3, counts, (0,), "cost", cost, 1)


def test_plan_ranks_per_node_defaults_to_one_node():
    counts = [[0], [60], [0], [7]]
    cost = CommCostModel(hidden_size=1, expert_numel=100)
    assert plan_layer(counts, (0,), "cost", cost) == plan_layer(counts, (0,), "cost", cost, 4)
    # 7 over [0, 1], start 3 % 2 = 1 -> remainder to rank 1
    assert plan_layer(counts, (0,), "cost", cost).routes[3][0] == ((0, 3), (1, 4))


def test_split_evenly_rotation():
    assert split_evenly(5, [1, 4, 6], src=0) == ((1, 2), (4, 2), (6, 1))
    assert split_evenly(5, [1, 4, 6], src=1) == ((1, 1), (4, 2), (6, 2))
    assert split_evenly(5, [1, 4, 6], src=2) == ((1, 2), (4, 1), (6, 2))
    assert split_evenly(2, [1, 4, 6], src=0) == ((1, 1), (4, 1))
    assert split_evenly(0, [1, 4], src=0) == ()


def test_dispatch_expert_materialized_nowhere_raises():
    with pytest.raises(ValueError, match="materialized nowhere"):
        topology_aware_routes([[0, 3]], ((0,),), 1)


def test_plan_layer_policy_errors():
    assert set(POLICIES) == {"owner", "local", "cost", "shadow", "all"}
    with pytest.raises(ValueError, match="unknown placement policy"):
        plan_layer(COUNTS_A, OWNERS_A, "greedy", COST_A, 2)
    with pytest.raises(ValueError, match="CommCostModel"):
        plan_layer(COUNTS_A, OWNERS_A, "cost", None, 2)


def test_plan_layer_rejects_negative_counts():
    with pytest.raises(ValueError):
        plan_layer([[1, -2]], (0, 0), "owner")
    with pytest.raises(ValueError):
        plan_layer([[0, -2], [0, 0]], (0, 0), "owner")


def test_plan_layer_rejects_more_count_columns_than_experts():
    with pytest.raises(ValueError):
        plan_layer([[1, 2, 3]], (0, 0), "owner")


@pytest.mark.parametrize("counts,owners", [
    ([[1, 2]], (0, 1)),          # owner rank 1 in a world of 1
    ([[1, 2]], (0, 0, 0)),       # 3 experts, counts for 2
    ([[1, 2], [1]], (0, 1)),     # ragged counts
])
def test_plan_layer_rejects_inconsistent_shapes_with_value_error(counts, owners):
    with pytest.raises(ValueError):
        plan_layer(counts, owners, "owner")


# ---------------------------------------------------------------------------------------------------------------
# Adversarial counts
# ---------------------------------------------------------------------------------------------------------------
ADV_COST = CommCostModel(hidden_size=1, expert_numel=20)  # 16n > 160 <=> n >= 11


def _adversarial_cases():
    world, num_e, rpn = 6, 5, 3
    owners = even_sharding(num_e, world)  # (0, 1, 2, 3, 4): rank 5 owns nothing
    hot = [[50 if e == 2 else 0 for e in range(num_e)] for _ in range(world)]
    zeros = [[0] * num_e for _ in range(world)]
    zero_row = [[(3 * r + e) % 13 for e in range(num_e)] for r in range(world)]
    zero_row[4] = [0] * num_e
    zero_col = [[(5 * r + 2 * e) % 17 + 1 for e in range(num_e)] for r in range(world)]
    for r in range(world):
        zero_col[r][3] = 0
    return [("all_to_one_expert", hot), ("all_zero", zeros), ("zero_row", zero_row), ("zero_column", zero_col)], \
        owners, rpn


@pytest.mark.parametrize("policy", ["owner", "local", "cost"])
def test_adversarial_counts(policy):
    cases, owners, rpn = _adversarial_cases()
    cost = ADV_COST if policy == "cost" else None
    for name, counts in cases:
        plan = plan_layer(counts, owners, policy, cost, rpn)
        check_plan_invariants(plan, counts, owners, policy, cost, rpn)
        if name == "all_to_one_expert":
            # every token is for expert 2; owner: all go to rank 2; local/cost (50 tokens pay): all stay local
            for r in range(6):
                if policy == "owner":
                    assert plan.routes[r][2] == ((2, 50),)
                else:
                    assert plan.routes[r][2] == ((r, 50),)
            assert plan.num_moved == (0 if policy == "owner" else 5)
            assert plan.tokens_processed(2) == (300 if policy == "owner" else 50)
        elif name == "all_zero":
            assert plan.materialized == ((0,), (1,), (2,), (3,), (4,), ())
            assert all(rt == () for per in plan.routes for rt in per)
            assert plan.num_moved == 0
            assert all(plan.send_splits(r) == [0] * 6 for r in range(6))
        elif name == "zero_row":
            assert all(rt == () for rt in plan.routes[4])
            assert plan.send_splits(4) == [0] * 6
            assert plan.materialized[4] == (4,)
        elif name == "zero_column":
            assert [r for r in range(6) if 3 in plan.materialized[r]] == [3]
            assert all(plan.routes[r][3] == () for r in range(6))
            assert all(plan.expert_load_on(r)[3] == 0 for r in range(6))


def test_single_rank_world():
    for policy in ("owner", "local", "cost"):
        cost = ADV_COST if policy == "cost" else None
        plan = plan_layer([[4, 0, 9]], (0, 0, 0), policy, cost, 1)
        assert plan.materialized == ((0, 1, 2),)
        assert plan.routes == ((((0, 4),), (), ((0, 9),)),)
        assert plan.num_moved == 0
        check_plan_invariants(plan, [[4, 0, 9]], (0, 0, 0), policy, cost, 1)


# ---------------------------------------------------------------------------------------------------------------
# Property tests: invariants for any counts
# ---------------------------------------------------------------------------------------------------------------
@st.composite
def planner_inputs(draw):
    world, num_e, rpn, owners = draw(topologies(8, 16))
    sparse = draw(st.booleans())
    cell = st.one_of(st.just(0), st.integers(0, 50)) if sparse else st.integers(0, 50)
    counts = [draw(st.lists(cell, min_size=num_e, max_size=num_e)) for _ in range(world)]
    policy = draw(st.sampled_from(["owner", "local", "cost"]))
    cost = None
    if policy == "cost" or draw(st.booleans()):  # non-cost policies must ignore a given cost model
        cost = CommCostModel(hidden_size=draw(st.integers(1, 16)), expert_numel=draw(st.integers(1, 400)),
                             activation_bytes=draw(st.sampled_from([2, 4])))
    pass_rpn = draw(st.booleans()) or rpn != world
    return counts, owners, policy, cost, (rpn if pass_rpn else None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_inputs())
def test_plan_invariants_property(inputs):
    counts, owners, policy, cost, rpn = inputs
    plan = plan_layer(counts, owners, policy, cost, rpn)
    check_plan_invariants(plan, counts, owners, policy, cost, rpn)


@settings(max_examples=200, deadline=None)
@given(planner_inputs())
def test_policies_are_ordered(inputs):
    """owner placement is contained in cost placement, which is contained in local placement; local moves no
    token off its rank and owner moves no expert."""
    counts, owners, _, _, rpn = inputs
    cost = CommCostModel(hidden_size=3, expert_numel=50)
    p_owner = plan_layer(counts, owners, "owner", None, rpn)
    p_cost = plan_layer(counts, owners, "cost", cost, rpn)
    p_local = plan_layer(counts, owners, "local", None, rpn)
    world = len(counts)
    for r in range(world):
        assert set(p_owner.materialized[r]) <= set(p_cost.materialized[r]) <= set(p_local.materialized[r])
        assert p_local.send_splits(r) == [sum(counts[r]) if d == r else 0 for d in range(world)]
    assert p_owner.num_moved == 0
    for src in range(world):
        for e, n in enumerate(counts[src]):
            assert p_owner.routes[src][e] == (((owners[e], n),) if n else ())


# ---------------------------------------------------------------------------------------------------------------
# Independence from the Python hash seed
# ---------------------------------------------------------------------------------------------------------------
# The planning package is loaded standalone (it needs neither torch nor the rest of ds_hecate) to keep this fast.
_HASH_SCRIPT = planning_prelude(block_torch=False) + textwrap.dedent("""
    import random
    CommCostModel, even_sharding, plan_layer = planning.CommCostModel, planning.even_sharding, planning.plan_layer
    rng = random.Random(1234)
    out = []
    for i in range(60):
        world = rng.choice([1, 2, 3, 4, 6, 8])
        num_e = rng.randint(1, 16)
        rpn = rng.choice([d for d in range(1, world + 1) if world % d == 0])
        owners = even_sharding(num_e, world) if i % 2 else tuple(rng.randrange(world) for _ in range(num_e))
        counts = [[rng.choice([0, 0, rng.randint(0, 50)]) for _ in range(num_e)] for _ in range(world)]
        for policy in ("owner", "local", "cost"):
            cost = CommCostModel(hidden_size=rng.randint(1, 8), expert_numel=rng.randint(1, 200))
            plan = plan_layer(counts, owners, policy, cost, rpn)
            out.append(repr(plan) + repr(plan.gather_pairs) + repr(plan.token_matrix)
                       + repr([plan.gather_sends(r) for r in range(world)]))
    print("\\n".join(out))
""")


def _plans_with_hash_seed(seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    proc = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=120, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_plan_independent_of_hash_seed():
    a = _plans_with_hash_seed("0")
    b = _plans_with_hash_seed("987654321")
    assert a.count("LayerPlan(") == 180
    assert a == b


# ---------------------------------------------------------------------------------------------------------------
# validate_plan
# ---------------------------------------------------------------------------------------------------------------
def _good_fields():
    return dict(world_size=2, num_experts=2, owners=(0, 1), materialized=((0,), (0, 1)),
                routes=((((0, 2),), ((1, 1),)), (((1, 3),), ((1, 4),))))


def test_validate_plan_accepts_good_plan():
    plan = LayerPlan(**_good_fields())
    validate_plan(plan)
    check_routes_cover(plan, [[2, 1], [3, 4]])
    with pytest.raises(ValueError, match="cover"):
        check_routes_cover(plan, [[2, 1], [3, 5]])


@pytest.mark.parametrize("change,match", [
    # owner not materializing its expert
    (dict(materialized=((), (0, 1)), routes=(((), ((1, 1),)), (((1, 3),), ((1, 4),)))), "owner 0 of expert 0"),
    (dict(materialized=((0,), (0,)), routes=((((0, 2),), ((0, 1),)), (((1, 3),), ((0, 4),)))), "owner 1 of expert 1"),
    # routes to a rank lacking the expert
    (dict(routes=((((0, 2),), ((0, 1),)), (((1, 3),), ((1, 4),)))), "lacks it"),
    # unsorted / duplicated / out-of-range materialized list
    (dict(materialized=((0,), (1, 0))), "sorted unique"),
    (dict(materialized=((0, 0), (0, 1))), "sorted unique"),
    (dict(materialized=((0,), (0, 1, 2))), "sorted unique"),
    (dict(materialized=((0,), (-1, 0, 1))), "sorted unique"),
    # wrong shapes
    (dict(materialized=((0,), (0, 1), ())), "materialized must list 2"),
    (dict(materialized=((0,),)), "materialized must list 2"),
    (dict(owners=(0, 1, 1)), "owners"),
    (dict(owners=(0,)), "owners"),
    (dict(owners=(0, 2)), "owners"),
    (dict(owners=(0, -1)), "owners"),
    (dict(routes=((((0, 2),), ((1, 1),)),)), r"routes must be \[world_size\]\[num_experts\]"),
    (dict(routes=((((0, 2),),), (((1, 3),), ((1, 4),)))), r"routes must be \[world_size\]\[num_experts\]"),
    (dict(routes=((((0, 2),), ((1, 1),), ()), (((1, 3),), ((1, 4),), ()))),
     r"routes must be \[world_size\]\[num_experts\]"),
    # bad route entries
    (dict(routes=((((0, -2),), ((1, 1),)), (((1, 3),), ((1, 4),)))), "bad route"),
    (dict(routes=((((2, 2),), ((1, 1),)), (((1, 3),), ((1, 4),)))), "bad route"),
])
def test_validate_plan_rejects_malformed(change, match):
    fields = dict(_good_fields(), **change)
    with pytest.raises(ValueError, match=match):
        LayerPlan(**fields)


def test_validate_plan_direct_call_on_mutated_plan():
    plan = LayerPlan(**_good_fields())
    object.__setattr__(plan, "materialized", ((0,), (1, 0)))
    with pytest.raises(ValueError, match="sorted unique"):
        validate_plan(plan)
