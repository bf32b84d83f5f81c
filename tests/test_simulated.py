"""``ds-hecate simulate --grid`` (ds_hecate/sim/grid.py): the simulator's tables of docs/benchmarks.md, and the
what-if knob the W4 claim of docs/simulator.md rests on (tiny grids, a few seconds)."""
from __future__ import annotations

import json

import pytest

from ds_hecate.errors import HecateError
from ds_hecate.sim import SimSettings, grid, simulate


def _rows(text: str, first_cell: str):
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first_cell} |")]


def test_replaces_only_the_block_and_matches_simulate(tmp_path):
    head, tail = "# Benchmarks\n\nhand-written 123 ms\n\n", "\n\nhand-written notes after the block\n"
    doc = tmp_path / "bench.md"
    doc.write_text(head + grid.MARK_BEGIN + "\n| v100-4x8 / gpt-moe-s | 99999 | stale |\n" + grid.MARK_END + tail)
    results = grid.run_all(["v100-4x8"], ["gpt-moe-s"], ["W1", "W3"], steps=4, large=(), charge_planning=False)
    grid.write_markdown(str(doc), results)
    text = doc.read_text()
    assert text.startswith(head + grid.MARK_BEGIN) and text.endswith(grid.MARK_END + tail)
    assert "99999" not in text and "stale" not in text and "host planning not charged" in text
    assert "- per-call overhead: v100-4x8: fit 'cpu' (CPU layer benchmark" in text   # the fit and its age
    (row,) = _rows(text, "v100-4x8 / gpt-moe-s")
    for cell, workload in zip(row[1:], ("W1", "W3")):   # the CLI's call, one cell at a time
        ref = simulate("v100-4x8", "gpt-moe-s", workload, SimSettings(steps=4, charge_planning=False)).systems
        best = max(ref[s].speedup_vs_ep for s in grid.BASELINES)
        assert cell == f"{ref['hecate'].speedup_vs_ep:.2f} / {best:.2f}"


def test_large_cases_table(tmp_path):
    """A case's label and command name its budget and group size; its row holds Hecate's, Hecate-RM's and the best
    baseline's speedup over EP and the memory per rank, as simulate() computes them."""
    case = grid.Case("h100-128x8", "mixtral-8x7b", "W2", ("ep", "hecate", "hecate-rm", "ideal"), ep_size=8)
    assert case.command(3) == ("ds-hecate simulate --cluster h100-128x8 --model mixtral-8x7b --workload W2 --systems "
                               "ep hecate hecate-rm ideal --ep-size 8 --steps 3")
    results = grid.run_all([], [], [], steps=3, large=[case], charge_planning=False)
    assert case.systems is not None
    ref = simulate("h100-128x8", "mixtral-8x7b", "W2", SimSettings(steps=3, ep_size=8, charge_planning=False),
                   systems=list(case.systems)).systems
    (row,) = _rows(grid.markdown_section(results), "mixtral-8x7b")
    assert row[1:] == ["W2, ep_size 8", f"{ref['hecate'].speedup_vs_ep:.2f}", f"{ref['hecate-rm'].speedup_vs_ep:.2f}",
                       "not run", f"{ref['hecate'].peak_memory_bytes / 2 ** 30:.1f}",
                       f"{ref['ep'].peak_memory_bytes / 2 ** 30:.1f}"]
    assert results["large"][0]["edp_size"] == 128


def test_the_cli_writes_the_tables_and_the_record(tmp_path, monkeypatch, capsys):
    """``ds-hecate simulate --grid --no-large --steps 2`` (on one cell here): the record, the block, the print; a
    file without the markers is refused, naming them, before any simulation."""
    from ds_hecate.tools.cli import main
    monkeypatch.setattr(grid, "GRID_CLUSTERS", ("v100-4x8",))
    monkeypatch.setattr(grid, "GRID_MODELS", ("gpt-moe-s",))
    monkeypatch.setattr(grid, "GRID_WORKLOADS", ("W1",))
    doc, record = tmp_path / "new.md", tmp_path / "sim.json"
    assert main(["simulate", "--grid", "--no-large", "--steps", "2", "--markdown", str(doc), "--json",
                 str(record)]) == 0
    text = doc.read_text()
    assert text.startswith(grid.MARK_BEGIN) and text.rstrip().endswith(grid.MARK_END)
    assert "`ds-hecate simulate --grid" in text and text.strip() in capsys.readouterr().out
    assert [r["workload"] for r in json.loads(record.read_text())["grid"]] == ["W1"]
    doc.write_text("# Benchmarks\nold tables\n")
    with pytest.raises(HecateError, match="add the lines"):
        grid.check_markers(str(doc))
    assert doc.read_text() == "# Benchmarks\nold tables\n"


def test_token_price_reaches_hecates_planner_only():
    """The what-if knob (``SimSettings.planner_token_price``): Hecate's planners see token traffic at the price, the
    baselines' planners and the time model do not; a price outside [0, 1] is refused by name."""
    from ds_hecate.sim.core import _context
    from ds_hecate.config import HecateConfig
    from ds_hecate.sim.presets import resolve_cluster, resolve_model

    cl, mdl = resolve_cluster("a100-4x8"), resolve_model("bert-moe")
    ctx = _context(cl, mdl, mdl.tokens_per_rank, HecateConfig(enabled=True), SimSettings(planner_token_price=0.25),
                   cl.world_size)
    whole, seen = ctx.step_costs(cl.world_size), ctx.hecate_step_costs(cl.world_size)
    assert seen.token_transfer_s == pytest.approx(0.25 * whole.token_transfer_s) and whole.token_transfer_s > 0
    assert whole.token_transfer_inter_s is not None
    assert seen.token_transfer_inter_s == pytest.approx(0.25 * whole.token_transfer_inter_s)
    assert seen.expert_transfer_s == whole.expert_transfer_s and seen.compute_s_per_pair == whole.compute_s_per_pair
    with pytest.raises(Exception, match="planner_token_price"):
        simulate("a100-4x8", "bert-moe", "W4", SimSettings(steps=2, planner_token_price=1.5), systems=["ep"])


def test_balancing_w4_compute_costs_step_time():
    """docs/simulator.md's W4 claim: the scheduler leaves W4's expert compute unbalanced because balancing it is
    slower. With token traffic unpriced the planner balances it (imbalance at most 1.15) and the step is slower than
    with the runtime's model; the baselines do not move."""
    cells = {p: simulate("a100-4x8", "bert-moe", "W4",
                         SimSettings(steps=30, planner_token_price=p, force_balanced=False),
                         systems=["ep", "fastermoe", "hecate"]) for p in (1.0, 0.0)}
    own, balanced = cells[1.0].systems, cells[0.0].systems
    assert own["hecate"].imbalance > 1.15 >= balanced["hecate"].imbalance
    assert balanced["hecate"].step_time_s > own["hecate"].step_time_s
    for baseline in ("ep", "fastermoe"):
        assert balanced[baseline].step_time_s == own[baseline].step_time_s
