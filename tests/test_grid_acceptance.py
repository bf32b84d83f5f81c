"""Issue 26, acceptance 1, held as the simulator computes it: on the 32-GPU grid (v100-4x8 and a100-4x8; gpt-moe-s
and bert-moe; W0-W7; host planning charged by the planner's work models, so the figures do not depend on the host
running them) Hecate is at least as fast as every baseline within 0.5%, and at least 95% of its force-balanced step
on W1, W2, W3, W5 and W6, 90% on W7, and the post-plan compute imbalance at most 1.15 but on W4. Model outputs of
ds_hecate's own planner, not timings: a planner change that gives a cell away fails here, where it would otherwise
only show when someone regenerates docs/benchmarks.md."""
from __future__ import annotations

import pytest

from benchmarks import simulated as gen

BASELINES = ("ep", "fastermoe", "smartmoe", "flexmoe")
FORCE_BALANCED = {"W1": 0.95, "W2": 0.95, "W3": 0.95, "W5": 0.95, "W6": 0.95, "W7": 0.90}


@pytest.fixture(scope="module")
def grid():
    return gen.run_all(large=())["grid"]


def _cell(rec) -> str:
    return f"{rec['cluster']}/{rec['model']}/{rec['workload']}"


def test_hecate_is_within_half_a_percent_of_every_baseline(grid):
    assert len(grid) == 32
    behind = []
    for rec in grid:
        systems = rec["systems"]
        hecate = systems["hecate"]["step_time_s"]
        name, best = min(((s, systems[s]["step_time_s"]) for s in BASELINES), key=lambda t: t[1])
        if hecate > best * 1.005:
            behind.append(f"{_cell(rec)}: hecate {hecate * 1e3:.1f} ms, {name} {best * 1e3:.1f} ms")
    assert not behind, behind


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
