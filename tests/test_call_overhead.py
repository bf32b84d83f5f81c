"""The simulator's per-call overhead model (issue 41, item 6; issue 54, item 3): the committed fit
(ds_hecate/sim/call_overhead_fit.json, package data) is what ``python -m ds_hecate.sim.overhead_fit`` computes from its
inputs under tests/fixtures/; the fit is per system, from the N-rank rows of one layer benchmark run; every preset
charges both families from the CPU fit (byte terms scaled to its memory bandwidth, the fixed term kept), the old H200
fit selectable by name; a bad term or fit name is refused by name; the simulator adds the charge to the step and says
which fit charged it and how old that fit is."""
from __future__ import annotations

import datetime
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from ds_hecate.errors import HecateError
from ds_hecate.sim import SimSettings, overhead_fit, simulate
from ds_hecate.sim.overhead import (FIT_NAME, TERMS, CallOverhead, CallOverheads, fit_overheads, fit_path,
                                    load_fit)
from ds_hecate.sim.presets import CLUSTERS, MEMORY_GBPS, resolve_cluster

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "ds_hecate" / "sim" / FIT_NAME
CPU_INPUT = REPO / "tests" / "fixtures" / "call_overhead_cpu.json"
#: vendor memory bandwidths (GB/s) of the GPU presets, as docs/simulator.md lists them
VENDOR_GBPS = {"v100-4x8": 900.0, "a100-4x8": 1555.0, "h100-128x8": 3350.0}
#: the layer benchmark's rows each fitted system is read from: its N-rank path
N_RANK_ROWS = {"ds_hecate": "ds_hecate-call-no-shortcuts", "autoep": "autoep-no-shortcuts",
               "deepspeed-moe": "deepspeed-moe-no-shortcuts", "plain-all-to-all": "plain-all-to-all"}


def _same(a, b, where="fit"):
    """Equal structures, floats to 1e-9 relative (the fit is a least-squares solve: BLAS may round differently)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b) if isinstance(b, dict) else b)
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-15), where
    else:
        assert a == b, where


def _raw() -> dict:
    return json.loads(COMMITTED.read_text(encoding="utf-8"))   # read here, not through the module under test


def test_committed_fit_is_the_refit_of_the_committed_inputs():
    """Every fit of the committed file is the refit of the fixture it names (a GPU fit added from ``make gpu-fit``
    included), the CPU fit the default."""
    assert fit_path() == COMMITTED.resolve()
    sources = {name: str(REPO / fit["source"]["path"]) for name, fit in _raw()["fits"].items()}
    gpus = {name: path for name, path in sources.items() if name != "cpu"}
    refit = json.loads(json.dumps(overhead_fit.fit_files(sources["cpu"], gpus)))
    _same(refit, _raw())
    assert refit["default"] == "cpu" and set(refit["fits"]) >= {"cpu", "gpu-h200"}
    assert refit["fits"]["cpu"]["source"]["path"] == "tests/fixtures/call_overhead_cpu.json"
    assert refit["fits"]["gpu-h200"]["source"]["path"] == "tests/fixtures/call_overhead_gpu.json"


def test_the_cpu_fixture_holds_the_host_bound_cells_and_the_n_rank_rows():
    """The fit's input: every shape of the layer benchmark's CPU set, the host-bound ones among them (the fixed term
    shows there), in both dtypes, each with the plain layer and every fitted system's N-rank row; the memory
    bandwidth measured beside it, saying how."""
    fixture = json.loads(CPU_INPUT.read_text(encoding="utf-8"))
    cells = {(c["shape"], c["dtype"]) for c in fixture["cells"]}
    shapes = ("weight-bound", "launch-bound", "compute-bound", "host-bound", "host-bound-8")
    assert cells == {(s, d) for s in shapes for d in ("fp32", "bf16")}
    for cell in fixture["cells"]:
        assert set(cell["systems"]) == {"plain", *N_RANK_ROWS.values()}, (cell["shape"], cell["dtype"])
    bandwidth = fixture["memory_bandwidth"]
    assert bandwidth["gbps"] > 0 and "one thread" in bandwidth["method"]
    assert fixture["commit"] and fixture["date"] and "--n-rank" in fixture["command"]


def test_each_system_is_fitted_from_its_n_rank_row_against_plain():
    """Per system, the committed coefficients are the non-negative least squares of its N-rank row minus the plain
    layer over the fixture's fp32 cells, each weighed by the plain call (solved here with numpy's own lstsq on the
    active terms); the baselines family is the DeepSpeed layer whose overhead summed over those cells is the lower,
    the hecate family ds_hecate's."""
    import numpy as np
    fixture, fit = json.loads(CPU_INPUT.read_text(encoding="utf-8")), _raw()["fits"]["cpu"]
    assert fit["dtypes"] == ["fp32"]
    totals = {}
    for name, row in N_RANK_ROWS.items():
        feats, over, plain = [], [], []
        for c in fixture["cells"]:
            if c["dtype"] != "fp32":
                continue
            feats.append([1.0, c["tokens"] * c["top_k"] * c["hidden"] * 4,
                          c["experts"] * 3 * c["hidden"] * c["ffn"] * 4])
            over.append(c["systems"][row]["median_s"] - c["systems"]["plain"]["median_s"])
            plain.append(c["systems"]["plain"]["median_s"])
        a, b, w = np.asarray(feats), np.asarray(over), 1.0 / np.asarray(plain)
        assert len(b) == 5, name
        got = np.array([fit["systems"][name][t] for t in TERMS])
        active = got > 0
        assert (got >= 0).all(), name
        x = np.zeros(3)
        x[active] = np.linalg.lstsq(a[:, active] * w[:, None], b * w, rcond=None)[0]
        assert np.allclose(x, got, rtol=1e-6, atol=1e-18), (name, x, got)
        totals[name] = b.sum()
    chosen = min(("autoep", "deepspeed-moe"), key=lambda n: totals[n])
    assert fit["baselines_from"] == chosen
    assert fit["baselines"] == fit["systems"][chosen] and fit["hecate"] == fit["systems"]["ds_hecate"]


def known_cells(truth: Dict[str, Tuple[float, float, float]], shapes: List[Tuple[int, int, int]], top_k: int,
                plain_s: float, **extra: Any) -> List[Dict[str, Any]]:
    """Layer benchmark cells (``shapes``: tokens, hidden, experts; ``extra``: dtype, device) whose rows' calls are
    the plain layer's (``plain_s`` times the cell's place) plus each row's overhead from ``truth``'s coefficients."""
    cells: List[Dict[str, Any]] = []
    for i, (tokens, hidden, experts) in enumerate(shapes):
        cell: Dict[str, Any] = {"shape": f"s{i}", "dtype": "fp32", "hidden": hidden, "ffn": hidden,
                                "experts": experts, "top_k": top_k, "tokens": tokens, **extra}
        rows, owned = overhead_fit.features(cell)
        plain = plain_s * (i + 1)
        cell["systems"] = {"plain": {"median_s": plain}, **{
            s: {"median_s": plain + f + r * rows + o * owned} for s, (f, r, o) in truth.items()}}
        cells.append(cell)
    return cells


def test_a_fit_recovers_known_coefficients_and_wants_the_n_rank_rows():
    """A record built from known per-system coefficients is fitted back to them; one without the N-rank rows is
    refused naming the row (a one-rank AutoEP row skips its all-to-alls: it must not stand in)."""
    truth = {"ds_hecate-call-no-shortcuts": (1e-4, 2e-12, 0.0), "autoep-no-shortcuts": (3e-4, 1e-12, 5e-14),
             "deepspeed-moe-no-shortcuts": (9e-4, 4e-12, 1e-13), "plain-all-to-all": (5e-5, 5e-13, 0.0)}
    cells = known_cells(truth, [(64, 64, 128), (64, 32, 8), (512, 256, 128), (4096, 64, 128), (2048, 256, 16)],
                        top_k=2, plain_s=0.01)
    fit = overhead_fit.fit_layer_record({"cells": cells})
    for name, row in N_RANK_ROWS.items():
        for term, want in zip(TERMS, truth[row]):
            assert fit["systems"][name][term] == pytest.approx(want, rel=1e-6, abs=1e-18), (name, term)
    assert fit["baselines_from"] == "autoep"
    one_rank = [{**c, "systems": {k.replace("-no-shortcuts", ""): v for k, v in c["systems"].items()}} for c in cells]
    with pytest.raises(ValueError, match="ds_hecate-call-no-shortcuts"):
        overhead_fit.fit_layer_record({"cells": one_rank})
    record = {"commit": "abc1234", "date": "2026-01-01T00:00:00+00:00", "command": "layer --n-rank",
              "cells": [{**c, "systems": {**{k: {"median_s": v["median_s"], "times_s": [1.0]}
                                             for k, v in c["systems"].items()}, "autoep": {"median_s": 1.0}}}
                        for c in cells]}
    trimmed = overhead_fit.trim_record(record, {"gbps": 7.5, "method": "given"})
    assert trimmed["commit"] == "abc1234" and trimmed["memory_bandwidth"]["gbps"] == 7.5
    assert all(set(c["systems"]) == {"plain", *truth} for c in trimmed["cells"])
    without_autoep = [{**c, "systems": {k: v for k, v in c["systems"].items() if k != "autoep-no-shortcuts"}}
                      for c in cells]   # one of DeepSpeed's layers is enough (a GPU run may time AutoEP alone)
    assert overhead_fit.trim_record({"cells": without_autoep}, {})["cells"]
    with pytest.raises(ValueError, match="autoep-no-shortcuts.*deepspeed-moe-no-shortcuts"):
        overhead_fit.trim_record({"cells": [{**c, "systems": {k: v for k, v in c["systems"].items()
                                                             if k != "deepspeed-moe-no-shortcuts"}}
                                            for c in without_autoep]}, {})
    with pytest.raises(ValueError, match="ds_hecate-call-no-shortcuts"):
        overhead_fit.trim_record({"cells": [{**c, "systems": {k: v for k, v in c["systems"].items()
                                                             if k != "ds_hecate-call-no-shortcuts"}}
                                            for c in cells]}, {})


def test_memory_bandwidth_is_measured_and_says_how():
    measured = overhead_fit.measure_memory_gbps(mib=8, reps=3)
    assert measured["gbps"] > 0 and measured["copy_gbps"] > 0 and "torch.add" in measured["method"]


def test_every_preset_is_charged_both_families_from_the_cpu_fit():
    """Symmetric: each preset's ds_hecate and baselines coefficients are the CPU fit's, the byte terms scaled by the
    CPU's measured memory bandwidth over the preset's, the fixed term kept; the baselines are charged too."""
    raw = _raw()
    assert raw["default"] == "cpu"
    cpu = raw["fits"]["cpu"]
    assert MEMORY_GBPS == {**VENDOR_GBPS, "cpu-2": cpu["device_memory_gbps"]}
    assert cpu["device_memory_gbps"] == json.loads(CPU_INPUT.read_text(encoding="utf-8"))["memory_bandwidth"]["gbps"]
    for name, gbps in MEMORY_GBPS.items():
        ratio = cpu["device_memory_gbps"] / gbps
        got = CLUSTERS[name].call_overheads().as_dict()
        assert CLUSTERS[name].call_overhead_fit == "cpu" and CLUSTERS[name].memory_gbps == gbps, name
        for family in ("hecate", "baselines"):
            want = cpu[family]
            assert got[family]["fixed_s"] == pytest.approx(want["fixed_s"], rel=1e-12), (name, family)
            for term in ("per_row_byte_s", "per_owned_byte_s"):
                assert got[family][term] == pytest.approx(want[term] * ratio, rel=1e-12), (name, family, term)
        assert got["baselines"] != CallOverhead().__dict__ and sum(got["baselines"].values()) > 0, name
    assert CLUSTERS["h100-128x8"].call_overheads() == fit_overheads(load_fit(), "cpu", 3350.0)


def test_the_h200_fit_is_selectable_by_name_and_a_bad_name_is_refused(capsys):
    from ds_hecate.tools.cli import main
    raw = _raw()["fits"]["gpu-h200"]
    h200 = CLUSTERS["v100-4x8"].charged_by("gpu-h200")
    assert h200.call_overheads().baselines == CallOverhead()   # none measured on a GPU
    assert h200.call_overheads().hecate.fixed_s == pytest.approx(raw["hecate"]["fixed_s"], rel=1e-12)
    assert h200.call_overheads().hecate.per_row_byte_s == pytest.approx(
        raw["hecate"]["per_row_byte_s"] * raw["device_memory_gbps"] / 900.0, rel=1e-12)
    with pytest.raises(HecateError, match="unknown call overhead fit 'gpu-h100'; the fit file has cpu, gpu-h200"):
        CLUSTERS["v100-4x8"].charged_by("gpu-h100")
    with pytest.raises(HecateError, match="cluster 'cpu-measured' has no memory_gbps"):
        CLUSTERS["cpu-2"].from_measured({"compute_s_per_pair": 1e-6, "link_gbps": 1.0,
                                         "non_moe_time_s": 1e-3}).charged_by("cpu")
    settings = SimSettings(steps=2, charge_planning=False, call_overhead_fit="gpu-h200")
    result = simulate("v100-4x8", "gpt-moe-s", "W1", settings, systems=["ep", "hecate"])
    assert result.systems["ep"].breakdown_s["call_overhead"] == 0.0
    assert "fit 'gpu-h200'" in result.call_overhead and "commit 43975fc" in result.call_overhead
    assert main(["simulate", "--cluster", "v100-4x8", "--model", "gpt-moe-s", "--workload", "W1", "--steps", "2",
                 "--call-overhead-fit", "gpu-h100"]) == 2
    assert "argument --call-overhead-fit: invalid choice: 'gpu-h100'" in capsys.readouterr().err


def test_the_simulator_names_the_fit_and_its_age(tmp_path, capsys):
    """``ds-hecate simulate``'s table and JSON name the fit that charged the cluster: its source, commit, date and
    age in days on the day of the run, and the bandwidths its byte terms were scaled between."""
    from ds_hecate.tools.cli import main
    fit = _raw()["fits"]["cpu"]
    measured = datetime.date.fromisoformat(fit["source"]["date"][:10])
    age = (datetime.datetime.now(datetime.timezone.utc).date() - measured).days
    out = tmp_path / "sim.json"
    assert main(["simulate", "--cluster", "a100-4x8", "--model", "bert-moe", "--workload", "W3", "--steps", "2",
                 "--systems", "ep", "hecate", "--no-planning-charge", "--json", str(out)]) == 0
    line = json.loads(out.read_text())["call_overhead"]
    assert line in capsys.readouterr().out
    for needle in (f"a100-4x8: fit 'cpu' (CPU layer benchmark", f"run on {measured.isoformat()}",
                   f"commit {fit['source']['commit']}", f"{age} days before this run",
                   f"from {fit['device_memory_gbps']:g} to 1555 GB/s", f"baselines charged {fit['baselines_from']}'s"):
        assert needle in line, (needle, line)
    bare = replace(CLUSTERS["cpu-2"], call_overhead=None, call_overhead_fit=None)
    assert "no per-call overhead" in simulate(bare, "gpt-moe-s", "W0", SimSettings(steps=2)).call_overhead


@pytest.mark.parametrize("terms, named", [
    ({"fixed_s": -1e-3}, "fixed_s"),
    ({"per_row_byte_s": float("nan")}, "per_row_byte_s"),
    ({"per_owned_byte_s": float("inf")}, "per_owned_byte_s"),
    ({"per_owned_byte_s": "fast"}, "per_owned_byte_s"),
    ({"per_row_s": 1e-12}, "per_row_s"),
])
def test_bad_terms_are_refused_by_name(terms, named):
    with pytest.raises(ValueError, match=named):
        CallOverhead.of(terms)
    with pytest.raises(ValueError, match=f"baselines: .*{named}"):
        CallOverheads.of({"hecate": {}, "baselines": terms})
    with pytest.raises(HecateError, match=f"cluster 'bad'.*hecate: .*{named}"):
        raw: Any = {"hecate": terms}   # as a JSON file gives it: the cluster converts it
        replace(CLUSTERS["v100-4x8"], name="bad", call_overhead=raw)
    with pytest.raises(ValueError, match=named):
        fit_overheads({"default": "x", "fits": {"x": {"hecate": terms, "device_memory_gbps": 4800.0}}}, "x", 900.0)


def test_bad_fit_files_are_refused(tmp_path):
    with pytest.raises(HecateError, match="unknown call overhead fit 'tpu'"):
        fit_overheads(load_fit(), "tpu")
    broken = tmp_path / "fit.json"
    broken.write_text("{not json", encoding="utf-8")
    with pytest.raises(HecateError, match="cannot read the call overhead fit"):
        load_fit(broken)
    broken.write_text(json.dumps({"cpu": {}}), encoding="utf-8")   # the layout of before: no fits, no default
    with pytest.raises(HecateError, match="has no fits or no default"):
        load_fit(broken)
    with pytest.raises(ValueError, match="unknown family"):
        CallOverheads.of({"hecate": {}, "deepspeed": {}})


def test_a_cluster_file_gives_its_own_coefficients_or_names_a_fit(tmp_path):
    terms = {"fixed_s": 1e-3, "per_row_byte_s": 2e-12, "per_owned_byte_s": 0.0}
    fields = {k: v for k, v in vars(CLUSTERS["cpu-2"]).items()
              if k not in ("name", "call_overhead", "call_overhead_fit", "memory_gbps")}
    path = tmp_path / "box.json"
    path.write_text(json.dumps({**fields, "call_overhead": {"hecate": terms}}), encoding="utf-8")
    cluster = resolve_cluster(str(path))
    assert cluster.call_overheads().hecate == CallOverhead(**terms)
    assert cluster.call_overheads().baselines == CallOverhead()
    assert "own call_overhead coefficients" in cluster.call_overhead_note(datetime.date.today())
    path.write_text(json.dumps({**fields, "memory_gbps": 2000.0, "call_overhead_fit": "cpu"}), encoding="utf-8")
    assert resolve_cluster(str(path)).call_overheads() == fit_overheads(load_fit(), "cpu", 2000.0)
    path.write_text(json.dumps({**fields, "call_overhead_fit": "cpu"}), encoding="utf-8")
    with pytest.raises(HecateError, match="cluster 'box.json' has no memory_gbps"):
        resolve_cluster(str(path))
    path.write_text(json.dumps({**fields, "call_overhead": {"hecate": {"fixed_s": -1}}}), encoding="utf-8")
    with pytest.raises(HecateError, match="call_overhead: hecate: call overhead term 'fixed_s'"):
        resolve_cluster(str(path))


def test_the_simulator_adds_the_charge_to_the_step():
    """Each system's step with the fitted overhead is its step without it plus the breakdown's call_overhead (the
    charge changes no planning decision); every system but the ideal is charged, on the GPU presets too."""
    settings = SimSettings(steps=3, warmup=1)
    systems = ["ep", "hecate", "fastermoe", "ideal"]
    cluster = CLUSTERS["v100-4x8"]
    charged = simulate(cluster, "gpt-moe-s", "W1", settings, systems=systems).systems
    bare = simulate(replace(cluster, call_overhead=None, call_overhead_fit=None), "gpt-moe-s", "W1", settings,
                    systems=systems).systems
    model = cluster.call_overheads()
    for name in ("ep", "hecate", "fastermoe"):
        c = charged[name]
        fixed = (model.hecate if name == "hecate" else model.baselines).fixed_s
        assert c.breakdown_s["call_overhead"] > fixed * 12 * 0.999, name   # 12 MoE layers, at least the fixed term
        assert c.step_time_s == pytest.approx(bare[name].step_time_s + c.breakdown_s["call_overhead"], rel=1e-9)
    assert charged["ideal"].breakdown_s["call_overhead"] == 0.0
    assert charged["ideal"].step_time_s == pytest.approx(bare["ideal"].step_time_s, rel=1e-12)
    off = simulate(cluster, "gpt-moe-s", "W1", replace(settings, charge_call_overhead=False), systems=systems).systems
    for name in systems:   # --no-call-overhead: the preset's coefficients left out, nothing else
        assert off[name].breakdown_s["call_overhead"] == 0.0, name
        assert off[name].step_time_s == pytest.approx(bare[name].step_time_s, rel=1e-12), name
    assert math.isfinite(charged["hecate"].step_time_s)
