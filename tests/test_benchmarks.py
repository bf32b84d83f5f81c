"""The benchmarks' quick forms: the training step (``python -m benchmarks.step --quick``: every system produces a
result or a skip reason, the record has the documented schema, the report renders, forced routing is exact and the
same for every system) and the layer call (``python -m benchmarks.layer --quick --n-rank``: every system runs or says
why not, each N-rank twin is checked against its one-rank layer before timing)."""
from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch

from dist_utils import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import step as bench  # noqa: E402
from benchmarks.step_measure import SCHEMA, run as run_step  # noqa: E402
from benchmarks.step_systems import ALL_SYSTEMS  # noqa: E402
from ds_hecate.trace import TraceLayer, TraceWriter  # noqa: E402
from benchmarks.common import markers  # noqa: E402
from ds_hecate.testing.workloads import TraceRoutes, WorkloadRoutes, assign_routes  # noqa: E402


def test_assign_routes_exact_counts_and_distinct_experts():
    gen = torch.Generator().manual_seed(0)
    counts = [10, 0, 3, 7, 10, 0, 0, 10]   # 40 pairs = 20 tokens x top-2, no expert above 20
    choice = assign_routes(counts, 20, 2, gen)
    assert choice.shape == (20, 2)
    assert torch.bincount(choice.flatten(), minlength=8).tolist() == counts
    assert bool((choice[:, 0] != choice[:, 1]).all())
    with pytest.raises(ValueError, match="do not fill"):
        assign_routes([30, 10], 20, 2, gen)   # expert 0 would be picked twice by some token


def test_workload_routes_follow_routing_counts():
    from ds_hecate.sim.workloads import routing_counts
    routes = WorkloadRoutes("W4", 2, 8, 2, 64)
    expected = routing_counts("W4", 5, 2, 8, 64, 2)
    for rank in range(2):
        choice = routes.choices(5, 1, rank)
        assert choice.shape[0] == routes.tokens(5, rank)
        assert torch.bincount(choice.flatten(), minlength=8).tolist() == expected[rank]
    assert routes.tokens(5, 0) > routes.tokens(5, 1)   # W4: ragged sources


def _write_trace(path: str) -> None:
    layers = [TraceLayer("blocks.0.moe", 8), TraceLayer("blocks.1.moe", 8)]
    with TraceWriter(path, world_size=2, top_k=2, layers=layers, meta={"source": "test"}) as w:
        for step in range(3):
            for layer in range(2):
                hot = (step + layer) % 8
                w.write(step, layer, [[40 if e == hot else 4 for e in range(8)], [6] * 8])


def test_trace_routes_replay_distribution(tmp_path):
    path = str(tmp_path / "trace.jsonl")
    _write_trace(path)
    routes = TraceRoutes(path, 2, 8, 2, 32)
    assert routes.num_steps == 3
    counts = routes.counts(4, 1)   # cycles: step 4 -> recorded step 1; hot expert (1 + 1) % 8 = 2
    assert max(range(8), key=lambda e: counts[0][e]) == 2
    assert routes.tokens(0, 0) > routes.tokens(0, 1)   # 68 vs 48 recorded pairs: ragged
    for rank in range(2):
        assert sum(counts[rank]) == 2 * routes.tokens(4, rank)
    with pytest.raises(ValueError, match="experts"):
        TraceRoutes(path, 2, 16, 2, 32)


def _bench_rank(rank, world, argv):
    return run_step(bench.parse_args(argv))


def test_step_quick_smoke(tmp_path):
    trace = str(tmp_path / "trace.jsonl")
    _write_trace(trace)
    results = run_ranks(2, _bench_rank, ["--quick", "--trace", trace])[0]
    assert results["schema"] == SCHEMA and results["command"].startswith("python -m benchmarks.step --quick")
    assert set(results["systems"]) == set(ALL_SYSTEMS)
    assert {"cpu", "vcpus", "torch", "deepspeed", "transformers", "load_average_1min"} <= set(results["machine"])
    # the trace's ranks hold unequal tokens, so W0 is not its forced-uniform routing: the run adds one
    assert list(results["workloads"]) == ["W0", "W1", "trace:trace", "trace:trace-uniform"]
    for wname, workload in results["workloads"].items():
        assert set(workload["systems"]) == set(ALL_SYSTEMS), wname
        losses = []
        for name, r in workload["systems"].items():
            if r["status"] == "skipped":
                assert r["reason"], (wname, name)
                continue
            assert r["status"] == "ok"
            assert len(r["step_s"]) == 2 and r["median_step_s"] > 0
            assert r["load_max_over_mean"] >= 1.0 - 1e-9
            assert len(r["bytes_sent_per_step"]) == 2 and len(r["expert_rows_per_rank"]) == 2
            assert r["fraction_of_ideal"] > 0
            if name != "ideal":
                losses.append(r["first_step_loss"])
        # same weights, same tokens, same forced routing: every real system computes the same first loss
        assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), (wname, losses)
        systems = workload["systems"]
        assert systems["ds_hecate"]["hecate_phases_s"][0].keys() >= {"counts", "dispatch", "compute"}
        assert systems["ideal"]["bytes_sent_per_step_max"] == 0
        assert systems["gather-all"]["bytes_sent_per_step_max"] > systems["ds_hecate"]["bytes_sent_per_step_max"]
    # the report: the record as a file, the block between the markers, the rest of the file kept
    record = tmp_path / "step.json"
    record.write_text(json.dumps(results))
    begin, end = markers("benchmarks.step")
    doc = tmp_path / "bench.md"
    doc.write_text(f"# keep\n{begin}\nold\n{end}\n## Simulator\nkeep too\n")
    assert bench.main(["--report-only", str(record), "--markdown", str(doc)]) == 0
    text = doc.read_text()
    assert "\nold\n" not in text and text.endswith("## Simulator\nkeep too\n") and "| W1 hot expert set | " in text
    assert "Simulator calibration" in text   # a 2-step run may be too short to calibrate: it says so


def test_shadow_and_all_placements():
    from ds_hecate.planning.placement import all_placement, plan_layer, shadow_placement
    from ds_hecate.planning.cost_model import StepCostModel
    owners = [0, 0, 0, 0, 1, 1, 1, 1]
    hot = [[600, 500, 10, 10, 20, 20, 20, 20]] * 2   # experts 0, 1 (rank 0) draw most pairs from both ranks
    cheap_moves = StepCostModel(compute_s_per_pair=2e-5, token_transfer_s=1e-6, expert_transfer_s=2e-4)
    placement = shadow_placement(hot, owners, cheap_moves)
    assert {0, 1} <= set(placement[1]) and set(placement[0]) >= {0, 1, 2, 3}   # the hottest shadowed on rank 1
    # the shadowed set is a prefix of the experts by load, and every rank holds it (FasterMoE broadcasts to all)
    by_load = sorted(range(8), key=lambda e: (-sum(row[e] for row in hot), e))
    shadowed = set(placement[0]) & set(placement[1])
    assert shadowed == set(by_load[:len(shadowed)])
    assert all(set(p) == shadowed | {e for e in range(8) if owners[e] == r} for r, p in enumerate(placement))
    costly_moves = StepCostModel(compute_s_per_pair=2e-5, token_transfer_s=1e-6, expert_transfer_s=10.0)
    assert shadow_placement(hot, owners, costly_moves) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert shadow_placement([[100] * 8] * 2, owners, cheap_moves) == ((0, 1, 2, 3), (4, 5, 6, 7))  # balanced
    with pytest.raises(ValueError, match="StepCostModel"):
        shadow_placement(hot, owners, None)
    assert all_placement(hot, owners) == (tuple(range(8)),) * 2
    plan = plan_layer(hot, owners, "all")
    assert plan.num_moved == 8 and all(plan.tokens_processed(r) == sum(hot[r]) for r in range(2))  # no token moves


def test_layer_quick_runs_and_its_table_is_well_formed(tmp_path):
    """``python -m benchmarks.layer --quick --n-rank``: every system runs (or says why not), computes the plain
    layer's function, has its figures; each N-rank twin exchanges its rows and its layer does not; the generated
    block is one well-formed row per cell."""
    from benchmarks import layer
    out, doc = tmp_path / "layer.json", tmp_path / "bench.md"
    begin, end = markers("benchmarks.layer")
    doc.write_text(f"# keep\n{begin}\nold\n{end}\n## after\nkeep too\n")
    assert layer.main(["--quick", "--n-rank", "--json", str(out), "--markdown", str(doc)]) == 0
    record = json.loads(out.read_text())
    assert record["schema"] == layer.SCHEMA and [c["shape"] for c in record["cells"]] == ["quick"]
    systems = record["cells"][0]["systems"]
    assert list(systems) == list(layer.SYSTEMS)
    for name in ("plain", "ds_hecate", "ds_hecate-no-shortcuts", "plain-all-to-all"):
        assert systems[name]["status"] == "ok", (name, systems[name].get("reason"))
    for name, r in systems.items():
        if r["status"] != "ok":
            assert r["reason"], name
            continue
        m, lo, hi = r["ratio_vs_plain"]
        assert len(r["times_s"]) == 3 and 0 < lo <= m <= hi, name
        assert 0 < r["ops"]["top"] <= r["ops"]["nested"] and r["allocations"] > 0 and r["allocated_bytes"] > 0
        # the same function of the same input: a benchmark of different layers would compare nothing
        assert max(r["agreement"].values()) <= layer.AGREEMENT_TOL["fp32"], (name, r["agreement"])
        assert "phases_s" not in r, name   # untimed without --profile, as after the cost model's first steps
    assert systems["plain"]["ratio_vs_plain"] == [1.0, 1.0, 1.0]
    for twin, one in layer.ONE_RANK_TWIN.items():
        if systems[twin]["status"] == "ok":
            assert systems[twin]["collectives"].get("c10d::alltoall_base_", 0) >= 2, (twin, systems[twin])
            assert not systems[one]["collectives"].get("c10d::alltoall_base_"), (one, systems[one])
    text = doc.read_text()
    assert text.startswith("# keep\n") and text.endswith("## after\nkeep too\n") and "\nold\n" not in text
    header = next(line for line in text.splitlines() if line.startswith("| shape |"))
    (row,) = [line for line in text.splitlines() if line.startswith("| quick |")]
    assert header == "| " + " | ".join(["shape", "dtype", "plain ms"] + list(layer.SYSTEMS[1:])) + " |"
    assert row.count("|") == header.count("|") and "!" not in row


def test_layer_profile_times_ds_hecates_phases(tmp_path):
    """``--profile``: the runtime's profiling on, ds_hecate's phases per call in the record and a second table, with
    what runs outside them timed alone beside them (the layer call's router; for ds_hecate.MoE, whose gate is its
    ``route`` phase, the harness) and the sum against the call's mean (a bound loose enough for a loaded host: they
    account for most of the call, and not for much more)."""
    from benchmarks import layer
    cell = run_ranks(1, _layer_cell, ["plain", "ds_hecate", "ds_hecate-call"], True, timeout=240)[0]
    module, call = cell["systems"]["ds_hecate"], cell["systems"]["ds_hecate-call"]
    for r, outside in ((module, layer.HARNESS), (call, layer.ROUTER)):
        phases = r["phases_s"]
        assert set(phases) >= {"counts", "dispatch", "compute", "combine", outside} and phases[outside] > 0
        assert 0.5 < sum(phases.values()) / (sum(r["times_s"]) / len(r["times_s"])) < 1.5
    assert module["phases_s"]["route"] > 0 and module["phases_s"]["route_bwd"] > 0 and layer.ROUTER not in module[
        "phases_s"]
    assert call["phases_s"]["route"] == 0 and call["phases_s"]["route_bwd"] == 0   # (its router is not the layer's)
    text = layer.markdown({"command": "x", "date": "d", "machine": {"cpu": "c", "vcpus": 1}, "profile": True,
                           "cells": [cell]})
    assert "ds_hecate's phases per call" in text and "| quick | fp32 | ds_hecate |" in text and "sum / call" in text
    header = next(line for line in text.splitlines() if "| route |" in line)
    assert f"| {layer.HARNESS} | {layer.ROUTER} |" in header   # every system's columns, not the first one's


def _layer_cell(rank: int, world_size: int, names, profile):
    from benchmarks import layer
    return layer.measure_cell("quick", "fp32", "cpu", 2, 0, names, profile)


def _broken_n_rank_row(rank: int, world_size: int, broken: str):
    """In a process of its own (the cell starts a one-rank process group): AutoEP's N-rank row broken, the cell's
    refusal (or None). Its one-rank layer is not in the cell, so the check builds it."""
    from benchmarks import layer, layer_systems
    build = layer_systems.BUILDERS["autoep-no-shortcuts"]
    if broken == "bits":     # the N-rank branches taken, the output scaled: other bits
        def other_bits(*args, **kwargs):
            built = build(*args, **kwargs)
            forward = built.forward
            built.forward = lambda x: forward(x) * 1.001
            return built
        layer_systems.BUILDERS["autoep-no-shortcuts"] = other_bits
    else:                    # the size left at 1: the one-rank branches, no collective
        layer_systems.BUILDERS["autoep-no-shortcuts"] = layer_systems.build_autoep
    try:
        layer.measure_cell("quick", "fp32", "cpu", 1, 0, ["plain", "autoep-no-shortcuts"])
    except SystemExit as exc:
        return str(exc)
    return None


def test_the_floors_variants_compute_the_plain_layers_function():
    """Each variant of the ops floor (``FLOOR_PARTS``: one more part taken back to the plain layer's code) runs,
    computes the plain layer's output and input gradient, and takes back what its flags say."""
    from benchmarks import layer, layer_systems
    names = ["plain", "ds_hecate-ops", *layer_systems.FLOOR_PARTS]
    cell = run_ranks(1, _layer_cell, names, False, timeout=240)[0]
    for name in names:
        r = cell["systems"][name]
        assert r["status"] == "ok", (name, r.get("reason"))
        assert max(r["agreement"].values()) <= layer.AGREEMENT_TOL["fp32"], (name, r["agreement"])
    taken: set = set()
    for name, flags in layer_systems.FLOOR_PARTS.items():   # each variant takes one part more than the one before
        assert set(flags) > taken and not any(flags.values()), name
        taken = set(flags)
        build = layer_systems.BUILDERS[name]
        assert isinstance(build, functools.partial), name
        cls = build.keywords["cls"]
        assert all(getattr(cls, flag) is False for flag in flags), name


def test_layer_refuses_an_n_rank_row_that_is_not_the_n_rank_path():
    """An N-rank row times the N-rank path of its own one-rank layer: one that computes other bits, or that issues
    no all-to-all (the N-rank branches not taken), stops the cell before any timing."""
    assert "autoep-no-shortcuts computed other bits than autoep" in run_ranks(
        1, _broken_n_rank_row, "bits", timeout=240)[0]
    assert "autoep-no-shortcuts issued 0 all-to-alls" in run_ranks(1, _broken_n_rank_row, "branches", timeout=240)[0]


def test_twin_input_gradient_exact_on_the_cpu_within_add_order_on_cuda():
    """The twin check's input-gradient rule: bit-equal on the CPU; on CUDA (atomic adds in no fixed order) within
    the dtype's tolerance, and not beyond it."""
    from benchmarks.layer import GRAD_ORDER_TOL, same_input_grad
    a = torch.randn(64, 8)
    ulp = a.clone()
    ulp[0, 0] = torch.nextafter(ulp[0, 0], torch.tensor(float("inf")))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert same_input_grad(a, a.clone(), cpu) and not same_input_grad(ulp, a, cpu)
    assert same_input_grad(ulp, a, cuda) and not same_input_grad(a * (1 + 10 * GRAD_ORDER_TOL["float32"]), a, cuda)
    half = a.bfloat16()
    assert same_input_grad(half, half.clone(), cuda) and not same_input_grad(half * 1.05, half, cuda)
    assert not same_input_grad(a[:32], a, cuda)


def test_all_to_all_floor_permutes_many_sources_expert_major_and_back():
    """The floor's receive-side permutation on a table of two sources (a 1-rank run only ever sees the identity):
    the rows expert-major, and the inverse putting them back in the received order."""
    import numpy as np
    from benchmarks.layer_systems import expert_major
    perm, inverse = expert_major(np.array([[3, 0, 2], [1, 2, 0]]))   # rows per (source, local expert)
    assert perm.tolist() == [0, 1, 2, 5, 6, 7, 3, 4]   # expert 0: 3 + 1 rows, expert 1: 2, expert 2: 2
    assert perm[inverse].tolist() == list(range(8))
