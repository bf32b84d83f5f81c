"""benchmarks/simulated.py: the generated Simulator block of docs/benchmarks.md (tiny grids, a few seconds)."""
from __future__ import annotations

import json
import re

import pytest

from benchmarks import simulated as gen
from ds_hecate.sim import SimSettings, simulate

TINY = ["--clusters", "v100-4x8", "--models", "gpt-moe-s", "--workloads", "W1", "W3", "--steps", "4", "--no-large",
        "--no-planning-charge"]   # measured host planning time differs run to run; exact comparisons leave it out


def _rows(text: str, first_cell: str):
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first_cell} |")]


def test_replaces_only_the_block_and_matches_simulate(tmp_path):
    head = "# Benchmarks\n\nlead's text 123 ms\n\n## Simulator\n\nhand-written intro\n\n"
    tail = "\n\nhand-written notes after the block\n"
    doc = tmp_path / "bench.md"
    doc.write_text(head + gen.MARK_BEGIN + "\n| v100-4x8 | gpt-moe-s | W1 | 99999 | stale |\n" + gen.MARK_END + tail)
    out_json = tmp_path / "sim.json"
    assert gen.main(["--markdown", str(doc), "--json", str(out_json)] + TINY) == 0
    text = doc.read_text()
    assert text.startswith(head + gen.MARK_BEGIN) and text.endswith(gen.MARK_END + tail)
    assert "99999" not in text and "stale" not in text
    assert "python -m benchmarks.simulated --markdown" in text and "--no-large" in text
    rows = _rows(text, "v100-4x8")
    assert [r[2] for r in rows] == ["W1", "W3"]
    data = json.loads(out_json.read_text())
    assert data["steps"] == 4 and not data["large"]
    for row, rec in zip(rows, data["grid"]):
        ref = simulate("v100-4x8", "gpt-moe-s", row[2], SimSettings(steps=4, charge_planning=False))   # the CLI's call
        ep, hc, rm = ref.systems["ep"], ref.systems["hecate"], ref.systems["hecate-rm"]
        assert row[3] == f"{ep.step_time_s * 1e3:.0f}" and row[4] == f"{hc.step_time_s * 1e3:.0f}"
        assert row[5] == f"{hc.speedup_vs_ep:.2f}x" and row[6] == f"{rm.speedup_vs_ep:.2f}x"
        assert row[8] == f"{hc.fraction_of_ideal * 100:.1f}%"
        best = max(("fastermoe", "smartmoe", "flexmoe"), key=lambda s: ref.systems[s].speedup_vs_ep)
        assert row[9] == " / ".join(f"{ref.systems[s].imbalance:.2f}" for s in ("ep", best, "hecate", "hecate-rm"))
        assert row[7] == f"{best} {ref.systems[best].speedup_vs_ep:.2f}x"
        assert rec["systems"]["hecate"]["step_time_s"] == pytest.approx(hc.step_time_s, rel=1e-12)
    # computed reading lines, from the same numbers
    w1 = simulate("v100-4x8", "gpt-moe-s", "W1", SimSettings(steps=4, charge_planning=False))
    w1 = w1.systems["hecate"].speedup_vs_ep
    assert f"Hecate is {w1:.2f}x faster than EP overall" in text


def test_large_cases_table_and_wall_time(tmp_path):
    case = gen.Case("v100-4x8", "gpt-moe-s", "W1", systems=("ep", "hecate", "ideal"), materialize_budget_mb=2048)
    results = gen.run_all([], [], [], steps=4, large=[case], command="test", charge_planning=False)
    text = gen.markdown_section(results)
    assert "ds-hecate simulate --cluster v100-4x8 --model gpt-moe-s --workload W1 --systems ep hecate ideal " \
           "--materialize-budget-mb 2048 --steps 4" in text
    ref = simulate("v100-4x8", "gpt-moe-s", "W1", SimSettings(steps=4, materialize_budget_mb=2048,
                                                              charge_planning=False), systems=["ep", "hecate", "ideal"])
    rows = {r[1]: r for r in _rows(text, "W1, 2 GiB budget")}
    assert set(rows) == {"ep", "hecate", "ideal"}
    for name, row in rows.items():
        assert row[2] == f"{ref.systems[name].step_time_s * 1e3:.0f}"
        assert row[3] == f"{ref.systems[name].speedup_vs_ep:.2f}x"
    wall = results["large"][0]["wall_s"]
    assert re.search(rf"{wall:.1f} s \(gpt-moe-s W1, 2 GiB budget\)", text)
    assert "All under the one-minute target." in text


def test_large_case_with_a_group_size(tmp_path):
    """A case naming ``ep_size`` runs ``simulate(ep_size=...)``, says so in its label and command, and reports the
    group size and each system's expert-data-parallel reduction in the table."""
    case = gen.Case("h100-128x8", "mixtral-8x7b", "W2", systems=("ep", "hecate", "ideal"), ep_size=8)
    results = gen.run_all([], [], [], steps=3, large=[case], command="test", charge_planning=False)
    text = gen.markdown_section(results)
    assert "ds-hecate simulate --cluster h100-128x8 --model mixtral-8x7b --workload W2 --systems ep hecate ideal " \
           "--ep-size 8 --steps 3" in text
    ref = simulate("h100-128x8", "mixtral-8x7b", "W2", SimSettings(steps=3, ep_size=8, charge_planning=False),
                   systems=["ep", "hecate", "ideal"])
    rows = {r[1]: r for r in _rows(text, "W2, ep_size 8")}
    for name in ("ep", "hecate"):
        assert rows[name][2] == f"{ref.systems[name].step_time_s * 1e3:.0f}"
        assert rows[name][9] == "8"
        assert rows[name][10] == f"{ref.systems[name].breakdown_s['edp_reduce'] * 1e3:.0f}" != "0"
    assert rows["ideal"][9] == "-"
    assert results["large"][0]["edp_size"] == 128


def test_no_markers_is_an_error_naming_them(tmp_path):
    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\n## Simulator\nold tables\n")
    with pytest.raises(SystemExit) as exc:
        gen.main(["--markdown", str(doc)] + TINY)
    assert gen.MARK_BEGIN in str(exc.value) and gen.MARK_END in str(exc.value)
    assert doc.read_text() == "# Benchmarks\n\n## Simulator\nold tables\n"


def test_missing_file_gets_just_the_block(tmp_path):
    doc = tmp_path / "new.md"
    gen.main(["--markdown", str(doc)] + TINY)
    text = doc.read_text()
    assert text.startswith(gen.MARK_BEGIN) and text.rstrip().endswith(gen.MARK_END)


def _rec(workload: str, hecate: float, fastermoe: float):
    sys_ = {"ep": (1.0, 1000.0), "hecate": (hecate, 1000.0 / hecate), "hecate-rm": (hecate, 1000.0 / hecate),
            "fastermoe": (fastermoe, 1000.0 / fastermoe), "smartmoe": (1.0, 1000.0), "flexmoe": (1.0, 1000.0),
            "ideal": (10.0, 100.0)}
    return {"cluster": "c", "model": "m", "workload": workload, "world_size": 32,
            "systems": {k: {"speedup_vs_ep": sp, "step_time_s": ms / 1e3, "fraction_of_ideal": 0.1,
                            "peak_memory_bytes": 1 << 30, "imbalance": 1.0, "replicas_per_layer": 0.0,
                            "breakdown_s": {"all_to_all": 0.05}} for k, (sp, ms) in sys_.items()}}


def test_reading_lines_flag_a_baseline_beating_hecate():
    lines = "\n".join(gen.grid_lines([_rec("W6", 2.0, 3.0), _rec("W1", 3.0, 2.5)]))
    assert "faster than Hecate (by more than 0.5%) on: c/m/W6 (fastermoe 3.00x vs Hecate 2.00x)." in lines
    assert "c/m/W1 (" not in lines.split("faster than Hecate")[1].split("\n")[0]
    lines = "\n".join(gen.grid_lines([_rec("W1", 3.0, 2.5)]))
    assert "No baseline is faster than Hecate" in lines


def test_token_price_reaches_hecates_planner_only():
    """The what-if knob of benchmarks/balance_whatif.py: Hecate's planners see token traffic at the price, the
    baselines' planners and the time model do not; a price outside [0, 1] is refused by name."""
    from ds_hecate.sim.core import _context
    from ds_hecate.config import HecateConfig
    from ds_hecate.sim.presets import resolve_cluster, resolve_model

    cl, mdl = resolve_cluster("a100-4x8"), resolve_model("bert-moe")
    ctx = _context(cl, mdl, mdl.tokens_per_rank, HecateConfig(enabled=True), SimSettings(planner_token_price=0.25),
                   cl.world_size)
    whole, seen = ctx.step_costs(cl.world_size), ctx.hecate_step_costs(cl.world_size)
    assert seen.token_transfer_s == pytest.approx(0.25 * whole.token_transfer_s) and whole.token_transfer_s > 0
    assert seen.token_transfer_inter_s == pytest.approx(0.25 * whole.token_transfer_inter_s)
    assert seen.expert_transfer_s == whole.expert_transfer_s and seen.compute_s_per_pair == whole.compute_s_per_pair
    with pytest.raises(Exception, match="planner_token_price"):
        simulate("a100-4x8", "bert-moe", "W4", SimSettings(steps=2, planner_token_price=1.5), systems=["ep"])


def test_balancing_w4_compute_costs_step_time():
    """docs/simulator.md's W4 claim: the scheduler leaves W4's expert compute unbalanced because balancing it is
    slower. With token traffic unpriced the planner balances it (imbalance at most 1.15) and the step is slower than
    with the runtime's model; the baselines do not move."""
    cells = {p: simulate("a100-4x8", "bert-moe", "W4", SimSettings(steps=30, planner_token_price=p, force_balanced=False),
                         systems=["ep", "fastermoe", "hecate"]) for p in (1.0, 0.0)}
    own, balanced = cells[1.0].systems, cells[0.0].systems
    assert own["hecate"].imbalance > 1.15 >= balanced["hecate"].imbalance
    assert balanced["hecate"].step_time_s > own["hecate"].step_time_s
    for baseline in ("ep", "fastermoe"):
        assert balanced[baseline].step_time_s == own[baseline].step_time_s
