"""The scheduler's objective and its moves: what a rank waits for (exposed transfers are a barrier) and the
moves that keep a sending rank's tokens home (ds_hecate.planning.cost_model.rank_seconds,
ds_hecate.planning.search.moves.candidate_moves)."""
from __future__ import annotations

import numpy as np
import pytest

import ds_hecate.planning.search.greedy as greedy_search
from ds_hecate.planning.cost_model import StepCostModel, estimate_layer
from ds_hecate.planning.search import SearchSettings, schedule_materialization


def test_exposed_transfers_are_a_barrier_for_every_rank():
    """A rank enters the dispatch all-to-all once its gather is complete, and the all-to-all completes only when
    every rank has entered it: the estimate charges the slowest rank's exposed transfers to every rank. Three ranks,
    rank 1 given a copy of rank 0's expert after the gate (exposed, 5 ms): rank 0, which only sends it over its
    own link (5 ms too), and an idle rank 2 all wait the same 5 ms."""
    owners = (0, 1, 2)
    counts = np.zeros((3, 3))
    counts[:, 0] = 10.0
    costs = StepCostModel(compute_s_per_pair=1e-6, token_transfer_s=0.0, expert_transfer_s=5e-3)
    est = estimate_layer(counts, owners, ((0,), (0, 1), (2,)), costs, 3, prefetched=((0,), (1,), (2,)))
    compute = np.asarray(est.compute_pairs) * 1e-6
    assert np.allclose(np.asarray(est.rank_time_s) - compute, 5e-3), est.rank_time_s
    assert est.time_s == pytest.approx(max(compute) + 5e-3)


def test_search_keeps_a_senders_tokens_home(monkeypatch):
    """Rank 0 is slow for the rows it sends (600 to three other ranks' experts), not for what it computes: the only
    moves that help put copies of those experts on rank 0 itself, which the moves built from the bottleneck's own
    experts never try. The search takes them: the largest sender-side expert first. (The proportional start, which
    a fresh search also judges, is switched off: it would place a copy there too, and hide the move's absence.)"""
    monkeypatch.setattr(greedy_search, "fill_slots", lambda *a, **k: 0)
    owners = (0, 1, 2, 3)
    counts = np.ones((4, 4))
    counts[0] = (1.0, 300.0, 200.0, 100.0)
    costs = StepCostModel(compute_s_per_pair=1e-9, token_transfer_s=1e-5, expert_transfer_s=1e-7)
    found = schedule_materialization(counts, owners, SearchSettings(costs, 3, 4))
    assert 1 in found[0], found
    before = estimate_layer(counts, owners, [[0], [1], [2], [3]], costs, 4).time_s
    assert estimate_layer(counts, owners, found, costs, 4).time_s < 0.6 * before
