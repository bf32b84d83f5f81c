"""Issue 26, acceptance 1, held as the simulator computes it: on the 32-GPU grid (v100-4x8 and a100-4x8; gpt-moe-s
and bert-moe; W0-W7; host planning charged by the planner's work models, so the figures do not depend on the host
running them) Hecate's planner is at least as fast as every baseline within 0.5% when the runtimes are taken as lean
as a plain layer (no per-call overhead), at least 95% of its force-balanced step on W1, W2, W3, W5 and W6, 90% on
W7, and the post-plan compute imbalance at most 1.15 but on W4. Model outputs of ds_hecate's own planner, not
timings: a planner change that gives a cell away fails here, where it would otherwise only show when someone
regenerates docs/benchmarks.md.

Issue 54, acceptance 2: with the per-call runtime overhead charged symmetrically (docs/simulator.md, "Call overhead":
every system but the ideal charged the CPU fit of its own layer's N-rank call, the byte terms scaled to each preset's
memory bandwidth) Hecate is within 0.5% of every baseline, and on W0 at least EP's speed, on the cells of
:data:`LEADS_WITH_CALL_OVERHEAD`, and on every other cell the charge difference alone is what puts it behind
(docs/benchmarks.md, section 4)."""
from __future__ import annotations

import pytest

from ds_hecate.sim import grid as gen

BASELINES = ("ep", "fastermoe", "smartmoe", "flexmoe")
FORCE_BALANCED = {"W1": 0.95, "W2": 0.95, "W3": 0.95, "W5": 0.95, "W6": 0.95, "W7": 0.90}


#: the cells where Hecate is within 0.5% of the best of EP and the baselines, and on W0 at least EP's speed, with the
#: call overhead charged symmetrically: every cell of the grid (its charge, 1.49 ms fixed + 1,775 ps per routed-row
#: byte at 21.2 GB/s, is below the baselines', AutoEP's 1.66 ms + 2,472 ps + 389 ps per owned byte)
LEADS_WITH_CALL_OVERHEAD = frozenset(f"{c}/{m}/{w}" for c in gen.GRID_CLUSTERS for m in gen.GRID_MODELS
                                     for w in gen.GRID_WORKLOADS)


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


def test_with_call_overhead_hecate_leads_where_documented_and_only_the_charge_puts_it_behind(grid):
    """Symmetric: the best baseline (and EP) is charged too; where Hecate is behind, its step less its charge is
    within 0.5% of the best's step less the best's charge, so the difference of the charges is what puts it behind."""
    assert len(grid) == 32
    leads, unexplained = set(), []
    for rec in grid:
        hecate = rec["systems"]["hecate"]
        name, best = _best(rec)
        charge = {s: rec["systems"][s]["breakdown_s"]["call_overhead"] for s in BASELINES}
        assert min(charge.values()) > 0, _cell(rec)   # the baselines are charged on the GPU presets too
        if hecate["step_time_s"] <= best * 1.005 and (rec["workload"] != "W0" or hecate["speedup_vs_ep"] >= 1.0):
            leads.add(_cell(rec))
        elif hecate["step_time_s"] - hecate["breakdown_s"]["call_overhead"] > (best - charge[name]) * 1.005:
            unexplained.append(f"{_cell(rec)}: hecate {hecate['step_time_s'] * 1e3:.1f} ms "
                               f"({hecate['breakdown_s']['call_overhead'] * 1e3:.1f} of it call overhead), {name} "
                               f"{best * 1e3:.1f} ms ({charge[name] * 1e3:.1f})")
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
