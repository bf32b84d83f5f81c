"""The scheduler's quota move: when many ranks tie at the slowest time and the search budget allows only a few
greedy steps, one move gives every tied rank a replica at once (UltraEP's quota idea), on its own node first."""
from __future__ import annotations

import numpy as np

import ds_hecate.planning.search.greedy as greedy_search
from ds_hecate.planning.search import SEARCH_WORK, SearchSettings, schedule_materialization
from ds_hecate.planning.cost_model import StepCostModel, estimate_layer
from ds_hecate.planning.search.moves import quota_move
from ds_hecate.planning.search.state import SearchState

COSTS = StepCostModel(compute_s_per_pair=1e-6, token_transfer_s=1e-9, expert_transfer_s=1e-5, overlap_s=0.0)


def _tied_counts(world: int, hot_ranks, hot: int = 4000, cold: int = 100) -> np.ndarray:
    """One expert per rank; the experts of ``hot_ranks`` equally hot, every rank sending the same share."""
    per_expert = np.full(world, cold, dtype=np.int64)
    per_expert[list(hot_ranks)] = hot
    return np.tile(per_expert // world, (world, 1))


def _peak(counts, owners, mat) -> float:
    return estimate_layer(counts.tolist(), owners, mat, COSTS, 8).time_s


def test_quota_relieves_every_tied_bottleneck_within_a_few_steps(monkeypatch):
    """16 tied owners of 64 ranks, one slot per rank, a budget for two search steps: one replica per greedy step
    cannot lower a maximum that 15 other ranks share, so without the quota the greedy passes return the start
    layout (the proportional start, judged after them, is switched off here: it would relieve them too); with it
    the layer time drops by more than a third."""
    world = 64
    owners = list(range(world))
    counts = _tied_counts(world, range(16))
    moves = 4 * (min(world - 1, 64) + 2)
    budget = SEARCH_WORK.setup_cost_us(world, world) + 2.5 * SEARCH_WORK.step_cost_us(moves + 16, world, world)
    start = _peak(counts, owners, [[r] for r in range(world)])
    mat = schedule_materialization(counts.tolist(), owners, SearchSettings(COSTS, 1, 8, budget_us=budget))
    assert _peak(counts, owners, mat) < 0.65 * start
    relieved = [e for e in range(16) if sum(e in held for held in mat) >= 2]   # mat: experts per rank
    assert relieved == list(range(16))
    monkeypatch.setattr(greedy_search, "quota_move", lambda *a, **k: None)
    monkeypatch.setattr(greedy_search, "fill_slots", lambda *a, **k: 0)
    without = schedule_materialization(counts.tolist(), owners, SearchSettings(COSTS, 1, 8, budget_us=budget))
    assert _peak(counts, owners, without) == start


def test_quota_places_on_the_bottleneck_node_first():
    """Tied owners on two nodes, free ranks on both: each replica lands on its owner's node (tokens stay on it),
    on the least-loaded open rank there."""
    world, rpn = 16, 8
    owners = list(range(world))
    counts = _tied_counts(world, (0, 1, 8, 9))
    search = SearchState(counts.tolist(), owners, COSTS, rpn, None, None)
    extra = np.zeros(world, dtype=np.int64)
    pairs = quota_move(search, search.times, extra, 1)
    assert pairs is not None and len(pairs) == 4
    for expert, rank in pairs:
        assert rank // rpn == expert // rpn and rank not in (0, 1, 8, 9)
    assert len({rank for _, rank in pairs}) == 4


def test_no_quota_without_a_tie():
    world = 8
    counts = _tied_counts(world, (3,))
    search = SearchState(counts.tolist(), list(range(world)), COSTS, world, None, None)
    assert quota_move(search, search.times, np.zeros(world, dtype=np.int64), 1) is None
