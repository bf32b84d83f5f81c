"""``python -m benchmarks.planner``: the host-planning benchmark runs the runtime's own calls and renders its block."""
from benchmarks import common, planner


def test_one_setting_times_the_runtime_calls_and_renders(tmp_path):
    rows = [planner.one_setting(8, 16, 2, load, 12) for load in ("balanced", "skewed", "burst")]
    for row in rows:
        assert row["critical_path"]["calls"] == 11 and row["critical_path"]["median_us"] > 0   # the first left out
        assert row["search"]["median_us"] > 0
        assert row["search_charged"]["median_us"] > 0                  # the work its budget counted
    assert rows[0]["calibration_searches"] == 0            # balanced: the prediction holds
    assert rows[2]["calibration_searches"] > 0             # bursts: calibration searches after the gate
    top8 = [planner.one_setting(8, 16, 8, load, 12) for load in ("balanced", "skewed", "burst")]
    record = common.run_record("ds_hecate-planner/1", planner.MODULE, ["--quick"], common.describe_machine(),
                               results=rows + top8)
    begin, end = common.markers(planner.MODULE)
    doc = tmp_path / "b.md"
    doc.write_text(f"# B\n\n{begin}\nOLD-BLOCK\n{end}\n\ntail\n")
    common.replace_block(str(doc), planner.markdown(record), planner.MODULE)
    text = doc.read_text()
    assert "OLD-BLOCK" not in text and text.endswith("tail\n") and "`python -m benchmarks.planner --quick`" in text
    (row,) = [line.split(" | ") for line in text.splitlines() if line.startswith("| 8 x 16 |")]   # top-8 only
    balanced, skewed, burst = top8
    assert row[1] == "{median_us:.0f} / {p99_us:.0f}".format(**balanced["critical_path"])
    assert row[4] == f"{burst['calibration_searches']} of 11" and burst["calibration_searches"] > 0
    assert row[5] == f"{balanced['search']['median_us']:.0f} ({balanced['search_charged']['median_us']:.0f})"


def test_the_quick_run_writes_its_record_and_table(tmp_path):
    """``python -m benchmarks.planner --quick``: 8 and 64 ranks and experts, the record and the block."""
    import json
    record, doc = tmp_path / "planner.json", tmp_path / "b.md"
    assert planner.main(["--quick", "--json", str(record), "--markdown", str(doc)]) == 0
    results = json.loads(record.read_text())["results"]
    assert {(r["ranks"], r["experts"]) for r in results} == {(8, 8), (8, 64), (64, 8), (64, 64)}
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| 8 x ") or line.startswith("| 64 x ")]
    assert len(rows) == 4 and "20 of 19" not in doc.read_text()
