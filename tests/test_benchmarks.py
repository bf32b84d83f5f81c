"""Smoke test of the real benchmark (benchmarks/run.py): every system produces a result or a skip reason, the JSON
has the documented schema, the report renders, and forced routing is exact and identical across systems."""
from __future__ import annotations

import contextlib
import json
import os
import sys

import pytest
import torch

from dist_utils import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import run as bench  # noqa: E402
from ds_hecate.trace import TraceLayer, TraceWriter  # noqa: E402
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
    args = bench.parse_args(argv)
    return bench.run(args)


def test_benchmark_smoke(tmp_path):
    trace = str(tmp_path / "trace.jsonl")
    _write_trace(trace)
    out = str(tmp_path / "results.json")
    argv = ["--steps", "2", "--warmup", "1", "--workloads", "W0,W1", "--trace", trace, "--tokens", "64",
            "--hidden", "32", "--ffn", "64", "--layers", "2", "--no-memory"]
    results = run_ranks(2, _bench_rank, argv)[0]
    assert results["schema"] == bench.SCHEMA
    assert set(results["systems"]) == set(bench.ALL_SYSTEMS)
    assert {"cpu", "vcpus", "torch", "deepspeed", "transformers"} <= set(results["machine"])
    # the trace's ranks hold unequal tokens, so W0 is not its forced-uniform routing: the run adds one
    assert list(results["workloads"]) == ["W0", "W1", "trace:trace", "trace:trace-uniform"]
    for wname, workload in results["workloads"].items():
        assert set(workload["systems"]) == set(bench.ALL_SYSTEMS), wname
        losses = []
        for name, r in workload["systems"].items():
            if r["status"] == "skipped":
                assert r["reason"], (wname, name)
                continue
            assert r["status"] == "ok"
            assert len(r["step_s"]) == 2 and r["median_step_s"] > 0
            assert r["load_max_over_mean"] >= 1.0 - 1e-9
            assert len(r["bytes_sent_per_step"]) == 2 and len(r["expert_rows_per_rank"]) == 2
            assert r["ratio_vs_ds_hecate"] > 0 and r["fraction_of_ideal"] > 0
            if name != "ideal":
                losses.append(r["first_step_loss"])
        # same weights, same tokens, same forced routing: every real system computes the same first loss
        assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), (wname, losses)
        systems = workload["systems"]
        assert systems["ds_hecate"]["hecate_phases_s"][0].keys() >= {"counts", "gather", "dispatch", "compute"}
        assert systems["ideal"]["bytes_sent_per_step_max"] == 0
        assert systems["gather-all"]["bytes_sent_per_step_max"] > systems["ds_hecate"]["bytes_sent_per_step_max"]
    # the report: JSON round trip, markdown section replaced between the markers, plots written
    with open(out, "w", encoding="utf-8") as f:
        json.dump(results, f)
    doc = tmp_path / "bench.md"
    doc.write_text(f"# keep\n{bench.MARK_BEGIN}\nold\n{bench.MARK_END}\n## Simulator\nkeep too\n")
    bench.main(["--report-only", "--out", out, "--markdown", str(doc), "--plots", str(tmp_path)])
    text = doc.read_text()
    assert "old" not in text and "## Simulator\nkeep too" in text and "| W1 hot expert set | ds_hecate |" in text
    assert (tmp_path / "benchmark_step_time.png").stat().st_size > 0
    assert (tmp_path / "benchmark_load_balance.png").stat().st_size > 0


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


def test_layer_versus_quick_runs_and_its_table_is_well_formed(tmp_path):
    """``python -m benchmarks.layer_versus --quick``: every system runs (or says why not), computes the plain layer's
    function, has its figures, and the generated block of the Markdown file is a well-formed table."""
    from benchmarks import layer_versus as lv
    out, doc = tmp_path / "versus.json", tmp_path / "bench.md"
    doc.write_text(f"# keep\n{lv.MARK_BEGIN}\nold\n{lv.MARK_END}\n## after\nkeep too\n")
    assert lv.main(["--quick", "--json", str(out), "--markdown", str(doc)]) == 0
    results = json.loads(out.read_text())
    assert results["schema"] == lv.SCHEMA and [c["shape"] for c in results["cells"]] == ["quick"]
    systems = results["cells"][0]["systems"]
    assert list(systems) == list(lv.SYSTEMS)
    assert systems["ds_hecate-rank-of-8"]["status"] == "not run"
    for name in ("plain", "ds_hecate", "ds_hecate-no-shortcuts"):
        assert systems[name]["status"] == "ok", (name, systems[name].get("reason"))
    for name, r in systems.items():
        if r["status"] != "ok":
            assert r["reason"], name
            continue
        m, lo, hi = r["ratio_vs_plain"]
        assert len(r["times_s"]) == 3 and 0 < lo <= m <= hi, name
        assert 0 < r["ops"]["top"] <= r["ops"]["nested"] and r["allocations"] > 0 and r["allocated_bytes"] > 0
        # the same function of the same input: a benchmark of different layers would compare nothing
        assert max(r["agreement"].values()) <= lv.AGREEMENT_TOL["fp32"], (name, r["agreement"])
    assert systems["plain"]["ratio_vs_plain"] == [1.0, 1.0, 1.0]
    from benchmarks.versus_systems import ONE_RANK_TWIN
    for name, twin in ONE_RANK_TWIN.items():   # the N-rank paths exchange their rows, the one-rank ones do not
        if systems[name]["status"] == "ok":
            assert systems[name]["collectives"].get("c10d::alltoall_base_", 0) >= 2, (name, systems[name])
            assert not systems[twin]["collectives"].get("c10d::alltoall_base_"), (twin, systems[twin])
    assert set(systems["ds_hecate"]["phases_s"]) >= {"counts", "dispatch", "compute", "combine"}
    text = doc.read_text()
    assert text.startswith("# keep\n") and text.endswith("## after\nkeep too\n") and "\nold\n" not in text
    block = text[text.index(lv.MARK_BEGIN):text.index(lv.MARK_END)]
    table = [line for line in block.splitlines() if line.startswith("| quick |") or line.startswith("| shape |")]
    header, rows = table[0], [line for line in table[1:] if line.count("|") == len(lv.TABLE_HEADER) + 1]
    assert header == "| " + " | ".join(lv.TABLE_HEADER) + " |"
    assert [row.split(" | ")[2] for row in rows] == list(lv.SYSTEMS)   # one row per system, every cell present
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[3] == "not run":
            continue
        float(cells[3]), int(cells[5]), int(cells[6]), float(cells[7])
        assert cells[4].count("[") == 1 and "MISMATCH" not in cells[8]
    # before/after: an earlier run's ratios in a last column, from the JSON alone (no run)
    lv.main(["--report-only", str(out), "--before", str(out), "--markdown", str(doc)])
    lines = [line for line in doc.read_text().splitlines() if line.startswith("| quick |")][:len(lv.SYSTEMS)]
    assert all(line.count("|") == len(lv.TABLE_HEADER) + 2 for line in lines)
    assert lines[1].split(" | ")[4] == lines[1].split(" | ")[-1].rstrip(" |")   # ds_hecate: its own ratio, twice


def _broken_n_rank_row(rank: int, world_size: int, broken: str):
    """In a process of its own (the cell starts a one-rank process group): AutoEP's no-shortcut row broken, the
    cell's refusal (or None). Its one-rank twin is not in the cell, so the check builds it."""
    from benchmarks import layer_versus, versus_systems
    build = versus_systems.BUILDERS["autoep-no-shortcuts"]
    if broken == "bits":     # the N-rank branches taken, the output scaled: other bits
        def other_bits(*args):
            built = build(*args)
            forward = built.forward
            built.forward = lambda x: forward(x) * 1.001
            return built
        versus_systems.BUILDERS["autoep-no-shortcuts"] = other_bits
    else:                    # the size left at 1: the one-rank branches, no collective
        versus_systems.BUILDERS["autoep-no-shortcuts"] = versus_systems.build_autoep
    try:
        layer_versus.measure_cell("quick", "fp32", "cpu", 1, 0, ["plain", "autoep-no-shortcuts"])
    except SystemExit as exc:
        return str(exc)
    return None


def test_layer_versus_refuses_a_no_shortcut_row_that_is_not_the_n_rank_path():
    """A no-shortcut row times the N-rank path of its own one-rank layer: one that computes other bits, or that
    issues no all-to-all (the N-rank branches not taken), stops the cell before any timing."""
    assert "autoep-no-shortcuts computed other bits than autoep" in run_ranks(
        1, _broken_n_rank_row, "bits", timeout=240)[0]
    assert "autoep-no-shortcuts issued 0 all-to-alls" in run_ranks(1, _broken_n_rank_row, "branches", timeout=240)[0]


def test_no_shortcut_input_gradient_exact_on_the_cpu_within_add_order_on_cuda():
    """The twin check's input-gradient rule: bit-equal on the CPU; on CUDA (atomic adds in no fixed order) within
    the dtype's tolerance, and not beyond it."""
    from benchmarks.layer_versus import GRAD_ORDER_TOL, same_input_grad
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
    from benchmarks.plain_layers import expert_major
    perm, inverse = expert_major(np.array([[3, 0, 2], [1, 2, 0]]))   # rows per (source, local expert)
    assert perm.tolist() == [0, 1, 2, 5, 6, 7, 3, 4]   # expert 0: 3 + 1 rows, expert 1: 2, expert 2: 2
    assert perm[inverse].tolist() == list(range(8))


def _floor_parts(rank: int, world_size: int):
    from benchmarks import floor_parts
    return floor_parts.part_seconds("quick", "bf16", 2, warmup=0)


def test_floor_parts_times_each_primitive_of_the_all_to_all_floor():
    """``python -m benchmarks.floor_parts``: every primitive of the floor timed on the shape's routed rows (in a
    process of its own: it starts a one-rank process group), after the all-to-all delivered the rows it was given."""
    from benchmarks.floor_parts import PARTS
    times = run_ranks(1, _floor_parts, timeout=120)[0]
    assert list(times) == list(PARTS) and all(len(ts) == 2 and all(t > 0 for t in ts) for ts in times.values())


def test_grad_epilogue_times_deepspeeds_fp32_accumulation(capsys):
    """``python -m benchmarks.grad_epilogue``: DeepSpeed's bf16 backward epilogue for a shape's expert weights,
    timed (the figure docs/benchmarks.md puts beside the weight-bound bf16 rows)."""
    from benchmarks import grad_epilogue
    assert grad_epilogue.main(["--shape", "quick", "--reps", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("quick: 49,152 expert weights, bf16 gradients into fp32: median ") and " ms over 2 " in line


def test_gate_cost_times_the_three_gates(capsys):
    """``python -m benchmarks.gate_cost``: DeepSpeed's gate, ds_hecate's computation of it and a plain router, each
    timed forward and backward (the figure docs/benchmarks.md quotes)."""
    from benchmarks import gate_cost
    assert gate_cost.main(["--shape", "quick", "--reps", "2", "--warmup", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("quick: 128 tokens, 16 experts, top-2")
    timed = {line.split()[0]: float(line.split()[1]) for line in lines[1:]}
    assert set(timed) == {"deepspeed", "ds_hecate", "plain"} and all(t > 0 for t in timed.values()), timed


def test_nrank_path_splits_the_no_shortcut_excess(tmp_path):
    """``python -m benchmarks.nrank_path --quick``: the five layers run, the attribution adds up, and the generated
    block is a well-formed table."""
    from benchmarks import nrank_path
    out, doc = tmp_path / "nrank.json", tmp_path / "bench.md"
    doc.write_text(f"# keep\n{nrank_path.MARK_BEGIN}\nold\n{nrank_path.MARK_END}\n")
    assert nrank_path.main(["--quick", "--reps", "2", "--json", str(out), "--markdown", str(doc)]) == 0
    cell = json.loads(out.read_text())["cells"][0]
    assert list(cell["layers"]) == list(nrank_path.LAYERS)
    assert all(len(row["times_s"]) == 2 and row["median_s"] > 0 for row in cell["layers"].values())
    a = cell["attribution"]
    assert a["excess"] == pytest.approx(a["collectives"] + a["permutations"] + a["rest"])
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| quick | fp32 |")]
    assert len(rows) == 1 and rows[0].count("|") == len(nrank_path.LAYERS) + 7 and "\nold\n" not in doc.read_text()
    m, lo, hi = cell["over_all_to_all_floor"]
    assert 0 < lo <= m <= hi


def _broken_counterfactual(rank: int, world_size: int, broken: str):
    """In a process of its own (the cell starts a one-rank process group): one counterfactual broken, the cell's
    refusal (or None)."""
    from benchmarks import nrank_path
    if broken == "bits":   # an all-to-all that reverses the rows: other bits
        def reversing(layer, recv, send, recv_splits, send_splits, async_op):
            nrank_path.TAKEN[layer] += 1
            recv.copy_(send.flip(0))
        nrank_path._copying_all_to_all = reversing
    else:                  # the permutations not skipped: the change never runs
        nrank_path._rows_in_order = contextlib.nullcontext
    try:
        nrank_path.measure_cell("quick", "fp32", 1, 0)
    except SystemExit as exc:
        return str(exc)
    return None


def test_nrank_path_refuses_a_counterfactual_that_computes_other_bits_or_never_ran():
    """The attribution is only a split of the same call's time: a counterfactual that changes the values (here an
    all-to-all that reverses the rows) or whose change never runs (the permutations not skipped) stops the cell."""
    assert "exchanges-as-copies counterfactual computed other bits" in run_ranks(
        1, _broken_counterfactual, "bits", timeout=240)[0]
    assert "copies-in-order counterfactual's change never ran" in run_ranks(
        1, _broken_counterfactual, "order", timeout=240)[0]
