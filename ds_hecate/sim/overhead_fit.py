"""Fit the simulator's per-call overhead model (:mod:`.overhead`) from measured layer calls.

    overhead = fixed_s + per_row_byte_s * routed rows * row bytes + per_owned_byte_s * owned expert bytes

    python -m ds_hecate.sim.overhead_fit --cpu LAYER_RECORD --gpu GPU_RECORD --json ds_hecate/sim/call_overhead_fit.json

- From a layer benchmark record (``python -m benchmarks.layer --dtype fp32 --dtype bf16 --n-rank``, any device):
  each cell (shape, dtype) gives a system's median call against the plain grouped-GEMM layer's; the overhead is the
  difference. ds_hecate's is ``ds_hecate-call-no-shortcuts`` (its layer call behind the plain router, on the
  per-rank path of N ranks), the baselines' the lower of AutoEP's and DeepSpeed's MoE in each cell (with their own
  routers, as users run them), each fitted by non-negative least squares over the cells.
- From a GPU check record whose ``layer_call`` stage timed ds_hecate's layer call and its grouped GEMMs alone (no
  plain layer beside it): the plain layer is estimated as the grouped GEMMs plus :data:`PLAIN_TOKEN_PASSES` passes
  over the routed rows at the device's memory bandwidth; the per-owned-byte term is what the ``plan`` and
  ``reduce_wait`` phases spent per owned byte, the other two are fitted to the rest. No baseline ran there: they
  are charged nothing, which flatters them, not ds_hecate.

The committed fit (package data the presets read) is this module's output on the inputs under tests/fixtures/;
tests/test_call_overhead.py refits it and requires the same numbers.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

HECATE_SYSTEM = "ds_hecate-call-no-shortcuts"
BASELINE_SYSTEMS = ("autoep", "deepspeed-moe")
#: the plain layer's passes over the routed rows besides its GEMMs (router, sort-permute gather, index_copy back,
#: weighted sum; and their backward), for the GPU estimate
PLAIN_TOKEN_PASSES = 10
#: the memory bandwidth (GB/s) of the device the GPU record ran on when it does not say (HBM3e)
GPU_MEMORY_GBPS = 4800.0
BYTES = {"fp32": 4, "bf16": 2}
SOURCE_KEYS = ("date", "commit", "command", "machine", "started")


def features(point: dict) -> Tuple[float, float]:
    """(routed row bytes, owned expert bytes) of a one-rank call of the record's shape (every expert owned)."""
    item = BYTES[point["dtype"]]
    return (point["tokens"] * point["top_k"] * point["hidden"] * item,
            point["experts"] * 3 * point["hidden"] * point["ffn"] * item)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by dropping the most negative coefficient (tiny problems only)."""
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


def fit_layer_record(record: dict) -> Dict[str, Any]:
    """The coefficients from a layer benchmark record: ``{"hecate": ..., "baselines": ..., "points": [...],
    "residuals": {...}}``, each point with its measured and fitted overhead per family."""
    rows: Dict[str, List[Tuple[dict, float, float, float]]] = {"hecate": [], "baselines": []}
    points = []
    for cell in record["cells"]:
        systems = cell["systems"]
        plain = systems.get("plain", {}).get("median_s")
        if plain is None:
            continue
        row_b, owned_b = features(cell)
        hecate = systems.get(HECATE_SYSTEM, {}).get("median_s")
        base = [systems[s]["median_s"] for s in BASELINE_SYSTEMS if systems.get(s, {}).get("median_s")]
        point = {"shape": cell["shape"], "dtype": cell["dtype"], "row_bytes": row_b, "owned_bytes": owned_b,
                 "plain_s": plain, "hecate_s": hecate, "baseline_s": min(base) if base else None}
        points.append(point)
        if hecate is not None:
            rows["hecate"].append((point, row_b, owned_b, hecate - plain))
        if base:
            rows["baselines"].append((point, row_b, owned_b, min(base) - plain))
    out: Dict[str, Any] = {"points": points, "residuals": {}}
    for family, data in rows.items():
        if not data:
            continue
        arr = np.asarray([d[1:] for d in data], dtype=float)
        a = np.column_stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]])
        x = nnls(a, arr[:, 2])
        out[family] = _coefficients(x)
        out["residuals"][family] = _residuals([d[0] for d in data], family, list(arr[:, 2]), a @ x)
    return out


def fit_gpu_check(check: dict) -> Dict[str, Any]:
    """The coefficients from a GPU check record's ``layer_call`` stage (see the module docstring)."""
    records = [r for r in check["stages"]["layer_call"]["records"] if r["mode"] == "grouped"]
    points, remainder, measured, per_byte = [], [], [], []
    for r in records:
        row_b, owned_b = features(r)
        plain = r["expert_compute_s"] + PLAIN_TOKEN_PASSES * row_b / (GPU_MEMORY_GBPS * 1e9)
        weight_phases = r["phases"].get("plan", 0.0) + r["phases"].get("reduce_wait", 0.0)
        per_byte.append(weight_phases / owned_b)
        points.append({"shape": r["shape"], "dtype": r["dtype"], "row_bytes": row_b, "owned_bytes": owned_b,
                       "hecate_s": r["fwd_bwd_s"], "plain_estimate_s": plain, "owned_byte_phases_s": weight_phases})
        remainder.append((row_b, r["fwd_bwd_s"] - plain - weight_phases))
        measured.append(r["fwd_bwd_s"] - plain)
    per_owned = float(np.mean(per_byte))
    arr = np.asarray(remainder, dtype=float)
    x = nnls(np.column_stack([np.ones(len(arr)), arr[:, 0]]), arr[:, 1])
    hecate = _coefficients(np.array([x[0], x[1], per_owned]))
    fitted = [hecate["fixed_s"] + hecate["per_row_byte_s"] * p["row_bytes"] + per_owned * p["owned_bytes"]
              for p in points]
    return {"hecate": hecate, "baselines": _coefficients(np.zeros(3)), "device_memory_gbps": GPU_MEMORY_GBPS,
            "points": points, "residuals": {"hecate": _residuals(points, "hecate", measured, np.asarray(fitted))},
            "per_owned_byte_by_point_s": [float(v) for v in per_byte]}


def fit_gpu(data: dict) -> Dict[str, Any]:
    """The GPU presets' coefficients from a GPU check record or a layer benchmark record run on a GPU."""
    if "stages" in data:
        return fit_gpu_check(data)
    out = fit_layer_record(data)
    out.setdefault("baselines", _coefficients(np.zeros(3)))
    return {**out, "device_memory_gbps": GPU_MEMORY_GBPS}


def _source(path: str, raw: dict) -> dict:
    """Where a fit's input came from: its path (relative to the checkout when inside it) and its own record."""
    p = Path(path).resolve()
    try:
        shown = str(p.relative_to(Path(__file__).resolve().parents[2]))
    except ValueError:
        shown = str(path)
    return {"path": shown, **{k: raw[k] for k in SOURCE_KEYS if k in raw}}


def fit_files(cpu_path: Optional[str], gpu_path: Optional[str]) -> dict:
    """The fit of the two input files, each device class's entry naming its source."""
    result = {}
    for device, path, fit in (("cpu", cpu_path, fit_layer_record), ("gpu", gpu_path, fit_gpu)):
        if path:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
            result[device] = {**fit(raw), "source": _source(path, raw)}
    return result


def _print(result: dict) -> None:
    for device, coefficients in result.items():
        for family in ("hecate", "baselines"):
            c, res = coefficients[family], coefficients["residuals"].get(family)
            print(f"{device:4s} {family:9s} fixed {c['fixed_s'] * 1e3:8.3f} ms  per row byte "
                  f"{c['per_row_byte_s'] * 1e12:9.3f} ps  per owned byte {c['per_owned_byte_s'] * 1e12:9.4f} ps"
                  + (f"  residuals over {res['points']} points: rms {res['rms_s'] * 1e3:.3f} ms, max "
                     f"{res['max_abs_s'] * 1e3:.3f} ms" if res else "  (not fitted: no measurement)"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_hecate.sim.overhead_fit", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", help="a layer benchmark record run on the CPU (python -m benchmarks.layer)")
    parser.add_argument("--gpu", help="a GPU check record with a layer_call stage, or a layer record run on a GPU")
    parser.add_argument("--json", help="write the fit here (the committed one: ds_hecate/sim/call_overhead_fit.json)")
    args = parser.parse_args(argv)
    if not args.cpu and not args.gpu:
        parser.error("give --cpu and/or --gpu")
    result = fit_files(args.cpu, args.gpu)
    _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
