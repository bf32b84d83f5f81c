"""ds_hecate/sim/calibration.py: the simulator's prediction next to a step benchmark run's measurement. No multi-rank
run: a synthetic record with the fields ``python -m benchmarks.step`` writes, so the checks are on the calibration's
logic (replayed routing, use of the measured costs, no use of the measured step being predicted, clear errors)."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from benchmarks.step import replayed_counts
from benchmarks.step_systems import route_sources
from ds_hecate.sim import calibration as cal
from ds_hecate.sim.workloads import routing_counts
from ds_hecate.trace import TraceLayer, TraceWriter
from ds_hecate.testing.workloads import TraceRoutes

COSTS = {"compute_s_per_pair": 2e-5, "link_gbps": 0.6, "non_moe_time_s": 0.0005}


def _system(median: float, **extra) -> dict:
    return {"status": "ok", "median_step_s": median, "step_s": [median] * 4,
            "phases_s": [{"forward": median / 3, "backward": median / 2, "optimizer": 0.004}] * 2, **extra}


def results(workloads=("W0", "W2"), trace=(), costs=COSTS) -> dict:
    """What ``python -m benchmarks.step`` writes (schema ds_hecate-benchmark/1), with plausible figures."""
    config = {"ranks": 2, "steps": 4, "warmup": 2, "hidden": 32, "ffn": 64, "experts": 4, "layers": 2,
              "tokens": 64, "top_k": 2, "workloads": ",".join(workloads), "trace": list(trace),
              "systems": "ds_hecate,autoep,deepspeed-ep,ideal", "seed": 3, "no_memory": True}
    names = list(workloads) + [TraceRoutes(p, 2, 4, 2, 64).name for p in trace]
    return {"schema": "ds_hecate-benchmark/1", "date": "2026-01-01T00:00:00", "command": "synthetic",
            "world_size": 2, "config": config, "model": {"layers": 2, "hidden": 32},
            "systems": {s: {"status": "ok"} for s in ("ds_hecate", "autoep", "deepspeed-ep", "ideal")},
            "workloads": {w: {"title": w, "systems": {
                "ds_hecate": _system(0.010, measured_costs=dict(costs), replicas_per_layer=0.0,
                                     load_max_over_mean=1.0),
                "autoep": _system(0.012), "deepspeed-ep": _system(0.015), "ideal": _system(0.008)}}
                for w in names}}


def calibrate(res: dict, **kwargs) -> dict:
    """The calibration of ``res`` with the counts the benchmark forced (rebuilt from its arguments)."""
    return cal.calibrate(res, replayed_counts(res), **kwargs)


def test_structure_errors_and_markdown():
    out = calibrate(results())
    assert out["schema"] == cal.SCHEMA and set(out["workloads"]) == {"W0", "W2"}
    for w in out["workloads"].values():
        assert w["model"] == "measured-costs"
        assert set(w["rows"]) == {"hecate", "ep", "ep-padded", "ideal"}
        for row in w["rows"].values():
            assert row["predicted_s"] > 0
            assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1)
            assert row["within"] == (abs(row["error"]) <= 0.25)
        assert w["rows"]["ep"]["measured_system"] == "autoep"
        assert w["rows"]["ep-padded"]["measured_system"] == "deepspeed-ep"
        # the fixed per-step time is the ideal's optimizer phase, not ds_hecate's
        assert w["costs"]["fixed_step_s"] == pytest.approx(0.004)
    # hot rank: dropless EP waits for the hot rank; padding never makes it faster
    rows = out["workloads"]["W2"]["rows"]
    assert rows["ep"]["predicted_s"] > out["workloads"]["W0"]["rows"]["ep"]["predicted_s"]
    assert rows["ep-padded"]["predicted_s"] >= rows["ep"]["predicted_s"]
    text = cal.format_markdown(out)
    assert text.startswith("| workload | simulated | measured | predicted ms | measured ms | error | within 25% |")
    assert "| W2 | hecate | ds_hecate |" in text and "| W0 | ep | autoep |" in text
    assert "Simulator calibration (measured-costs model): hecate vs ds_hecate:" in text


def test_prediction_follows_measured_costs_not_the_measured_step():
    base = calibrate(results())["workloads"]["W2"]["rows"]
    slower = calibrate(results(costs={**COSTS, "compute_s_per_pair": 4e-5}))["workloads"]["W2"]["rows"]
    for row in ("hecate", "ep", "ideal"):
        assert slower[row]["predicted_s"] > base[row]["predicted_s"] * 1.3, row
    # the measured step being predicted never enters its prediction
    res = results()
    res["workloads"]["W2"]["systems"]["ds_hecate"]["median_step_s"] *= 3
    res["workloads"]["W2"]["systems"]["autoep"]["median_step_s"] *= 3
    again = calibrate(res)["workloads"]["W2"]["rows"]
    assert again["hecate"]["predicted_s"] == base["hecate"]["predicted_s"]
    assert again["ep"]["predicted_s"] == base["ep"]["predicted_s"]
    assert again["hecate"]["error"] != base["hecate"]["error"]


def test_missing_measured_costs_are_named():
    res = results()
    del res["workloads"]["W0"]["systems"]["ds_hecate"]["measured_costs"]["link_gbps"]
    with pytest.raises(cal.CalibrationError, match=r"W0: .*measured_costs'\] lacks \['link_gbps'\]"):
        calibrate(res)
    res = results()
    del res["workloads"]["W2"]["systems"]["ds_hecate"]["measured_costs"]
    with pytest.raises(cal.CalibrationError, match="compute_s_per_pair', 'link_gbps', 'non_moe_time_s'"):
        calibrate(res)
    res = results()
    res["workloads"]["W0"]["systems"]["ds_hecate"] = {"status": "skipped", "reason": "x"}
    with pytest.raises(cal.CalibrationError, match="no measured ds_hecate"):
        calibrate(res)
    res = results()
    del res["config"]["ffn"]
    with pytest.raises(cal.CalibrationError, match="lacks 'ffn'"):
        calibrate(res)


def test_replayed_counts_are_what_the_benchmark_forces(tmp_path):
    trace = tmp_path / "t.jsonl"
    rng = np.random.default_rng(0)
    with TraceWriter(str(trace), world_size=2, top_k=2, layers=[TraceLayer("a", 4, 32, 100),
                                                                TraceLayer("b", 4, 32, 100)]) as w:
        for step in range(3):
            for layer in range(2):
                w.write(step, layer, (rng.integers(0, 40, size=(2, 4)) + [[300, 0, 0, 0], [0, 0, 0, 5]]).tolist())
    res = results(workloads=("W2", "W6"), trace=[str(trace)])
    cfg = res["config"]
    steps = cfg["warmup"] + cfg["steps"]
    counts = replayed_counts(res)
    bench = {n for n, _, r in route_sources(argparse.Namespace(**cfg), 2)}   # what the benchmark builds
    # plus the forced-uniform runs no W0 stands for: one for W2 and W6, one for the trace's ragged ranks
    assert bench == {"W2", "W6", "trace:t", "W2-uniform", "trace:t-uniform"} and set(counts) == {"W2", "W6", "trace:t"}
    for name in ("W2", "W6"):
        for s in range(steps):
            expected = routing_counts(name, s, 2, cfg["experts"], cfg["tokens"], cfg["top_k"], cfg["seed"])
            assert counts[name][s] == [expected] * cfg["layers"], (name, s)
    direct = TraceRoutes(str(trace), 2, 4, 2, 64)
    assert counts["trace:t"] == [[direct.counts(s, layer) for layer in range(2)] for s in range(steps)]
    assert counts["trace:t"][0][0] != counts["trace:t"][0][1]          # per-layer routing survives
    out = calibrate(res)
    assert set(out["workloads"]) == {"W2", "W6", "trace:t"}
    # the trace's hot expert of rank 0 makes expert parallelism slower than on the rotating W6 hotspot's mean
    assert out["workloads"]["trace:t"]["rows"]["ep"]["predicted_s"] > out["workloads"]["trace:t"]["rows"]["ideal"][
        "predicted_s"]


def test_alpha_beta_model_with_empty_steps():
    empty = {"ds_hecate": 0.003, "autoep": 0.004, "deepspeed-ep": 0.004, "ideal": 0.001}
    out = calibrate(results(), empty_steps=empty)
    w = out["workloads"]["W2"]
    assert w["model"] == "alpha-beta" and w["costs"]["fixed_step_s"] == 0.0
    assert w["rows"]["ideal"]["calibration_source"] and w["rows"]["ideal"]["error"] == pytest.approx(0, abs=1e-9)
    more = calibrate(results(), empty_steps={**empty, "ds_hecate": 0.005})["workloads"]["W2"]["rows"]
    assert more["hecate"]["predicted_s"] == pytest.approx(w["rows"]["hecate"]["predicted_s"] + 0.002)
    assert more["ep"]["predicted_s"] == pytest.approx(w["rows"]["ep"]["predicted_s"])
    # the planner decides with the run's first-step costs whatever the time model uses
    assert w["rows"]["hecate"]["replicas_per_layer"] == calibrate(results())["workloads"]["W2"]["rows"][
        "hecate"]["replicas_per_layer"]
    with pytest.raises(cal.CalibrationError, match="not above its empty step"):
        calibrate(results(), empty_steps={**empty, "ideal": 0.5})
