"""The proportional start (ds_hecate.planning.search.proportional): replicas in proportion to load as one more placement a
fresh search judges by its estimate, kept only where it beats the greedy passes' result and the owners by
``min_gain``."""
from __future__ import annotations

import numpy as np
import pytest

import ds_hecate.planning.search.greedy as greedy_search
from ds_hecate.planning.cost_model import StepCostModel, estimate_layer
from ds_hecate.planning.plan import holders_matrix
from ds_hecate.planning.search.proportional import fill_slots, proportional_fill
from ds_hecate.planning.search import SEARCH_WORK, SearchSettings, schedule_materialization
from ds_hecate.planning.sharding import even_sharding
from ds_hecate.sim.workloads import routing_counts

#: the runtime's cost model for 32 ranks of a100-4x8 (8 per node) and gpt-moe-s, as ``ds_hecate.sim`` builds it
A100_GPT = StepCostModel(compute_s_per_pair=1.133568e-07, token_transfer_s=2.048e-08, expert_transfer_s=4.7232e-05,
                         overlap_s=0.00072880226304, token_transfer_inter_s=9.8304e-07,
                         expert_transfer_inter_s=0.002267136, fanout=4, relay_chunks=4, relay_stream_ordered=True)
WORLD, EXPERTS, RPN, BUDGET = 32, 64, 8, 76


def _counts(workload: str) -> np.ndarray:
    return np.asarray(routing_counts(workload, 0, WORLD, EXPERTS, 8192, 2, seed=0), dtype=np.int64)


def _time(counts, owners, placement) -> float:
    return estimate_layer(counts, owners, placement, A100_GPT, RPN).time_s


def test_fill_gives_copies_by_load_per_copy_within_the_slots():
    owners = [0, 0, 1, 1]
    counts = np.array([[90, 30, 0, 10], [90, 30, 0, 10], [0, 0, 0, 10], [0, 0, 0, 10]])
    held = proportional_fill(counts, owners, 1)
    assert held[[0, 0, 1, 1], [0, 1, 2, 3]].all()             # the owners keep their experts
    assert (held.sum(axis=1) - np.bincount(owners, minlength=4) <= 1).all()
    assert held[:, 0].sum() == 4                                 # 180 pairs: every free slot it can use...
    assert held[:, 2].sum() == 1                                 # ...an expert without load gets no copy
    assert (proportional_fill(counts, owners, 1) == held).all()  # deterministic
    assert fill_slots(64, 32, 76) == 2 and fill_slots(8, 64, 5) == 1 and fill_slots(64, 32, 0) == 0


def test_ragged_sources_take_the_proportional_start_the_greedy_misses(monkeypatch):
    """Simulated W4 (ragged sources) on 32 ranks: a node of ranks waits on its NICs, no single replica shows, and
    the greedy passes keep the owners; the proportional start takes more than 5% off the estimate and is kept. (The
    node exchange, which relieves every node's NICs at once, is switched off: it finds a placement too.)"""
    monkeypatch.setattr(greedy_search, "node_exchange_moves", lambda *a, **k: [])
    counts = _counts("W4")
    owners = even_sharding(EXPERTS, WORLD)
    sharded = _time(counts, owners, [[2 * r, 2 * r + 1] for r in range(WORLD)])
    placed = schedule_materialization(counts, owners, SearchSettings(A100_GPT, BUDGET, RPN))
    assert _time(counts, owners, placed) < 0.95 * sharded
    assert holders_matrix(placed, WORLD, EXPERTS).sum() > EXPERTS
    monkeypatch.setattr(greedy_search, "fill_slots", lambda *a, **k: 0)
    greedy = schedule_materialization(counts, owners, SearchSettings(A100_GPT, BUDGET, RPN))
    assert _time(counts, owners, greedy) > 0.95 * sharded


def test_uniform_routing_does_not_take_it(monkeypatch):
    """W0: the proportional start gains less than ``min_gain`` (or loses): not taken; the node exchange's copies
    are (search_moves), and without them the owners stay."""
    counts = _counts("W0")
    owners = even_sharding(EXPERTS, WORLD)
    placed = holders_matrix(schedule_materialization(counts, owners, SearchSettings(A100_GPT, BUDGET, RPN)), WORLD,
                            EXPERTS)
    assert (placed != proportional_fill(counts, owners, fill_slots(EXPERTS, WORLD, BUDGET))).any()
    monkeypatch.setattr(greedy_search, "node_exchange_moves", lambda *a, **k: [])
    placed = schedule_materialization(counts, owners, SearchSettings(A100_GPT, BUDGET, RPN))
    assert holders_matrix(placed, WORLD, EXPERTS).sum() == EXPERTS


@pytest.mark.parametrize("calibrating", [False, True])
def test_only_a_fresh_search_within_its_budget_tries_it(monkeypatch, calibrating):
    """Calibration (a start, on the critical path) never pays for it; a budget that the greedy passes use up leaves
    it out."""
    counts = _counts("W4")
    owners = even_sharding(EXPERTS, WORLD)
    tried = []
    real = greedy_search.proportional_fill
    monkeypatch.setattr(greedy_search, "proportional_fill", lambda *a: tried.append(1) or real(*a))
    if calibrating:
        start = [[2 * r, 2 * r + 1] for r in range(WORLD)]
        schedule_materialization(counts, owners, SearchSettings(A100_GPT, BUDGET, RPN, critical_path=True),
                                 start=start, prefetched=start)
    else:
        budget = SEARCH_WORK.first_step_us(WORLD, EXPERTS) + 1.0
        schedule_materialization(counts, owners, SearchSettings(A100_GPT, BUDGET, RPN, budget_us=budget))
    assert not tried


@pytest.mark.parametrize("budget,kept", [(1, False), (2, True)])
def test_the_start_must_beat_the_owners_by_min_gain(monkeypatch, budget, kept):
    """Simulated W5 (zero-load ranks), the greedy moves switched off so that the passes keep the owners: one slot a
    rank takes 1.9% off the estimate, under the 5% bar, and the owners stay; two slots take 5.3% and are kept."""
    monkeypatch.setattr(greedy_search, "candidate_moves", lambda *a, **k: [])
    monkeypatch.setattr(greedy_search, "quota_move", lambda *a, **k: None)
    monkeypatch.setattr(greedy_search, "node_exchange_moves", lambda *a, **k: [])
    counts = _counts("W5")
    owners = even_sharding(EXPERTS, WORLD)
    sharded = _time(counts, owners, [[2 * r, 2 * r + 1] for r in range(WORLD)])
    placed = schedule_materialization(counts, owners, SearchSettings(A100_GPT, budget, RPN))
    assert (holders_matrix(placed, WORLD, EXPERTS).sum() > EXPERTS) == kept
    assert (_time(counts, owners, placed) <= 0.95 * sharded) == kept


def test_a_sliced_search_prefetches_it_from_its_first_call(monkeypatch):
    """Judged first, the proportional start is the best so far from the search's first call on: sliced over calls,
    W4's calls prefetch it while the greedy passes go on (judged last, it came in when they ended)."""
    from ds_hecate.planning.plan import materialized_of
    from ds_hecate.planning.search.reuse import ScheduleReuse
    monkeypatch.setattr(greedy_search, "node_exchange_moves", lambda *a, **k: [])
    counts = _counts("W4").astype(np.float64)
    owners = even_sharding(EXPERTS, WORLD)
    schedule = ScheduleReuse(0.05)
    first = schedule.schedule(counts, owners, SearchSettings(A100_GPT, BUDGET, RPN), slice_us=1.0)
    assert schedule.pending is not None                      # the search goes on at the next calls
    assert first == materialized_of(proportional_fill(counts, owners, fill_slots(EXPERTS, WORLD, BUDGET)))


def test_its_work_is_counted_when_the_passes_take_no_step(monkeypatch):
    """The judgement's work is part of the search's: counted by a meter even where the greedy passes find no move at
    all (the simulator charges what the meter counts)."""
    from ds_hecate.planning.search.call_work import WorkMeter
    for name in ("candidate_moves", "node_exchange_moves"):
        monkeypatch.setattr(greedy_search, name, lambda *a, **k: [])
    monkeypatch.setattr(greedy_search, "quota_move", lambda *a, **k: None)
    counts = _counts("W4")
    owners = even_sharding(EXPERTS, WORLD)
    meter = WorkMeter()
    schedule_materialization(counts, owners, SearchSettings(A100_GPT, BUDGET, RPN), meter=meter)
    fill_us = SEARCH_WORK.fill_cost_us(fill_slots(EXPERTS, WORLD, BUDGET) * WORLD, WORLD, EXPERTS)
    assert meter.us == pytest.approx(SEARCH_WORK.setup_cost_us(WORLD, EXPERTS) + fill_us)
