"""Stage ``layer_call``: one layer call of ds_hecate.MoE (SwiGLU experts) forward + backward on 1 rank, bf16, for a
Qwen3-30B-A3B-like and a DeepSeek-V3-like layer (the latter with 32 of its 256 experts, as one of 8 EP ranks
holds), the expert compute as grouped GEMM and as the per-expert loop (``DS_HECATE_GROUPED_MM=0``), with the
phase breakdown, the profiler's op count and the experts' TFLOP/s against the GPU's dense bf16 peak.

The measurement itself is ``benchmarks/layer_call.py`` (``python -m benchmarks.layer_call --shape NAME
--device cuda --dtype bf16 --repeat N --json OUT``), run here once per shape as a subprocess with what is left of
the stage's time; this stage adds the peak comparison and the table. The peak is the one the ``device`` stage
measured on this GPU (a large bf16 matmul) and the named constant measured on this workplace's H200s
(:data:`H200_BF16_TFLOPS_MEASURED_HERE`).
Dry run: the same call on the CPU, fp32, the small ``swiglu-8`` shape, one repeat.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable, List, Tuple

from .common import H200_BF16_TFLOPS_MEASURED_HERE, ROOT, Context, result, run_command

#: the module that measures (the stage's tests substitute a stand-in)
MODULE_ENV = "DS_HECATE_LAYER_CALL_MODULE"
SHAPES = ("qwen3-30b-a3b", "deepseek-v3")
MODES = ("grouped", "loop")
KEYS = ("fwd_bwd_s", "expert_compute_s", "expert_tflops", "phases", "ops")


def shapes(ctx: Context) -> Tuple[str, ...]:
    return ("swiglu-8",) if ctx.dry_run else SHAPES


def command(ctx: Context, shape: str, out: Path) -> List[str]:
    module = os.environ.get(MODULE_ENV, "benchmarks.layer_call")
    device, dtype, repeat = ("cpu", "fp32", 1) if ctx.dry_run else ("cuda", "bf16", 3 if ctx.quick else 5)
    return [sys.executable, "-m", module, "--shape", shape, "--device", device, "--dtype", dtype, "--repeat",
            str(repeat), "--json", str(out)]


def measure(ctx: Context) -> Tuple[List[dict], List[str]]:
    """The records of every shape (one subprocess per shape, so that a shape running past the stage's limit
    leaves the others' figures) and the failures."""
    recs, failures = [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_layer_") as tmp:
        for shape in shapes(ctx):
            out = Path(tmp) / f"{shape}.json"
            limit = ctx.left_s()
            code, text = run_command(command(ctx, shape, out), limit)
            tail = text.strip().splitlines()
            if code is None:
                failures.append(f"{shape}: ran past {limit:.0f} s (killed)")
            elif code != 0 or not out.is_file():
                failures.append(f"{shape}: exit {code}: {tail[-1] if tail else ''}")
            else:
                recs += records(json.loads(out.read_text()))
    return recs, failures


def records(data) -> List[dict]:
    """The measurements as one record per (shape, mode), from a list of records (top level or under "results")
    or a nesting ``{shape: {mode: figures}}`` (top level, or under "results" / "shapes")."""
    if isinstance(data, dict):
        for key in ("results", "shapes", "rows"):
            if key in data:
                return records(data[key])
        out = []
        for shape, modes in data.items():
            if isinstance(modes, dict):
                out += [{"shape": shape, "mode": mode, **figs} for mode, figs in modes.items()
                        if mode in MODES and isinstance(figs, dict)]
        return out
    if isinstance(data, list):
        return [r for r in data if isinstance(r, dict) and "shape" in r and "mode" in r]
    return []


def _ms(value) -> str:
    return "" if not isinstance(value, (int, float)) else f"{1e3 * value:.2f}"


def _ops(ops) -> str:
    """The profiler's op count: ``{"top": dispatched, "nested": all}`` or a plain number."""
    if isinstance(ops, dict):
        return f"{ops.get('top', '')} ({ops.get('nested', '')} nested)"
    return "" if ops is None else str(ops)


def table(recs: Iterable[dict], peak: float) -> dict:
    rows = []
    for r in recs:
        phases = r.get("phases") or {}
        rows.append([r["shape"], r["mode"], _ms(r.get("fwd_bwd_s")), _ms(r.get("expert_compute_s")),
                     f"{r['expert_tflops']:.1f}" if isinstance(r.get("expert_tflops"), (int, float)) else "",
                     f"{100 * r['expert_tflops'] / peak:.0f}" if isinstance(r.get("expert_tflops"), (int, float))
                     else "", _ops(r.get("ops")),
                     ", ".join(f"{k} {_ms(v)}" for k, v in phases.items())])
    return {"title": f"Layer call, 1 rank (forward + backward; peak {peak:.0f} TFLOP/s dense bf16)",
            "header": ["shape", "experts as", "fwd+bwd ms", "expert compute ms", "expert TFLOP/s", "% of peak",
                       "ops", "phases (ms)"], "rows": rows}


def run(ctx: Context) -> dict:
    measured = None if ctx.dry_run else ctx.prior_figure("device", "bf16_matmul_tflops")
    peak = measured or H200_BF16_TFLOPS_MEASURED_HERE
    module = os.environ.get(MODULE_ENV, "benchmarks.layer_call")
    if module == "benchmarks.layer_call" and not (ROOT / "benchmarks" / "layer_call.py").is_file():
        return result(False, "benchmarks/layer_call.py is not there: nothing measures the layer call")
    recs, failures = measure(ctx)
    for r in recs:
        if isinstance(r.get("expert_tflops"), (int, float)):
            r["pct_of_peak_measured"] = 100 * r["expert_tflops"] / measured if measured else None
            r["pct_of_peak_named"] = 100 * r["expert_tflops"] / H200_BF16_TFLOPS_MEASURED_HERE
    want = {(s, m) for s in shapes(ctx) for m in MODES}
    missing = sorted(want - {(r["shape"], r["mode"]) for r in recs})
    incomplete = sorted({(r["shape"], r["mode"]) for r in recs if any(k not in r for k in KEYS)})
    parts = []
    for shape in shapes(ctx):
        by = {r["mode"]: r for r in recs if r["shape"] == shape}
        g, lp = by.get("grouped", {}), by.get("loop", {})
        if isinstance(g.get("fwd_bwd_s"), (int, float)) and isinstance(lp.get("fwd_bwd_s"), (int, float)):
            tflops = g.get("expert_tflops") or 0.0
            parts.append(f"{shape}: fwd+bwd {_ms(g['fwd_bwd_s'])} ms grouped vs {_ms(lp['fwd_bwd_s'])} ms loop, "
                         f"experts {tflops:.1f} TFLOP/s ({100 * tflops / peak:.0f}% of peak)")
    ok = not missing and not incomplete and not failures
    summary = "; ".join(parts + failures) or "no measurement"
    if missing or incomplete:
        summary += f"; missing {missing or ''} incomplete {incomplete or ''}"
    return result(ok, summary, module=module, records=recs, failures=failures, peak_tflops=peak,
                  peak_tflops_measured=measured, peak_tflops_named=H200_BF16_TFLOPS_MEASURED_HERE,
                  tables=[table(recs, peak)])
