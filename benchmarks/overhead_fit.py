"""Fit the simulator's per-call overhead model (:mod:`ds_hecate.sim.overhead`) from measured layer calls.

    overhead = fixed_s + per_row_byte_s * routed rows * row bytes + per_owned_byte_s * owned expert bytes

- **CPU** (this kind of machine): from a ``benchmarks/layer_versus.py`` JSON. Each cell (shape, dtype) gives a
  system's median forward + backward against the plain grouped-GEMM layer's (the floor); the overhead is the
  difference. ds_hecate's is ``ds_hecate-call-no-shortcuts`` (its layer call behind the plain layer's router, its
  collectives through the process group: the per-rank path of N ranks); the baselines' is the lower of DeepSpeed's
  AutoEP and legacy MoE layers in each cell (each with its own router, as users run them). Non-negative least
  squares over the cells.
- **GPU presets**: from a GPU check JSON (``benchmarks/gpu_check.py``'s ``layer_call`` stage, one rank, bf16). No
  plain layer ran there, so its time is estimated as the measured grouped GEMMs (``expert_compute_s``, forward +
  backward) plus :data:`PLAIN_TOKEN_PASSES` passes over the routed rows at :data:`GPU_MEMORY_GBPS` (the
  router, permutation, un-permute and their backward). The per-owned-byte term is what the call's ``plan`` and
  ``reduce_wait`` phases spent per owned byte (the pre-issue-41 runtime cast and packed the owned experts there, and
  zero-filled and accumulated their gradients); the fixed and per-row-byte terms are fitted to what remains. The
  baselines ran on no GPU: they are charged nothing (the plain layer's cost), which flatters them, not ds_hecate.

    python -m benchmarks.overhead_fit --versus docs/layer_versus_after.json --gpu docs/gpu_check_h200.json \\
        --json ds_hecate/sim/call_overhead_fit.json

The committed fit (``ds_hecate/sim/call_overhead_fit.json``, package data the presets read) is that command's
output; tests/test_call_overhead.py refits it from the committed inputs and requires the same numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.layer_call import SHAPES  # noqa: E402

HECATE_CPU_SYSTEM = "ds_hecate-call-no-shortcuts"
BASELINE_CPU_SYSTEMS = ("autoep", "deepspeed-moe")
#: the plain layer's passes over the routed rows besides its GEMMs (router, sort-permute gather, index_copy back,
#: weighted sum; and their backward), for the GPU estimate
PLAIN_TOKEN_PASSES = 10
#: the GPU check's device (H200, HBM3e), GB/s
GPU_MEMORY_GBPS = 4800.0
BYTES = {"fp32": 4, "bf16": 2}


def _features(shape_name: str, dtype: str) -> Tuple[float, float]:
    """(routed row bytes, owned expert bytes) of a one-rank call of ``shape_name`` (every expert owned)."""
    shape = SHAPES[shape_name]
    item = BYTES[dtype]
    return (shape.tokens * shape.top_k * shape.hidden * item, shape.experts * shape.expert_params * item)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by elimination of the most negative coefficient (tiny problems only)."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        if active:
            x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = [i for i in active if x[i] < 0]
        if not negative:
            return x
        active.remove(min(negative, key=lambda i: x[i]))


def _coefficients(x: np.ndarray) -> Dict[str, float]:
    return {"fixed_s": float(x[0]), "per_row_byte_s": float(x[1]), "per_owned_byte_s": float(x[2])}


def _residuals(points: List[dict], family: str, measured: List[float], fitted: np.ndarray) -> Dict[str, float]:
    """Each point's measured overhead, the model's and their difference under ``family``; the family's summary."""
    for point, m, f in zip(points, measured, fitted):
        point.setdefault("overhead_s", {})[family] = float(m)
        point.setdefault("fitted_s", {})[family] = float(f)
        point.setdefault("residual_s", {})[family] = float(m - f)
    res = np.asarray(measured) - fitted
    return {"points": len(res), "rms_s": float(np.sqrt(np.mean(res ** 2))), "max_abs_s": float(np.abs(res).max())}


def fit_cpu(versus: dict) -> Dict[str, dict]:
    """The CPU coefficients from a layer_versus JSON: ``{"hecate": {...}, "baselines": {...}, "points": [...],
    "residuals": {...}}``, each point with its measured and fitted overhead per family."""
    rows: Dict[str, List[Tuple[dict, float, float, float]]] = {"hecate": [], "baselines": []}
    points = []
    for cell in versus["cells"]:
        systems = cell["systems"]
        plain = systems.get("plain", {}).get("median_s")
        if plain is None:
            continue
        row_b, owned_b = _features(cell["shape"], cell["dtype"])
        hecate = systems.get(HECATE_CPU_SYSTEM, {}).get("median_s")
        base = [systems[s]["median_s"] for s in BASELINE_CPU_SYSTEMS if systems.get(s, {}).get("median_s")]
        point = {"shape": cell["shape"], "dtype": cell["dtype"], "row_bytes": row_b, "owned_bytes": owned_b,
                 "plain_s": plain, "hecate_s": hecate, "baseline_s": min(base) if base else None}
        points.append(point)
        if hecate is not None:
            rows["hecate"].append((point, row_b, owned_b, hecate - plain))
        if base:
            rows["baselines"].append((point, row_b, owned_b, min(base) - plain))
    out: Dict[str, dict] = {"points": points, "residuals": {}}
    for family, data in rows.items():
        if not data:
            continue
        arr = np.asarray([d[1:] for d in data], dtype=float)
        a = np.column_stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]])
        x = nnls(a, arr[:, 2])
        out[family] = _coefficients(x)
        out["residuals"][family] = _residuals([d[0] for d in data], family, list(arr[:, 2]), a @ x)
    return out


def fit_gpu(check: dict) -> Dict[str, dict]:
    """The GPU coefficients from a GPU check JSON (see the module docstring)."""
    records = [r for r in check["stages"]["layer_call"]["records"] if r["mode"] == "grouped"]
    points, remainder, measured = [], [], []
    per_byte = []
    for r in records:
        row_b, owned_b = _features(r["shape"], r["dtype"])
        plain = r["expert_compute_s"] + PLAIN_TOKEN_PASSES * row_b / (GPU_MEMORY_GBPS * 1e9)
        overhead = r["fwd_bwd_s"] - plain
        weight_phases = r["phases"].get("plan", 0.0) + r["phases"].get("reduce_wait", 0.0)
        per_byte.append(weight_phases / owned_b)
        points.append({"shape": r["shape"], "dtype": r["dtype"], "row_bytes": row_b, "owned_bytes": owned_b,
                       "hecate_s": r["fwd_bwd_s"], "plain_estimate_s": plain, "owned_byte_phases_s": weight_phases})
        remainder.append((row_b, overhead - weight_phases))
        measured.append(overhead)
    per_owned = float(np.mean(per_byte))
    arr = np.asarray(remainder, dtype=float)
    x = nnls(np.column_stack([np.ones(len(arr)), arr[:, 0]]), arr[:, 1])
    hecate = _coefficients(np.array([x[0], x[1], per_owned]))
    fitted = [hecate["fixed_s"] + hecate["per_row_byte_s"] * p["row_bytes"] + per_owned * p["owned_bytes"]
              for p in points]
    return {"hecate": hecate, "baselines": _coefficients(np.zeros(3)), "device_memory_gbps": GPU_MEMORY_GBPS,
            "points": points, "residuals": {"hecate": _residuals(points, "hecate", measured, np.asarray(fitted))},
            "per_owned_byte_by_point_s": [float(v) for v in per_byte]}


def _source(path: str, raw: dict) -> dict:
    """Where a fit's input came from: its path (relative to the checkout where it lies in it) and its own record."""
    p = Path(path).resolve()
    try:
        shown = str(p.relative_to(ROOT))
    except ValueError:
        shown = str(path)
    keys = ("date", "commit", "command", "machine", "started")
    return {"path": shown, **{k: raw[k] for k in keys if k in raw}}


def fit(versus: Optional[dict], check: Optional[dict]) -> dict:
    out = {}
    if versus is not None:
        out["cpu"] = fit_cpu(versus)
    if check is not None:
        out["gpu"] = fit_gpu(check)
    return out


def fit_files(versus_path: Optional[str], gpu_path: Optional[str]) -> dict:
    """:func:`fit` of the two input files, each device's entry naming its source (what the JSON records)."""
    load = (lambda p: json.loads(Path(p).read_text(encoding="utf-8")) if p else None)
    versus, check = load(versus_path), load(gpu_path)
    result = fit(versus, check)
    for device, path, raw in (("cpu", versus_path, versus), ("gpu", gpu_path, check)):
        if device in result:
            result[device]["source"] = _source(path, raw)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versus", help="a benchmarks/layer_versus.py --json file (CPU)")
    parser.add_argument("--gpu", help="a benchmarks/gpu_check.py --out file with its layer_call stage")
    parser.add_argument("--json", help="write the coefficients here")
    args = parser.parse_args(argv)
    if not args.versus and not args.gpu:
        parser.error("give --versus and/or --gpu")
    result = fit_files(args.versus, args.gpu)
    for device, coefficients in result.items():
        for family in ("hecate", "baselines"):
            if family in coefficients:
                c = coefficients[family]
                res = coefficients["residuals"].get(family)
                print(f"{device:4s} {family:9s} fixed {c['fixed_s'] * 1e3:8.3f} ms  per row byte "
                      f"{c['per_row_byte_s'] * 1e12:9.3f} ps  per owned byte {c['per_owned_byte_s'] * 1e12:9.4f} ps"
                      + (f"  residuals over {res['points']} points: rms {res['rms_s'] * 1e3:.3f} ms, max "
                         f"{res['max_abs_s'] * 1e3:.3f} ms" if res else "  (not fitted: no measurement)"))
        for point in coefficients["points"]:
            print(f"     {point['shape']:14s} {point['dtype']:5s} " + "  ".join(
                f"{family} {point['overhead_s'][family] * 1e3:8.3f} ms measured, {point['fitted_s'][family] * 1e3:8.3f}"
                " fitted" for family in ("hecate", "baselines") if family in point.get("overhead_s", {})))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
