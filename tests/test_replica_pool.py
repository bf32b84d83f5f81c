"""The replica pool (ds_hecate.planning.replica_pool): the whole budget lent, never more than the budget at once.

The allocator-measured side is tests/test_memory_budget.py (its ``pool`` run); these are the pool's own promises on
random models: the peak it can lend at once (every resident layer's slots plus one re-materializing layer's) stays
within the budget, resident layers leave less than one expert of the resident part unused, no layer gets less than
the even split, and forced settings force every layer.
"""
from __future__ import annotations

import random

import pytest

from ds_hecate.planning.replica_pool import ReplicaPool, even_share

MIB = 1 << 20


def _random_model(rng: random.Random):
    layers = rng.randint(1, 64)
    sizes = [rng.choice((1, 3, 84, 168, 336)) * MIB + rng.randint(0, 4096) for _ in range(rng.choice((1, 2)))]
    expert_bytes = [rng.choice(sizes) for _ in range(layers)]
    owned = [rng.choice((1, 2, 4, 8, 32)) for _ in range(layers)]
    budget_mb = rng.choice((0.0, 1.0, 100.0, 1024.0, 8192.0, 1e5)) * rng.random()
    setting = rng.choice((None, None, True, False))
    return budget_mb, expert_bytes, owned, setting


@pytest.mark.parametrize("seed", range(300))
def test_pool_lends_within_the_budget_and_wastes_less_than_an_expert(seed):
    rng = random.Random(seed)
    budget_mb, expert_bytes, owned, setting = _random_model(rng)
    pool = ReplicaPool.plan(budget_mb, expert_bytes, owned, setting)
    budget = int(budget_mb * MIB)
    layers = len(expert_bytes)
    assert len(pool.grants) == layers
    assert pool.peak_bytes <= budget
    assert all(g.replicas >= 0 for g in pool.grants)
    if setting is not None:
        assert all(g.rematerialize is setting for g in pool.grants)
    resident = [(g, b) for g, b in zip(pool.grants, expert_bytes) if not g.rematerialize]
    rm = [(g, b) for g, b in zip(pool.grants, expert_bytes) if g.rematerialize]
    even = [even_share(budget, b, layers) for b in expert_bytes]
    # nobody gets less than the pre-pool even split
    assert all(g.replicas >= e for g, e in zip(pool.grants, even))
    if resident:
        # the resident part is lent to the last whole expert of the last resident layer
        reserve = budget * len(rm) // layers
        unused = budget - reserve - pool.resident_bytes
        assert 0 <= unused < resident[-1][1]
    if rm and setting is None:
        # a layer re-materializes by default only where that gives it more than residency would
        assert all(g.replicas > even_share(budget, b, layers) for g, b in rm)


def test_rolling_share_uses_the_whole_budget_where_the_even_split_leaves_40_percent():
    """DeepSeek-V3's numbers from the issue: 8 GiB over 58 layers of 84 MiB experts (bf16), resident."""
    pool = ReplicaPool.plan(8192, [84 * MIB] * 58, [1] * 58, None)
    replicas = [g.replicas for g in pool.grants]
    assert not pool.rematerializes
    assert set(replicas) == {1, 2} and sum(replicas) == 8192 // 84 == 97   # the even split: 58 in all
    assert pool.resident_bytes > 0.99 * 8192 * MIB - 84 * MIB
    assert "97 in all" in pool.describe()


def test_mixed_layers_share_one_reserve_one_at_a_time():
    """Small-expert layers stay resident, large-expert ones (no resident slot) re-materialize from the reserve."""
    pool = ReplicaPool.plan(2000, [MIB] * 6 + [300 * MIB] * 2, [4] * 6 + [1] * 2, None)
    small, large = pool.grants[:6], pool.grants[6:]
    assert not any(g.rematerialize for g in small) and all(g.rematerialize for g in large)
    assert [g.replicas for g in large] == [1, 1]              # the reserve: 2 of 8 layers' share, 500 MiB
    assert [g.replicas for g in small] == [250] * 6           # the other 1,500 MiB, rolled over the resident layers
    assert pool.peak_bytes == 1500 * MIB + 300 * MIB
    # below one large expert in the reserve, re-materializing would give nothing: everything stays resident
    assert not ReplicaPool.plan(1024, [MIB] * 6 + [300 * MIB] * 2, [4] * 6 + [1] * 2, None).rematerializes


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="expert sizes"):
        ReplicaPool.plan(10, [0], [1], None)
    with pytest.raises(ValueError, match="2 expert sizes for 1 layers"):
        ReplicaPool.plan(10, [1, 2], [1], None)
