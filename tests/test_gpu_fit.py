"""``make gpu-fit`` and the GPU call overhead fit it feeds (docs/simulator.md, "Refitting on a GPU"): the layer
benchmark's N-rank rows, one record per shape, cut into one fixture with the device's memory bandwidth; that fixture
fitted on the dtype it ran, every system measured; the target itself runs end to end on the CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from ds_hecate.sim import overhead_fit
from ds_hecate.sim.overhead import TERMS
from test_call_overhead import known_cells

ROOT = Path(__file__).resolve().parents[1]
TRUTH = {"ds_hecate-call-no-shortcuts": (1e-4, 2e-12, 0.0), "autoep-no-shortcuts": (3e-4, 1e-12, 5e-14),
         "plain-all-to-all": (5e-5, 5e-13, 0.0)}
FITTED = {"ds_hecate-call-no-shortcuts": "ds_hecate", "autoep-no-shortcuts": "autoep",
          "plain-all-to-all": "plain-all-to-all"}


def _cells(dtype: str, device: str) -> List[Dict[str, Any]]:
    """Cells whose systems' calls are the plain layer's plus :data:`TRUTH`'s overhead."""
    return known_cells(TRUTH, [(64, 64, 128), (64, 32, 8), (4096, 2048, 128), (4096, 7168, 32)], top_k=8,
                       plain_s=1e-3, dtype=dtype, device=device)


def test_a_gpu_fixture_is_fitted_on_its_dtype_at_its_measured_bandwidth():
    """A bf16 run on CUDA (no fp32 cell: the CPU fit's dtype would leave nothing to fit) gives every measured
    system back its coefficients, AutoEP the baselines' (DeepSpeed's MoE did not run), and the presets' byte terms
    scale from the bandwidth measured beside it."""
    fixture = {"commit": "abc1234", "cells": _cells("bf16", "cuda:0"),
               "memory_bandwidth": {"gbps": 3000.0, "method": "measured", "device": "cuda:0"}}
    fit = overhead_fit.fit_gpu(fixture)
    assert fit["dtypes"] == ["bf16"] and "bf16" in fit["description"]
    assert fit["device_memory_gbps"] == 3000.0 and fit["memory_bandwidth"]["device"] == "cuda:0"
    for row, name in FITTED.items():
        for term, want in zip(TERMS, TRUTH[row]):
            assert fit["systems"][name][term] == pytest.approx(want, rel=1e-6, abs=1e-18), (name, term)
    assert fit["baselines_from"] == "autoep" and fit["hecate"] == fit["systems"]["ds_hecate"]
    unmeasured = {**fixture, "memory_bandwidth": None}
    assert overhead_fit.fit_gpu(unmeasured)["device_memory_gbps"] == overhead_fit.GPU_MEMORY_GBPS


def test_records_of_one_commit_and_device_are_cut_into_one_fixture():
    cells = _cells("bf16", "cuda:0")
    records = [{"commit": "abc1234", "command": f"layer --shape {c['shape']}", "cells": [c]} for c in cells]
    merged = overhead_fit.merge_records(records)
    fixture = overhead_fit.trim_record(merged, {"gbps": 3000.0})
    assert [c["shape"] for c in fixture["cells"]] == ["s0", "s1", "s2", "s3"]
    assert all(c["device"] == "cuda:0" for c in fixture["cells"]) and len(fixture["commands"]) == 4
    assert overhead_fit.record_device(records) == "cuda:0"
    with pytest.raises(ValueError, match="different commits"):
        overhead_fit.merge_records([records[0], {**records[1], "commit": "def5678"}])
    with pytest.raises(ValueError, match="ran on"):
        overhead_fit.record_device([records[0], {"cells": _cells("fp32", "cpu")}])


def test_gpu_inputs_are_named_once_each():
    assert overhead_fit.gpu_inputs(["a.json"]) == {overhead_fit.GPU_FIT: "a.json"}
    assert overhead_fit.gpu_inputs(["a.json", "gpu-h100=b.json"]) == {"gpu-h200": "a.json", "gpu-h100": "b.json"}
    for bad in (["x=a.json", "x=b.json"], ["cpu=a.json"], ["=a.json"], ["x="]):
        with pytest.raises(ValueError, match="NAME=PATH"):
            overhead_fit.gpu_inputs(bad)


def test_make_gpu_fit_runs_end_to_end_on_the_cpu(tmp_path):
    """The target as a GPU machine runs it, on the CPU and the quick shape: a record per shape, then one fixture
    with the bandwidth measured on the records' device, which the GPU fit reads (AutoEP beside ds_hecate)."""
    out = tmp_path / "gpu_fit"
    env = {**os.environ, "PYTHON": sys.executable, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    proc = subprocess.run(["make", "--no-print-directory", "gpu-fit", "FIT_DEVICE=cpu", "FIT_DTYPE=fp32",
                           "FIT_SHAPES=quick", "FIT_REPS=3", "FIT_MIB=16", f"FIT_OUT={out}", f"PYTHON={sys.executable}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fixture = json.loads(Path(f"{out}.json").read_text())
    assert fixture["memory_bandwidth"]["device"] == "cpu" and fixture["memory_bandwidth"]["gbps"] > 0
    (cell,) = fixture["cells"]
    assert cell["shape"] == "quick" and cell["device"] == "cpu"
    assert set(cell["systems"]) >= {"plain", "ds_hecate-call-no-shortcuts", "autoep-no-shortcuts", "plain-all-to-all"}
    fit = overhead_fit.fit_gpu(fixture)
    assert fit["dtypes"] == ["fp32"] and fit["baselines_from"] == "autoep"
