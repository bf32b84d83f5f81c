"""benchmarks/planner.py: the host-planning benchmark runs the runtime's own calls and renders its block."""
from benchmarks import planner


def test_one_setting_times_the_runtime_calls_and_renders(tmp_path):
    rows = [planner.one_setting(8, 16, 2, load, 12, reference=True) for load in ("balanced", "skewed", "burst")]
    for row in rows:
        assert row["critical_path"]["calls"] == 11 and row["critical_path"]["median_us"] > 0   # the first left out
        assert row["search"]["median_us"] > 0 and row["explicit_routes"]["calls"] == 5
        assert row["search_charged"]["median_us"] > 0                  # the work its budget counted
    assert rows[0]["calibration_searches"] == 0            # balanced: the prediction holds
    assert rows[2]["calibration_searches"] > 0             # bursts: calibration searches after the gate
    res = {"generated": "2026-01-01T00:00", "machine": planner.machine(), "machine_after": planner.machine(),
           "results": rows}
    doc = tmp_path / "b.md"
    doc.write_text("# B\n\n" + planner.BEGIN + "\nOLD-BLOCK\n" + planner.END + "\n\ntail\n")
    planner.replace_block(str(doc), planner.markdown(res), planner.BEGIN, planner.END, "here")
    text = doc.read_text()
    assert "OLD-BLOCK" not in text and text.endswith("tail\n") and "| 8 x 16 | 2 | burst |" in text
    charged = f" | {rows[0]['search_charged']['median_us']:.0f} | "
    assert charged in text.split("| 8 x 16 | 2 | balanced |")[1].split("\n")[0]


def test_search_work_benchmark_times_setups_and_steps(capsys):
    """benchmarks/search_work.py: every setting gets setups and steps timed against the work model's estimate."""
    from benchmarks import search_work
    rows = search_work.measure(trials=1)
    kinds = {(kind, ranks, experts) for kind, ranks, experts, _, _ in rows}
    assert all(("setup", r, e) in kinds and ("step", r, e) in kinds for r, e in search_work.SETTINGS)
    assert all(us > 0 for *_, us in rows)
    search_work.main(["--trials", "1"])
    assert "| 64 x 256 |" in capsys.readouterr().out


def test_planner_decisions_digest_and_compare(capsys):
    """benchmarks/planner_decisions.py: a call sequence digests identically twice; compare flags a differing call
    estimated slower than before (calibrated or not), and a differing calibrated call slower than its prefetched or
    sharded placement."""
    from benchmarks import planner_decisions as pd
    rows = pd.decisions(8, 16, 8, "burst", budgets=True)
    assert rows == pd.decisions(8, 16, 8, "burst", budgets=True) and all("layer_s" in r for r in rows)
    base = {"case": rows}
    assert pd.compare(base, base)
    i = next(i for i, r in enumerate(rows) if "prefetched_s" in r)
    better = dict(rows[i], digest="x", layer_s=rows[i]["layer_s"] * 0.5)
    worse = dict(rows[i], digest="y", layer_s=max(rows[i]["prefetched_s"], rows[i]["sharded_s"]) * 2)
    assert pd.compare(base, {"case": rows[:i] + [better] + rows[i + 1:]})
    capsys.readouterr()
    assert not pd.compare(base, {"case": rows[:i] + [worse] + rows[i + 1:]})
    assert "WORSE THAN ITS START" in capsys.readouterr().out
    # an uncalibrated call that differs: only the estimate before decides
    j = next(j for j, r in enumerate(rows) if "prefetched_s" not in r)
    slower = dict(rows[j], digest="z", layer_s=rows[j]["layer_s"] * 1.01)
    faster = dict(rows[j], digest="z", layer_s=rows[j]["layer_s"] * 0.99)
    assert pd.compare(base, {"case": rows[:j] + [faster] + rows[j + 1:]})
    capsys.readouterr()
    assert not pd.compare(base, {"case": rows[:j] + [slower] + rows[j + 1:]})
    assert "WORSE THAN BEFORE" in capsys.readouterr().out
    # a file from before every call was estimated: nothing to weigh an uncalibrated call against
    old = [{k: v for k, v in r.items() if "prefetched_s" in r or k == "digest"} for r in rows]
    assert pd.compare({"case": old}, {"case": rows[:j] + [slower] + rows[j + 1:]})
