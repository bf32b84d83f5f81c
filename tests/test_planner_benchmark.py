"""benchmarks/planner.py: the host-planning benchmark runs the runtime's own calls and renders its block."""
from benchmarks import planner


def test_one_setting_times_the_runtime_calls_and_renders(tmp_path):
    rows = [planner.one_setting(8, 16, 2, load, 12, reference=True) for load in ("balanced", "skewed", "burst")]
    for row in rows:
        assert row["critical_path"]["calls"] == 12 and row["critical_path"]["median_us"] > 0
        assert row["search"]["median_us"] > 0 and row["explicit_routes"]["calls"] == 5
    assert rows[0]["calibration_searches"] == 0            # balanced: the prediction holds
    assert rows[2]["calibration_searches"] > 0             # bursts: calibration searches after the gate
    res = {"generated": "2026-01-01T00:00", "machine": planner.machine(), "machine_after": planner.machine(),
           "results": rows}
    doc = tmp_path / "b.md"
    doc.write_text("# B\n\n" + planner.BEGIN + "\nold\n" + planner.END + "\n\ntail\n")
    planner.replace_block(str(doc), planner.markdown(res), planner.BEGIN, planner.END, "here")
    text = doc.read_text()
    assert "old" not in text and text.endswith("tail\n") and "| 8 x 16 | 2 | burst |" in text
