"""The simulator's per-call overhead model (issue 41, item 6): the committed fit (ds_hecate/sim/call_overhead_fit.json,
package data) is what ``python -m ds_hecate.sim.overhead_fit`` computes from its inputs under tests/fixtures/, the
presets carry exactly its coefficients (the GPU ones scaled to each preset's memory bandwidth, the fixed term kept),
a bad term is refused by name, and the simulator adds the charge to the step."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ds_hecate.errors import HecateError
from ds_hecate.sim import SimSettings, overhead_fit, simulate
from ds_hecate.sim.overhead import (FIT_NAME, TERMS, CallOverhead, CallOverheads, device_overheads, fit_path,
                                    load_fit)
from ds_hecate.sim.presets import CLUSTERS, MEMORY_GBPS, resolve_cluster

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "ds_hecate" / "sim" / FIT_NAME
CPU_INPUT = REPO / "tests" / "fixtures" / "call_overhead_cpu.json"
GPU_INPUT = REPO / "tests" / "fixtures" / "call_overhead_gpu.json"
#: vendor memory bandwidths (GB/s) the GPU fit (an H200 at 4,800) is scaled to, as docs/simulator.md lists them
VENDOR_GBPS = {"v100-4x8": 900.0, "a100-4x8": 1555.0, "h100-128x8": 3350.0}


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


def test_committed_fit_is_the_refit_of_the_committed_inputs():
    assert fit_path() == COMMITTED.resolve()
    refit = json.loads(json.dumps(overhead_fit.fit_files(str(CPU_INPUT), str(GPU_INPUT))))
    _same(refit, json.loads(COMMITTED.read_text(encoding="utf-8")))
    assert refit["cpu"]["source"]["path"] == "tests/fixtures/call_overhead_cpu.json"
    assert refit["gpu"]["source"]["path"] == "tests/fixtures/call_overhead_gpu.json"


def test_presets_carry_the_committed_coefficients():
    raw = json.loads(COMMITTED.read_text(encoding="utf-8"))   # read here, not through the module under test
    assert MEMORY_GBPS == VENDOR_GBPS
    gpu = raw["gpu"]
    for name, gbps in VENDOR_GBPS.items():
        ratio = gpu["device_memory_gbps"] / gbps
        got = CLUSTERS[name].call_overheads().as_dict()
        for family in ("hecate", "baselines"):
            want = gpu[family]
            assert got[family]["fixed_s"] == pytest.approx(want["fixed_s"], rel=1e-12), (name, family)
            for term in ("per_row_byte_s", "per_owned_byte_s"):
                assert got[family][term] == pytest.approx(want[term] * ratio, rel=1e-12), (name, family, term)
    cpu = CLUSTERS["cpu-2"].call_overheads().as_dict()
    for family in ("hecate", "baselines"):
        for term in TERMS:
            assert cpu[family][term] == pytest.approx(raw["cpu"][family][term], rel=1e-12), ("cpu-2", family, term)
    # every preset is charged from the fit: none is left at the model's zero default
    for name, cluster in CLUSTERS.items():
        assert cluster.call_overhead is not None, name
    assert CLUSTERS["h100-128x8"].call_overheads() == device_overheads(load_fit(), "gpu", 3350.0)


def test_gpu_baselines_are_charged_nothing_and_hecate_a_positive_overhead():
    """No baseline ran on a GPU: the GPU presets charge them nothing (conservative against Hecate, docs)."""
    for name in VENDOR_GBPS:
        model = CLUSTERS[name].call_overheads()
        assert model.baselines == CallOverhead(), name
        assert model.hecate.fixed_s > 0 and model.hecate.per_row_byte_s > 0 and model.hecate.per_owned_byte_s > 0


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
        device_overheads({"gpu": {"hecate": terms, "device_memory_gbps": 4800.0}}, "gpu", 900.0)


def test_bad_fit_files_are_refused(tmp_path):
    with pytest.raises(HecateError, match="no 'tpu'"):
        device_overheads(load_fit(), "tpu")
    broken = tmp_path / "fit.json"
    broken.write_text("{not json", encoding="utf-8")
    with pytest.raises(HecateError, match="cannot read the call overhead fit"):
        load_fit(broken)
    with pytest.raises(ValueError, match="unknown family"):
        CallOverheads.of({"hecate": {}, "deepspeed": {}})


def test_a_cluster_file_gives_its_own_coefficients(tmp_path):
    terms = {"fixed_s": 1e-3, "per_row_byte_s": 2e-12, "per_owned_byte_s": 0.0}
    fields = {k: v for k, v in vars(CLUSTERS["cpu-2"]).items() if k not in ("name", "call_overhead")}
    path = tmp_path / "box.json"
    path.write_text(json.dumps({**fields, "call_overhead": {"hecate": terms}}), encoding="utf-8")
    cluster = resolve_cluster(str(path))
    assert cluster.call_overheads().hecate == CallOverhead(**terms)
    assert cluster.call_overheads().baselines == CallOverhead()
    path.write_text(json.dumps({**fields, "call_overhead": {"hecate": {"fixed_s": -1}}}), encoding="utf-8")
    with pytest.raises(HecateError, match="call_overhead: hecate: call overhead term 'fixed_s'"):
        resolve_cluster(str(path))


def test_the_simulator_adds_the_charge_to_the_step():
    """Hecate's step with the fitted overhead is its step without it plus the breakdown's call_overhead (the charge
    changes no planning decision); the baselines are charged nothing on the GPU presets; the ideal never."""
    settings = SimSettings(steps=3, warmup=1)
    systems = ["ep", "hecate", "fastermoe", "ideal"]
    cluster = CLUSTERS["v100-4x8"]
    charged = simulate(cluster, "gpt-moe-s", "W1", settings, systems=systems).systems
    bare = simulate(replace(cluster, call_overhead=None), "gpt-moe-s", "W1", settings, systems=systems).systems
    hc = charged["hecate"]
    assert hc.breakdown_s["call_overhead"] > cluster.call_overheads().hecate.fixed_s
    assert hc.step_time_s == pytest.approx(bare["hecate"].step_time_s + hc.breakdown_s["call_overhead"], rel=1e-9)
    for name in ("ep", "fastermoe", "ideal"):
        assert charged[name].breakdown_s["call_overhead"] == 0.0, name
        assert charged[name].step_time_s == pytest.approx(bare[name].step_time_s, rel=1e-12), name
    off = simulate(cluster, "gpt-moe-s", "W1", replace(settings, charge_call_overhead=False), systems=systems).systems
    for name in systems:   # --no-call-overhead: the preset's coefficients left out, nothing else
        assert off[name].breakdown_s["call_overhead"] == 0.0, name
        assert off[name].step_time_s == pytest.approx(bare[name].step_time_s, rel=1e-12), name
    assert math.isfinite(hc.step_time_s)
