"""Hecate's per-step metrics through DeepSpeed's own monitor (CSV here) and the routing trace.

One set of 2 ranks trains a small MoE with skewed routing (hot experts on rank 0), monitoring and tracing on, with
activation checkpointing (recomputes must not add trace records), and a second run with ``hecate.monitor`` off.
Every metric is checked against an independent derivation: the gate's own indices (captured on each rank, not
through the runtime's count exchange) for the trace, and the pure planning code on the traced counts for the
load, replica and byte metrics.
"""
from __future__ import annotations

import csv
import os
from dataclasses import replace
from typing import Any, List, cast

import pytest

from moe_training import Spec, train

from ds_hecate.config import parse_hecate_section
from ds_hecate.errors import HecateConfigError
from ds_hecate.deepspeed_glue.monitor import LOAD_METRICS, TRAFFIC_METRICS
from ds_hecate.planning.cost_model import owner_loads
from ds_hecate.planning import LayerPlan, topology_aware_routes
from ds_hecate.runtime.layer import PHASES
from ds_hecate.trace import read_trace

STEPS = 8
LAYERS = 2
EXPERTS = 8
HOT = (2.5, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # experts 0 and 1 (owned by rank 0) draw most tokens


def _train_capturing_gate(rank: int, world_size: int, specs, unwritable) -> list:
    """Train each spec; also record, per forward call (not recomputes), this rank's own expert counts straight
    from the gate's indices, before Hecate exchanges them. Last, initialize with an unwritable trace_file and
    return each rank's error (every rank must raise, not only rank 0, which alone writes)."""
    import torch

    from ds_hecate.runtime import layer as rt

    seen = []
    original = rt.LayerBinding.run

    def run(self, x, indices, gates, *args):
        if not rt.in_backward_pass():
            flat = indices.reshape(-1)
            seen.append((self.index,
                         torch.bincount(flat[flat >= 0].long(), minlength=self.shard.num_experts).tolist()))
        return original(self, x, indices, gates, *args)

    setattr(rt.LayerBinding, "run", run)
    out: List[Any] = []
    for spec in specs:
        seen.clear()
        result = train(rank, world_size, spec)
        out.append({"local_counts": list(seen), "stats": result["hecate_stats"]})
    try:
        train(rank, world_size, unwritable)
        out.append(None)
    except HecateConfigError as exc:
        out.append(str(exc))
    return out


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    return [(float(x), float(y)) for x, y in rows[1:]]


@pytest.fixture(scope="module")
def monitored_run(tmp_path_factory):
    from dist_utils import run_ranks

    root = tmp_path_factory.mktemp("metrics")
    on = Spec(hecate={"enabled": True, "profile": True, "trace_file": str(root / "on" / "trace.jsonl")},
              gate_bias=HOT,
              steps=STEPS, layers=LAYERS, num_experts=EXPERTS, tokens=32, checkpoint="torch",
              extra_config={"csv_monitor": {"enabled": True, "output_path": str(root / "on"), "job_name": "csv"}})
    off = replace(on, steps=2, hecate={"enabled": True, "monitor": False},
                  extra_config={"csv_monitor": {"enabled": True, "output_path": str(root / "off"), "job_name": "csv"}})
    every2 = replace(on, steps=6, checkpoint="", hecate={"enabled": True, "monitor_interval": 2},
                     extra_config={"csv_monitor": {"enabled": True, "output_path": str(root / "every2"),
                                                   "job_name": "csv"}})
    unwritable = replace(on, steps=1, hecate={"enabled": True, "trace_file": str(root)}, extra_config={})
    per_rank = run_ranks(2, _train_capturing_gate, [on, off, every2], unwritable, timeout=240)
    return root, per_rank


def test_monitor_events_have_the_documented_names(monitored_run):
    root, _ = monitored_run
    files = set(os.listdir(root / "on" / "csv"))
    expected = {"Hecate_global_step.csv"}
    for layer in range(LAYERS):
        expected |= {f"Hecate_layer{layer}_{m}.csv" for m in LOAD_METRICS + TRAFFIC_METRICS}
        expected |= {f"Hecate_layer{layer}_time_ms_{p}.csv" for p in PHASES}
    assert expected <= files, sorted(expected - files)
    assert "Train_Samples_lr.csv" in files  # DeepSpeed's own events go to the same place
    for name in expected:
        rows = _read_csv(root / "on" / "csv" / name)
        assert len(rows) == STEPS, (name, rows)
    steps = _read_csv(root / "on" / "csv" / "Hecate_global_step.csv")
    assert [s for _, s in steps] == list(range(1, STEPS + 1))
    lr_x = [x for x, _ in _read_csv(root / "on" / "csv" / "Train_Samples_lr.csv")]
    assert [x for x, _ in steps] == lr_x  # same x (global_samples) as DeepSpeed's events


def test_monitor_off_writes_no_hecate_events(monitored_run):
    root, _ = monitored_run
    files = os.listdir(root / "off" / "csv")
    assert "Train_Samples_lr.csv" in files
    assert not [f for f in files if f.startswith("Hecate")]


def test_monitor_interval_writes_per_step_means(monitored_run):
    root, per_rank = monitored_run
    stats = per_rank[0][2]["stats"]

    def rows(name):
        return _read_csv(root / "every2" / "csv" / f"{name}.csv")
    assert [s for _, s in rows("Hecate_global_step")] == [2, 4, 6]
    for layer in range(LAYERS):
        for metric in ("bytes_allgather", "bytes_reducescatter", "bytes_dispatch"):
            means = [v for _, v in rows(f"Hecate_layer{layer}_{metric}")]
            assert len(means) == 3 and sum(means) * 2 == stats["layers"][layer][metric], metric
        imbalance = [v for _, v in rows(f"Hecate_layer{layer}_imbalance_before")]
        assert len(imbalance) == 3 and all(v >= 1.0 for v in imbalance)
        # without hecate.profile the calls are timed up to the cost model's steady-state measurement (step 4):
        # the window of steps 5 and 6 has no phase times to report
        assert [x for x, _ in rows(f"Hecate_layer{layer}_time_ms_compute")] == [
            x for x, _ in rows("Hecate_global_step")][:2]


def test_trace_records_exactly_what_the_gates_chose(monitored_run):
    root, per_rank = monitored_run
    trace = read_trace(str(root / "on" / "trace.jsonl"))
    assert trace.world_size == 2 and trace.top_k == 2
    assert [layer.num_experts for layer in trace.layers] == [EXPERTS] * LAYERS
    # One record per layer forward call: checkpoint recomputes (which call the layer again) add none.
    assert [(r.step, r.layer) for r in trace.records] == [(s, l) for s in range(1, STEPS + 1) for l in range(LAYERS)]
    captured = [run[0]["local_counts"] for run in per_rank]  # per rank: [(layer, counts)] in call order
    assert all(len(c) == STEPS * LAYERS for c in captured)
    for i, record in enumerate(trace.records):
        assert all(captured[r][i][0] == record.layer for r in range(2))
        assert record.counts == [captured[0][i][1], captured[1][i][1]], f"record {i}"
    # The last record's plan is the one the runtime reports.
    stats = per_rank[0][0]["stats"]
    for layer in range(LAYERS):
        last = [r for r in trace.records if r.layer == layer][-1]
        assert last.materialized == stats["layers"][layer]["materialized"]


def _series(root, layer, metric):
    return [v for _, v in _read_csv(root / "on" / "csv" / f"Hecate_layer{layer}_{metric}.csv")]


def test_metric_values_match_the_traced_plans(monitored_run):
    root, per_rank = monitored_run
    trace = read_trace(str(root / "on" / "trace.jsonl"))
    owners = [tuple(o) for o in trace.meta["owners"]]
    numel = trace.layers[0].expert_params
    stats = per_rank[0][0]["stats"]
    total_moved = 0
    for layer in range(LAYERS):
        records = [r for r in trace.records if r.layer == layer]
        calls, recomputes = stats["layers"][layer]["forward_calls"], stats["layers"][layer]["recomputes"]
        assert calls == recomputes == STEPS
        gathers = 2
        got = {m: _series(root, layer, m) for m in LOAD_METRICS + TRAFFIC_METRICS}
        for step, record in enumerate(records):
            assert record.materialized is not None
            materialized = tuple(tuple(m) for m in record.materialized)
            plan = LayerPlan(world_size=2, num_experts=EXPERTS, owners=owners[layer], materialized=materialized,
                             routes=topology_aware_routes(record.counts, materialized, 2))
            before, after = owner_loads(record.counts, owners[layer], 2), plan.loads()
            mean = sum(before) / 2
            assert sum(after) == sum(before)  # balancing moves work, never creates or drops it
            assert got["mean_load"][step] == mean
            assert got["max_load_before"][step] == max(before)
            assert got["max_load_after"][step] == max(after)
            assert got["imbalance_before"][step] == pytest.approx(max(before) / mean)
            assert got["imbalance_after"][step] == pytest.approx(max(after) / mean)
            assert got["imbalance_before"][step] >= 1.0 and got["imbalance_after"][step] >= 1.0
            assert got["replicas"][step] == plan.num_moved
            assert 0.0 <= got["lambda"][step] <= 1.0
            total_moved += plan.num_moved
            # Per-step byte deltas of rank 0 (fp32 experts and gradients): what it sends as owner in the gather,
            # and what it sends back as a replica holder in the reduce-scatter.
            # The checkpoint recompute gathers the same placement again.
            sent_as_owner = sum(1 for e, dst in plan.gather_pairs if owners[layer][e] == 0)
            sent_as_replica = sum(1 for e, dst in plan.gather_pairs if dst == 0)
            assert got["bytes_allgather"][step] == gathers * sent_as_owner * numel * 4, (layer, step)
            assert got["bytes_reducescatter"][step] == sent_as_replica * numel * 4, (layer, step)
            # rank 0 sends token rows when it dispatches to another rank or returns another rank's rows in the combine
            # (calibration may make every one local: then nothing is sent)
            rows_out = sum(n for dst, n in enumerate(plan.send_splits(0)) if dst != 0)
            rows_in = sum(n for src, n in enumerate(plan.recv_splits(0)) if src != 0)
            assert (got["bytes_dispatch"][step] > 0) == (rows_out + rows_in > 0), (layer, step, rows_out, rows_in)
            assert got["cross_node_tokens"][step] == 0  # one node
        # Deltas, not running totals: they add up to the runtime's cumulative counters.
        for metric in ("bytes_allgather", "bytes_reducescatter", "bytes_dispatch"):
            assert sum(got[metric]) == stats["layers"][layer][metric], metric
        for phase in PHASES:
            ms = _series(root, layer, f"time_ms_{phase}")
            assert all(v >= 0 for v in ms)
            assert sum(ms) == pytest.approx(stats["layers"][layer]["time_s"][phase] * 1e3, abs=1e-2)
        # Skewed routing: once the load window has data, the plan balances better than the owners alone.
        warm = slice(2, None)
        assert (sum(got["imbalance_after"][warm]) < sum(got["imbalance_before"][warm])), got
    assert total_moved > 0  # replicas existed, so the byte checks above covered real traffic


def test_unusable_trace_file_stops_every_rank(monitored_run):
    _, per_rank = monitored_run
    for rank in range(2):
        assert "is a directory" in (per_rank[rank][3] or ""), per_rank[rank][3]


def test_trace_file_config_is_validated(tmp_path):
    with pytest.raises(HecateConfigError, match="trace_file"):
        parse_hecate_section({"enabled": True, "trace_file": ""})
    with pytest.raises(HecateConfigError, match="trace_file"):
        parse_hecate_section({"enabled": True, "trace_file": 3})
    from ds_hecate.deepspeed_glue.monitor import TraceRecorder
    with pytest.raises(HecateConfigError, match="is a directory"):
        TraceRecorder(cast(Any, None), str(tmp_path))   # refused before the runtime is read
