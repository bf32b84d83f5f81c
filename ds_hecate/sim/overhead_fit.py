"""Fit the simulator's per-call overhead model (:mod:`.overhead`) from measured layer calls.

    overhead = fixed_s + per_row_byte_s * routed rows * row bytes + per_owned_byte_s * owned expert bytes

From a layer benchmark record to the committed fit, in two steps (docs/simulator.md, "Call overhead")::

    python -m benchmarks.layer --shape weight-bound --shape launch-bound --shape compute-bound \\
        --shape host-bound --shape host-bound-8 --dtype fp32 --dtype bf16 --n-rank --json runs/layer.json
    python -m ds_hecate.sim.overhead_fit --trim runs/layer.json --fixture tests/fixtures/call_overhead_cpu.json
    python -m ds_hecate.sim.overhead_fit --cpu tests/fixtures/call_overhead_cpu.json \\
        --gpu gpu-h200=tests/fixtures/call_overhead_gpu.json --json ds_hecate/sim/call_overhead_fit.json

- ``--trim``: the record cut to what the fit reads (every cell's shape and each fitted system's median call), with
  this machine's memory bandwidth measured beside it (:func:`measure_memory_gbps`; run it on the machine that ran
  the benchmark), which the presets scale the byte terms by.
- ``--cpu``, the fit ``cpu``: every system of :data:`FIT_SYSTEMS` on its N-rank path (collectives through the
  process group, as on N ranks) minus the plain grouped-GEMM layer's call in the same cell, fitted per system by
  non-negative least squares over the cells. The simulator's ``hecate`` family is ds_hecate's; its ``baselines``
  family (EP, FasterMoE, SmartMoE, FlexMoE: expert-parallel layers) is the one of DeepSpeed's two layers
  (:data:`BASELINE_CANDIDATES`) whose calls cost less over the plain layer summed over the cells. The plain
  all-to-all floor's fit is kept as a reference: what the exchange alone costs over the plain layer.
- ``--gpu``, the fit ``gpu-h200`` (a user's alternative, ``ds-hecate simulate --call-overhead-fit gpu-h200``): a GPU
  check record whose ``layer_call`` stage timed ds_hecate's layer call and its grouped GEMMs alone (no plain layer
  beside it): the plain layer is estimated as the grouped GEMMs plus :data:`PLAIN_TOKEN_PASSES` passes over the
  routed rows at the device's memory bandwidth; the per-owned-byte term is what the ``plan`` and ``reduce_wait``
  phases spent per owned byte, the other two are fitted to the rest. No baseline ran there: they are charged
  nothing. Or the fixture of a layer benchmark run on a GPU (``make gpu-fit``: one record per shape, cut together by
  ``--trim`` with the device's memory bandwidth measured beside them), fitted as the CPU one is, on the dtypes it
  ran (bf16), every system measured (``--gpu gpu-h100=PATH`` names it).

tests/test_call_overhead.py refits the committed file from the fixtures and requires the same numbers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

#: the fitted systems: the name in the fit file -> the layer benchmark's row (each on its N-rank path)
FIT_SYSTEMS = {"ds_hecate": "ds_hecate-call-no-shortcuts", "autoep": "autoep-no-shortcuts",
               "deepspeed-moe": "deepspeed-moe-no-shortcuts", "plain-all-to-all": "plain-all-to-all"}
#: the simulator's ``hecate`` family is ds_hecate's fit
HECATE_FIT = "ds_hecate"
#: its ``baselines`` family is the lower-overhead of DeepSpeed's two layers
BASELINE_CANDIDATES = ("autoep", "deepspeed-moe")
#: the layer benchmark's reference row, overhead 0
PLAIN = "plain"
#: the rows of the baseline candidates, of which a record needs one at least
BASELINE_ROWS = tuple(FIT_SYSTEMS[c] for c in BASELINE_CANDIDATES)
#: the fields of a layer record's cell the fit reads
CELL_KEYS = ("shape", "dtype", "hidden", "ffn", "experts", "top_k", "tokens")
#: what a fixture keeps of a cell beside them, where the record has it: the device it ran on
CELL_EXTRA_KEYS = ("device",)
#: the dtypes whose cells are fitted: on a CPU a bf16 call is not memory-bound (the plain layer's weight-bound call
#: takes 4x longer in bf16 than in fp32 at half the bytes), so its cells break the byte terms' premise; they stay in
#: the fixture and the fit file beside the model's figure for them
FIT_DTYPES = ("fp32",)
#: the fits' names in the fit file; the presets are charged :data:`DEFAULT_FIT`
CPU_FIT, GPU_FIT, DEFAULT_FIT = "cpu", "gpu-h200", "cpu"
#: the plain layer's passes over the routed rows besides its GEMMs (router, sort-permute gather, index_copy back,
#: weighted sum; and their backward), for the GPU estimate
PLAIN_TOKEN_PASSES = 10
#: the memory bandwidth (GB/s) of the device the GPU record ran on when it does not say (H200, HBM3e)
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


def fit_layer_record(record: dict, dtypes: Sequence[str] = FIT_DTYPES) -> Dict[str, Any]:
    """The per-system coefficients from a layer benchmark record (or its fixture): ``{"systems": {name: coeffs},
    "hecate": ..., "baselines": ..., "baselines_from": name, "points": [...], "residuals": {...}}``, each point with
    every system's measured and modelled overhead (the cells of other dtypes than ``dtypes`` are shown, not fitted).

    Each system's least squares weighs a cell's overhead by the plain layer's call there (a relative error): a
    call's time moves by a share of itself from run to run (10-15% on a CPU), so unweighted, a 100 ms cell's noise
    would decide the fixed term the millisecond host-bound cells measure."""
    rows: Dict[str, List[Tuple[dict, float, float, float, float]]] = {name: [] for name in FIT_SYSTEMS}
    points = []
    for cell in record["cells"]:
        systems = cell["systems"]
        plain = systems.get(PLAIN, {}).get("median_s")
        if plain is None:
            continue
        row_b, owned_b = features(cell)
        point = {"shape": cell["shape"], "dtype": cell["dtype"], "row_bytes": row_b, "owned_bytes": owned_b,
                 "plain_s": plain, "fitted": cell["dtype"] in dtypes}
        points.append(point)
        for name, row in FIT_SYSTEMS.items():
            median = systems.get(row, {}).get("median_s")
            if median is not None:
                rows[name].append((point, row_b, owned_b, median - plain, plain))
    out: Dict[str, Any] = {"dtypes": list(dtypes), "weights": "1 / plain_s", "points": points, "systems": {},
                           "residuals": {}, "total_overhead_s": {}}
    for name, data in rows.items():
        fitted = [d for d in data if d[0]["fitted"]]
        if not fitted:
            continue
        arr = np.asarray([d[1:] for d in fitted], dtype=float)
        a = np.column_stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]])
        x = nnls(a / arr[:, 3:4], arr[:, 2] / arr[:, 3])
        out["systems"][name] = _coefficients(x)
        out["residuals"][name] = _residuals([d[0] for d in fitted], name, list(arr[:, 2]), a @ x)
        out["total_overhead_s"][name] = float(arr[:, 2].sum())
        for point, row_b, owned_b, overhead, _ in data:   # the other dtypes' cells: measured against the model
            if not point["fitted"]:
                point.setdefault("overhead_s", {})[name] = float(overhead)
                point.setdefault("fitted_s", {})[name] = float(x[0] + x[1] * row_b + x[2] * owned_b)
    if HECATE_FIT not in out["systems"]:
        raise ValueError(f"the layer record has no {FIT_SYSTEMS[HECATE_FIT]!r} row beside {PLAIN!r}: run "
                         "python -m benchmarks.layer with --n-rank")
    candidates = [c for c in BASELINE_CANDIDATES if c in out["systems"]]
    if not candidates:
        raise ValueError(f"the layer record has none of {[FIT_SYSTEMS[c] for c in BASELINE_CANDIDATES]} beside "
                         f"{PLAIN!r}: run python -m benchmarks.layer with --n-rank and AutoEP's pins")
    cells = {len(rows[c]) for c in candidates}
    if len(cells) != 1:
        raise ValueError(f"DeepSpeed's layers ran on different numbers of cells ({cells}): they cannot be compared")
    chosen = min(candidates, key=lambda c: out["total_overhead_s"][c])
    out.update(hecate=out["systems"][HECATE_FIT], baselines=out["systems"][chosen], baselines_from=chosen)
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
    return {"hecate": hecate, "baselines": _coefficients(np.zeros(3)), "baselines_from": None,
            "device_memory_gbps": GPU_MEMORY_GBPS, "points": points,
            "residuals": {"hecate": _residuals(points, "hecate", measured, np.asarray(fitted))},
            "per_owned_byte_by_point_s": [float(v) for v in per_byte]}


def fit_fixture(fixture: dict, dtypes: Sequence[str], description: str,
                default_gbps: Optional[float] = None) -> Dict[str, Any]:
    """A layer benchmark fixture's fit (:func:`fit_layer_record` over ``dtypes``) at the memory bandwidth measured
    beside it (``--trim``), else ``default_gbps``; with neither it is refused."""
    bandwidth = fixture.get("memory_bandwidth")
    measured = bandwidth if isinstance(bandwidth, dict) and bandwidth.get("gbps") else None
    if measured is None and default_gbps is None:
        raise ValueError("the CPU fixture has no memory_bandwidth.gbps: make it with python -m "
                         "ds_hecate.sim.overhead_fit --trim RECORD --fixture PATH")
    return {"description": description, **fit_layer_record(fixture, dtypes),
            "device_memory_gbps": float(measured["gbps"]) if measured else float(default_gbps or 0.0),
            **({"memory_bandwidth": measured} if measured else {})}


def fit_cpu(record: dict) -> Dict[str, Any]:
    """The fit ``cpu``: the fixture's fp32 cells (:data:`FIT_DTYPES`) at the memory bandwidth it measured."""
    return fit_fixture(record, FIT_DTYPES, "CPU layer benchmark, N-rank paths")


def fit_gpu(data: dict) -> Dict[str, Any]:
    """The fit of a GPU check record, or of a layer benchmark fixture run on a GPU: every dtype it ran (on a GPU,
    bf16 is the memory-bound reference), at its measured bandwidth (else :data:`GPU_MEMORY_GBPS`)."""
    if "stages" in data:
        return {"description": "GPU check, ds_hecate's layer call before its rework; baselines not measured",
                **fit_gpu_check(data)}
    dtypes = sorted({cell["dtype"] for cell in data["cells"]})
    return fit_fixture(data, dtypes, f"GPU layer benchmark, N-rank paths, {'/'.join(dtypes)}", GPU_MEMORY_GBPS)


def _source(path: str, raw: dict) -> dict:
    """Where a fit's input came from: its path (relative to the checkout when inside it) and its own record."""
    p = Path(path).resolve()
    try:
        shown = str(p.relative_to(Path(__file__).resolve().parents[2]))
    except ValueError:
        shown = str(path)
    return {"path": shown, **{k: raw[k] for k in SOURCE_KEYS if k in raw}}


def fit_files(cpu_path: Optional[str], gpu_paths: Mapping[str, str]) -> dict:
    """The fit file: ``{"default": name, "fits": {name: fit}}``, each fit naming its source: the CPU fixture's fit
    ``cpu`` and one fit per GPU input (``gpu_paths``: name -> path, in order)."""
    fits = {}
    for name, path, fit in [(CPU_FIT, cpu_path, fit_cpu)] + [(n, p, fit_gpu) for n, p in gpu_paths.items()]:
        if path:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
            fits[name] = {**fit(raw), "source": _source(path, raw)}
    default = DEFAULT_FIT if DEFAULT_FIT in fits else next(iter(fits))
    return {"default": default, "fits": fits}


def gpu_inputs(values: Sequence[str], default_name: str = GPU_FIT) -> Dict[str, str]:
    """``--gpu`` values, ``PATH`` (the fit ``default_name``) or ``NAME=PATH``, as name -> path; a name twice is
    refused."""
    out: Dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        name, path = (name, path) if sep else (default_name, value)
        if not name or not path or name in out or name == CPU_FIT:
            raise ValueError(f"--gpu {value!r}: give PATH or NAME=PATH, each name once and not {CPU_FIT!r}")
        out[name] = path
    return out


def measure_memory_gbps(mib: int = 512, reps: int = 9, device: str = "cpu") -> Dict[str, Any]:
    """The memory bandwidth of ``device`` as the layer call's memory-bound passes see it: ``torch.add(a, b, out=c)``
    on three fp32 tensors of ``mib`` MiB (far beyond any cache; on the CPU on one thread, as the benchmark runs),
    bytes read and written over the median time of ``reps`` (``torch.Tensor.copy_`` beside it as a check; on CUDA
    each timed between synchronisations)."""
    import torch
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = mib * 2 ** 20 // 4
        a, b, c = (torch.rand(n, device=dev), torch.rand(n, device=dev), torch.empty(n, device=dev))

        def median_s(fn) -> float:
            fn()
            times = []
            for _ in range(reps):
                sync()
                start = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        add_s, copy_s = median_s(lambda: torch.add(a, b, out=c)), median_s(lambda: c.copy_(a))
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu, one thread"
    finally:
        torch.set_num_threads(threads)
    return {"gbps": round(3 * 4 * n / add_s / 1e9, 2), "copy_gbps": round(2 * 4 * n / copy_s / 1e9, 2),
            "method": f"torch.add(a, b, out=c) on three fp32 tensors of {mib} MiB ({name}), median of {reps}: "
                      "3 x the tensor's bytes over the seconds (copy_: 2 x)",
            "device": str(dev), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def record_device(records: Sequence[dict]) -> str:
    """The device the records' cells ran on (``cpu`` where a cell does not say); several is refused: one fixture,
    one memory bandwidth."""
    devices = {cell.get("device", "cpu") for record in records for cell in record["cells"]}
    if len(devices) != 1:
        raise ValueError(f"the layer records ran on {sorted(devices)}: trim one device's records together")
    return devices.pop()


def merge_records(records: Sequence[dict]) -> dict:
    """One record of several layer benchmark records of the same commit (a GPU run takes one process per shape,
    so that a shape that does not fit in memory costs only its own cells): the first one's provenance, every
    record's cells, the commands in ``commands``."""
    if len(records) == 1:
        return records[0]
    commits = {r.get("commit") for r in records}
    if len(commits) != 1:
        raise ValueError(f"the layer records are of different commits {sorted(map(str, commits))}: rerun them")
    return {**records[0], "commands": [r.get("command") for r in records],
            "cells": [cell for r in records for cell in r["cells"]]}


def trim_record(record: dict, memory_bandwidth: Dict[str, Any]) -> dict:
    """The fixture of a layer benchmark record: its provenance, each cell's shape and the medians of the rows the
    fit reads, and the memory bandwidth of the device it ran on."""
    wanted = (PLAIN,) + tuple(FIT_SYSTEMS.values())
    cells = [{**{k: cell[k] for k in CELL_KEYS}, **{k: cell[k] for k in CELL_EXTRA_KEYS if k in cell},
              "systems": {s: {"median_s": r["median_s"]} for s, r in cell["systems"].items()
                          if s in wanted and r.get("status", "ok") == "ok" and r.get("median_s") is not None}}
             for cell in record["cells"]]
    present = {row for c in cells for row in c["systems"]}
    missing = [row for row in wanted if row not in present and row not in BASELINE_ROWS]
    if not present & set(BASELINE_ROWS):   # one of DeepSpeed's layers at least (a GPU run may time AutoEP alone)
        missing += list(BASELINE_ROWS)
    if missing:
        raise ValueError(f"the layer record has no {missing} rows: run python -m benchmarks.layer with --n-rank")
    keep = ("schema",) + SOURCE_KEYS + ("commands",)
    return {**{k: record[k] for k in keep if k in record}, "memory_bandwidth": memory_bandwidth, "cells": cells}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def markdown_tables(result: dict) -> str:
    """docs/simulator.md's tables of the default fit: per cell each system's measured overhead (fitted in
    brackets), the coefficients per system, and what each preset is charged."""
    from .overhead import fit_overheads
    from .presets import MEMORY_GBPS
    name = result["default"]
    fit = result["fits"][name]
    systems = list(fit["systems"])
    lines = ["| cell | row bytes | owned bytes | plain ms | " + " | ".join(f"{s} ms" for s in systems) + " |",
             "|---|---|---|---|" + "---|" * len(systems)]
    for p in fit["points"]:
        lines.append(f"| {p['shape']} {p['dtype']} | {p['row_bytes']:,.0f} | {p['owned_bytes']:,.0f} | "
                     f"{_ms(p['plain_s'])} | " + " | ".join(
                         f"{_ms(p['overhead_s'][s])} ({_ms(p['fitted_s'][s])})" if s in p.get("overhead_s", {})
                         else "-" for s in systems) + " |")
    lines += ["", "| system | fixed ms | ps per routed-row byte | ps per owned byte | rms residual ms | "
                  "overhead summed over the cells, ms |", "|---|---|---|---|---|---|"]
    for s in systems:
        c, r = fit["systems"][s], fit["residuals"][s]
        lines.append(f"| {s} | {c['fixed_s'] * 1e3:.3f} | {c['per_row_byte_s'] * 1e12:,.1f} | "
                     f"{c['per_owned_byte_s'] * 1e12:,.2f} | {_ms(r['rms_s'])} | {_ms(fit['total_overhead_s'][s])} |")
    lines += ["", "| preset | memory GB/s | family | fixed ms | ps per routed-row byte | ps per owned byte |",
              "|---|---|---|---|---|---|"]
    gbps = {**MEMORY_GBPS, "cpu-2": fit["device_memory_gbps"]}
    for preset, device in gbps.items():
        charged = fit_overheads(result, name, device).as_dict()
        for family in ("hecate", "baselines"):
            c = charged[family]
            lines.append(f"| `{preset}` | {device:,.1f} | {family} | {c['fixed_s'] * 1e3:.3f} | "
                         f"{c['per_row_byte_s'] * 1e12:,.2f} | {c['per_owned_byte_s'] * 1e12:,.3f} |")
    return "\n".join(lines)


def _print(result: dict) -> None:
    for name, fit in result["fits"].items():
        families = {**fit.get("systems", {}), "hecate": fit["hecate"], "baselines": fit["baselines"]}
        for family, c in families.items():
            res = fit["residuals"].get(family)
            print(f"{name:8s} {family:16s} fixed {c['fixed_s'] * 1e3:8.3f} ms  per row byte "
                  f"{c['per_row_byte_s'] * 1e12:9.3f} ps  per owned byte {c['per_owned_byte_s'] * 1e12:9.4f} ps"
                  + (f"  residuals over {res['points']} points: rms {res['rms_s'] * 1e3:.3f} ms, max "
                     f"{res['max_abs_s'] * 1e3:.3f} ms" if res else ""))
        print(f"{name:8s} baselines = {fit.get('baselines_from') or 'not measured (0)'}; memory "
              f"{fit['device_memory_gbps']:g} GB/s")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_hecate.sim.overhead_fit", description=__doc__.splitlines()[0])
    parser.add_argument("--trim", metavar="RECORD", nargs="+", help="layer benchmark records (one commit, one "
                        "device) to cut into a fixture")
    parser.add_argument("--fixture", help="with --trim: write the fixture here (tests/fixtures/call_overhead_cpu.json)")
    parser.add_argument("--memory-gbps", type=float, help="with --trim: the benchmark device's memory bandwidth, "
                                                          "when not measured here (GB/s)")
    parser.add_argument("--memory-mib", type=int, default=512, help="with --trim: MiB per tensor of the bandwidth "
                                                                     "measurement (default %(default)s)")
    parser.add_argument("--cpu", help="the CPU fixture (--trim's output)")
    parser.add_argument("--gpu", action="append", default=[], metavar="[NAME=]PATH",
                        help="a GPU check record with a layer_call stage, or a GPU layer fixture (make gpu-fit); "
                             f"repeat for several fits, each NAME=PATH (a bare PATH is the fit {GPU_FIT})")
    parser.add_argument("--json", help="write the fit here (the committed one: ds_hecate/sim/call_overhead_fit.json)")
    parser.add_argument("--tables", action="store_true", help="also print docs/simulator.md's tables of the fit")
    args = parser.parse_args(argv)
    if args.trim:
        if not args.fixture:
            parser.error("--trim needs --fixture")
        records = [json.loads(Path(path).read_text(encoding="utf-8")) for path in args.trim]
        try:
            device, record = record_device(records), merge_records(records)
        except ValueError as exc:
            parser.error(str(exc))
        bandwidth = (measure_memory_gbps(args.memory_mib, device=device) if args.memory_gbps is None else
                     {"gbps": args.memory_gbps, "method": "given (--memory-gbps)", "device": device})
        fixture = trim_record(record, bandwidth)
        Path(args.fixture).write_text(json.dumps(fixture, indent=1) + "\n", encoding="utf-8")
        print(f"{args.fixture}: {len(fixture['cells'])} cells on {device}, memory bandwidth {bandwidth['gbps']} GB/s")
        return 0
    if not args.cpu and not args.gpu:
        parser.error("give --trim RECORD --fixture PATH, or --cpu and/or --gpu")
    try:
        gpus = gpu_inputs(args.gpu)
    except ValueError as exc:
        parser.error(str(exc))
    result = fit_files(args.cpu, gpus)
    _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.tables:
        print(markdown_tables(json.loads(json.dumps(result))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
