"""Fraction of the force-balanced ideal (UltraEP's metric) in the simulator, the benchmark report and stats().

The forced-uniform routing (ds_hecate.planning.balance.force_uniform) keeps every rank's pairs and spreads them
evenly; the simulator's fraction is exactly 1 on the balanced workload and far below 1 for expert parallelism on a
hot-rank one; the benchmark report finds W0 as the forced-uniform run from the routing (not the name) and says n/a
where no run qualifies; stats() carries the cost-model estimate per layer.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import step as bench  # noqa: E402
from benchmarks.step_measure import SCHEMA  # noqa: E402
from benchmarks.step import force_balanced, markdown  # noqa: E402
from benchmarks.step_systems import UNIFORM as SUFFIX, route_sources  # noqa: E402
from ds_hecate.planning.balance import force_uniform, is_uniform  # noqa: E402
from ds_hecate.sim.workloads import routing_counts  # noqa: E402
from ds_hecate.sim import SYSTEMS, SimSettings, format_table, simulate  # noqa: E402


# -- the forcing function -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("counts", [
    [[40, 0, 0, 0, 0, 0, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]],          # one hot expert vs already uniform
    [[7, 0, 1], [0, 0, 13], [2, 2, 2], [0, 0, 0]],                      # remainders, an idle rank
    routing_counts("W4", 3, 4, 6, 101, 2),                              # ragged sources, odd totals
    np.random.default_rng(0).integers(0, 50, size=(16, 12)),
])
def test_force_uniform_keeps_totals_and_equalises(counts):
    arr = np.asarray(counts)
    out = force_uniform(counts)
    assert out.shape == arr.shape and out.dtype == np.int64
    assert (out.sum(axis=1) == arr.sum(axis=1)).all()                   # same pairs per rank
    assert (out.max(axis=1) - out.min(axis=1) <= 1).all()               # each rank uniform up to rounding
    assert out.sum(axis=0).max() - out.sum(axis=0).min() <= 1           # and the experts' totals too
    assert is_uniform(out)


def test_force_uniform_of_equal_tokens_is_w0_and_rejects_fractions():
    w0 = routing_counts("W0", 0, 4, 8, 64, 2)
    for name in ("W1", "W2", "W3", "W5", "W7"):
        assert force_uniform(routing_counts(name, 9, 4, 8, 64, 2)).tolist() == w0, name
    assert not is_uniform(routing_counts("W1", 0, 4, 8, 64, 2))
    with pytest.raises(ValueError):
        force_uniform([[1.5, 2.5]])


# -- simulator ------------------------------------------------------------------------------------------------------
def test_simulator_fraction_is_one_on_w0_and_low_for_skewed_ep():
    w0 = simulate("v100-4x8", "gpt-moe-s", "W0", SimSettings(steps=4, charge_planning=False))
    for name, r in w0.systems.items():
        assert r.force_balanced_fraction == pytest.approx(1.0, abs=1e-12), name
        assert r.force_balanced_step_s == pytest.approx(r.step_time_s, rel=1e-12)
    w2 = simulate("v100-4x8", "gpt-moe-s", "W2", SimSettings(steps=4, charge_planning=False))
    ep = w2.systems["ep"]
    assert ep.force_balanced_fraction < 0.5                             # the hot rank's compute and receive side
    # forced uniform of W2 with equal tokens per rank is W0's routing: the same system's W0 step
    assert ep.force_balanced_step_s == pytest.approx(w0.systems["ep"].step_time_s, rel=1e-12)
    assert ep.force_balanced_fraction == pytest.approx(w0.systems["ep"].step_time_s / ep.step_time_s, rel=1e-12)
    assert w2.systems["ideal"].force_balanced_fraction == pytest.approx(1.0)
    assert "of force-balanced" in format_table(w2)
    off = simulate("v100-4x8", "gpt-moe-s", "W2", SimSettings(steps=4, force_balanced=False), systems=["ep"])
    assert np.isnan(off.systems["ep"].force_balanced_fraction)
    assert off.systems["ep"].step_time_s == pytest.approx(ep.step_time_s, rel=1e-12)


def test_simulated_record_carries_the_fraction():
    from ds_hecate.sim import grid
    rec = grid.run_all(["v100-4x8"], ["gpt-moe-s"], ["W2"], steps=4, large=[])["grid"][0]["systems"]
    assert set(rec) == set(SYSTEMS)
    assert rec["ep"]["force_balanced_fraction"] < 0.5 and rec["ideal"]["force_balanced_fraction"] == pytest.approx(1)


# -- benchmark report -----------------------------------------------------------------------------------------------
def _system(median: float) -> dict:
    return {"status": "ok", "median_step_s": median, "step_s": [median] * 3, "load_max_over_mean": 1.0,
            "expert_rows_per_rank": [128, 128], "bytes_sent_per_step_max": 1e5, "fraction_of_ideal": 0.5,
            "ratio_vs_ds_hecate": 1.0, "phases_s": [{"forward": 0.01, "backward": 0.02, "optimizer": 0.003}] * 2}


def _fixture(workloads) -> dict:
    medians = {"W0": (0.100, 0.110), "W1": (0.125, 0.200), "W4": (0.130, 0.150), "W4" + SUFFIX: (0.120, 0.125)}
    cfg = {"ranks": 2, "steps": 3, "warmup": 1, "hidden": 16, "ffn": 32, "experts": 4, "layers": 2, "tokens": 32,
           "top_k": 2, "workloads": ",".join(w for w in workloads if not w.endswith(SUFFIX)), "trace": [],
           "systems": "ds_hecate,autoep", "seed": 0, "no_memory": True}
    return {"schema": SCHEMA, "date": "2026-01-01T00:00:00", "command": "fixture", "world_size": 2,
            "machine": {"cpu": "cpu", "vcpus": 2, "memory_gib": 1, "gpu": None, "python": "3", "torch": "t",
                        "deepspeed": "d", "transformers": "x", "backend": "gloo", "omp_num_threads": "1"},
            "config": cfg, "systems": {"ds_hecate": {"status": "ok"}, "autoep": {"status": "ok"}},
            "workloads": {w: {"title": w, "systems": {"ds_hecate": _system(medians[w][0]),
                                                      "autoep": _system(medians[w][1])}} for w in workloads}}


def _cell(text: str, workload: str) -> str:
    row = next(line for line in text.splitlines() if line.startswith(f"| {workload} {workload} |"))
    return row.split("|")[-2].strip()


def test_benchmark_report_renders_the_column(tmp_path):
    text = markdown(_fixture(["W0", "W1", "W4"]))
    assert "| workload | ds_hecate ms | autoep | ds_hecate of ideal | ds_hecate of force-balanced |" in text
    assert _cell(text, "W0") == "1.00"
    assert _cell(text, "W1") == f"{0.100 / 0.125:.2f}"     # W0 is W1's forced-uniform routing
    assert _cell(text, "W4") == ""                          # ragged tokens: W0 is no counterpart
    fb = force_balanced(_fixture(["W0", "W1", "W4"]))
    assert fb[("W1", "autoep")] == pytest.approx(0.110 / 0.200) and ("W4", "autoep") not in fb
    # with W4's forced-uniform run in the record, W4 gets its fraction from it
    fb = force_balanced(_fixture(["W0", "W1", "W4", "W4" + SUFFIX]))
    assert fb[("W4", "autoep")] == pytest.approx(0.125 / 0.150) and fb[("W1", "autoep")] == pytest.approx(0.55)


def test_benchmark_adds_uniform_runs_only_where_w0_does_not_serve():
    def names(workloads):
        args = bench.parse_args(["--workloads", workloads, "--experts", "4", "--tokens", "32", "--steps", "3",
                                 "--warmup", "1"])
        return [n for n, _, _ in route_sources(args, 2)], dict((n, r) for n, _, r in route_sources(args, 2))
    found, routes = names("W0,W1,W4")
    assert found == ["W0", "W1", "W4", "W4" + SUFFIX]
    forced = routes["W4" + SUFFIX]
    for step in range(4):
        assert forced.counts(step, 0) == force_uniform(routes["W4"].counts(step, 0)).tolist()
        assert [forced.tokens(step, r) for r in range(2)] == [routes["W4"].tokens(step, r) for r in range(2)]
    assert names("W1,W2")[0] == ["W1", "W2", "W1" + SUFFIX]   # one forced-uniform run serves both


# -- engine.hecate.stats() ------------------------------------------------------------------------------------------
def _train_stats(rank, world):
    from moe_training import Spec, train
    out = {}
    for placement in ("owner", "hecate"):
        spec = Spec(hecate={"enabled": True, "placement": placement}, native=True, steps=2, k=1,
                    gate_bias=(6.0, 6.0) + (0.0,) * 6, aux_coef=0.0)
        out[placement] = train(rank, world, spec)["hecate_stats"]
    return out


def test_stats_reports_an_estimated_force_balanced_fraction():
    from dist_utils import run_ranks
    for rank_stats in run_ranks(2, _train_stats):
        for placement, stats in rank_stats.items():
            for layer in stats["layers"]:
                f = layer["force_balanced_fraction"]
                assert 0.0 < f <= 1.5, (placement, layer)
                if placement == "owner":   # hot experts of rank 0 under plain expert parallelism: far from balanced
                    assert f < 0.9, layer
