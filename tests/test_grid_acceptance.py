"""Issue 26, acceptance 1, held as the simulator computes it: on the 32-GPU grid (v100-4x8 and a100-4x8; gpt-moe-s
and bert-moe; W0-W7; host planning charged by the planner's work models, so the figures do not depend on the host
running them) Hecate's planner is at least as fast as every baseline within 0.5% when the runtimes are taken as lean
as a plain layer (no per-call overhead), at least 95% of its force-balanced step on W1, W2, W3, W5 and W6, 90% on
W7, and the post-plan compute imbalance at most 1.15 but on W4. Model outputs of ds_hecate's own planner, not
timings: a planner change that gives a cell away fails here, where it would otherwise only show when someone
regenerates docs/benchmarks.md.

Issue 41, acceptance 5: with the per-call runtime overhead charged (docs/simulator.md, "Call overhead": ds_hecate's
fitted on the runtime before issue 41's rework, an upper bound; the baselines charged nothing on GPU, none measured)
Hecate leads only on the cells of :data:`LEADS_WITH_CALL_OVERHEAD`, and on every other cell the overhead alone is
what puts it behind (docs/benchmarks.md, "Call overhead charged")."""
from __future__ import annotations

import pytest

from ds_hecate.sim import grid as gen

BASELINES = ("ep", "fastermoe", "smartmoe", "flexmoe")
FORCE_BALANCED = {"W1": 0.95, "W2": 0.95, "W3": 0.95, "W5": 0.95, "W6": 0.95, "W7": 0.90}


#: the cells where Hecate is still within 0.5% of the best of EP and the baselines with the call overhead charged:
#: the hot experts spread over all owners (W3), and on the V100 cluster the ragged sources (W4) and the zero-load
#: ranks (W5), where its lead without the overhead (1.13-1.49x) exceeds the charge (7-21% of its step)
LEADS_WITH_CALL_OVERHEAD = frozenset({
    "v100-4x8/gpt-moe-s/W3", "v100-4x8/bert-moe/W3", "a100-4x8/gpt-moe-s/W3", "a100-4x8/bert-moe/W3",
    "v100-4x8/gpt-moe-s/W4", "v100-4x8/bert-moe/W4", "v100-4x8/gpt-moe-s/W5", "v100-4x8/bert-moe/W5",
})


@pytest.fixture(scope="module")
def grid():
    return gen.run_all(large=())["grid"]


@pytest.fixture(scope="module")
def bare_grid():
    return gen.run_all(large=(), charge_call_overhead=False)["grid"]


def _cell(rec) -> str:
    return f"{rec['cluster']}/{rec['model']}/{rec['workload']}"


def _best(rec):
    systems = rec["systems"]
    return min(((s, systems[s]["step_time_s"]) for s in BASELINES), key=lambda t: t[1])


def test_hecate_is_within_half_a_percent_of_every_baseline(bare_grid):
    """The planner's claim: no per-call overhead charged to anyone."""
    assert len(bare_grid) == 32
    behind = []
    for rec in bare_grid:
        hecate = rec["systems"]["hecate"]["step_time_s"]
        name, best = _best(rec)
        assert rec["systems"]["hecate"]["breakdown_s"]["call_overhead"] == 0.0
        if hecate > best * 1.005:
            behind.append(f"{_cell(rec)}: hecate {hecate * 1e3:.1f} ms, {name} {best * 1e3:.1f} ms")
    assert not behind, behind


def test_with_call_overhead_hecate_leads_where_documented_and_only_the_overhead_puts_it_behind(grid):
    assert len(grid) == 32
    leads, unexplained = set(), []
    for rec in grid:
        hecate = rec["systems"]["hecate"]
        name, best = _best(rec)
        if hecate["step_time_s"] <= best * 1.005:
            leads.add(_cell(rec))
        elif hecate["step_time_s"] - hecate["breakdown_s"]["call_overhead"] > best * 1.005:
            unexplained.append(f"{_cell(rec)}: hecate {hecate['step_time_s'] * 1e3:.1f} ms "
                               f"({hecate['breakdown_s']['call_overhead'] * 1e3:.1f} of it call overhead), {name} "
                               f"{best * 1e3:.1f} ms")
        assert rec["systems"][name]["breakdown_s"]["call_overhead"] == 0.0, _cell(rec)   # baselines: none on GPU
    assert not unexplained, unexplained
    assert leads == LEADS_WITH_CALL_OVERHEAD, (sorted(leads - LEADS_WITH_CALL_OVERHEAD),
                                               sorted(LEADS_WITH_CALL_OVERHEAD - leads))


def test_hecate_is_near_its_force_balanced_step(grid):
    short = [f"{_cell(rec)}: {rec['systems']['hecate']['force_balanced_fraction']:.3f}" for rec in grid
             if rec["workload"] in FORCE_BALANCED
             and rec["systems"]["hecate"]["force_balanced_fraction"] < FORCE_BALANCED[rec["workload"]]]
    assert not short, short


def test_post_plan_imbalance_is_at_most_1_15_but_on_ragged_sources(grid):
    """W4 (ranks with 1.75x to 0.25x the mean tokens) is left out on purpose: there the step is the all-to-all (156 of
    249 ms on a100-4x8 gpt-moe-s, expert compute 30), the planner keeps the large ranks' tokens home on copies of
    the experts they send to, and they compute more (1.34-1.48, EP 1.36); a balanced placement costs more by the
    same estimate (docs/simulator.md, "W4")."""
    over = [f"{_cell(rec)}: {rec['systems']['hecate']['imbalance']:.2f}" for rec in grid
            if rec["workload"] != "W4" and rec["systems"]["hecate"]["imbalance"] > 1.15]
    assert not over, over
