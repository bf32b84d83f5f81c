"""Stage ``layer_versus``: the side-by-side benchmark (``benchmarks/layer_versus.py``) on the GPU. The plain
grouped-GEMM layer written from torch ops (the floor) and ``ds_hecate`` (``ds_hecate.MoE`` on a 1-rank Hecate
runtime) on the Qwen3-30B-A3B-like and the DeepSeek-V3-like layer (:data:`benchmarks.layer_call.SHAPES`), bf16,
forward + backward, interleaved rounds, the paired ratio against the plain layer with its 95% bootstrap interval.
One ``python -m benchmarks.layer_versus`` subprocess per shape, with what is left of the stage's time, so a shape
running past it leaves the other's figures.

Its time goes to building the layers on the host: the benchmark draws each shape's weights on the CPU from one seed
(the DeepSeek-V3-like layer's are 1.4e9 numbers), once per process (``benchmarks.systems.canonical_weights`` keeps
them for every system), so only the two systems the target needs are built, and the subprocess gets every core of
the machine for it (``OMP_NUM_THREADS``; the check's own processes run with one thread).

Targets (issue 41): ``ds_hecate`` at most :data:`TARGETS` times the plain layer (median paired ratio): 1.25x on
the Qwen3-like shape, 1.10x on the DeepSeek-like one.

**Status and targets, by choice**: the stage *passes* when every shape ran and ``ds_hecate`` and the plain layer
both produced timings that agree with each other (output and input gradient within the benchmark's
``AGREEMENT_TOL`` for the dtype); a missed speed target does not fail it. The targets are reported as figures,
``targets_met`` (all shapes) and per shape ``target``, ``ratio``, ``met``, and a miss leads the summary in capitals
(``TARGET MISSED``), so the table says it at once. Reason: the check's pass/fail is about whether the GPU path
works and is right; a speed target is a measurement to read (and to act on), which a shared machine's noise or a
cold clock can move, and a red check for it would hide the stages that say whether anything is broken.

Dry run: the same benchmark on the CPU, fp32, its tiny ``quick`` shape (held against the Qwen3-like target, so
the target code path runs; the figure is no measurement), 3 rounds.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .common import Context, result, run_command

#: shape -> the largest median ratio of ds_hecate's layer call over the plain layer's (issue 41, acceptance 6)
TARGETS: Dict[str, float] = {"qwen3-30b-a3b": 1.25, "deepseek-v3": 1.10}
CHECKED = "ds_hecate"
SYSTEMS = ("plain", CHECKED)


def shapes(ctx: Context) -> List[Tuple[str, float]]:
    """(shape, target) pairs of this run."""
    return [("quick", TARGETS["qwen3-30b-a3b"])] if ctx.dry_run else list(TARGETS.items())


def command(ctx: Context, shape: str, out: Path) -> List[str]:
    if ctx.dry_run:
        device, dtype, reps, warmup = "cpu", "fp32", 3, 1
    else:
        device, dtype, reps, warmup = "cuda", "bf16", (10 if ctx.quick else 20), 3
    return [sys.executable, "-m", "benchmarks.layer_versus", "--device", device, "--dtype", dtype, "--shape", shape,
            "--reps", str(reps), "--warmup", str(warmup), "--systems", ",".join(SYSTEMS), "--json", str(out)]


def environment(ctx: Context) -> Dict[str, str]:
    """The benchmark's environment: on a GPU every core for building the layers on the host."""
    env = dict(os.environ)
    if not ctx.dry_run:
        env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    return env


def measure(ctx: Context) -> Tuple[List[dict], List[str]]:
    """The benchmark's cells (one subprocess per shape) and the failures."""
    cells, failures = [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_versus_") as tmp:
        for shape, _ in shapes(ctx):
            out = Path(tmp) / f"{shape}.json"
            limit = ctx.left_s()
            code, text = run_command(command(ctx, shape, out), limit, environment(ctx))
            tail = [line for line in text.strip().splitlines() if line.strip()]
            if code is None:
                failures.append(f"{shape}: ran past {limit:.0f} s (killed)")
            elif code != 0 or not out.is_file():
                failures.append(f"{shape}: exit {code}: {tail[-1] if tail else ''}")
            else:
                cells += json.loads(out.read_text()).get("cells", [])
    return cells, failures


def judge(cell: dict, target: float) -> dict:
    """One shape's figures: the checked system's ratio against its target, every system's time, ratio, agreement;
    ``error`` when the cell cannot be judged (a system did not run, or computes something else)."""
    from benchmarks.layer_versus import AGREEMENT_TOL
    systems = cell.get("systems", {})
    tol = AGREEMENT_TOL.get(str(cell.get("dtype")), 1e-4)
    figures: dict = {"shape": cell.get("shape"), "dtype": cell.get("dtype"), "target": target, "systems": {}}
    errors = []
    for name, rec in systems.items():
        if rec.get("status") != "ok":
            figures["systems"][name] = {"status": rec.get("status"), "reason": rec.get("reason")}
            if name in ("plain", CHECKED):
                errors.append(f"{name} not run: {str(rec.get('reason'))[:160]}")
            continue
        agree = max(rec["agreement"].values())
        figures["systems"][name] = {"median_ms": 1e3 * rec["median_s"], "ratio": rec["ratio_vs_plain"],
                                    "agreement": agree, "ops": rec["ops"]["top"]}
        if agree > tol:
            errors.append(f"{name} differs from the plain layer by {agree:.1e} (tol {tol:g})")
    checked = figures["systems"].get(CHECKED, {})
    if "ratio" in checked:
        figures["ratio"] = checked["ratio"][0]
        figures["met"] = figures["ratio"] <= target
    elif not errors:
        errors.append(f"no {CHECKED} figures")
    if errors:
        figures["error"] = "; ".join(errors)
    return figures


def table(judged: List[dict]) -> dict:
    rows = []
    for j in judged:
        for name, s in j["systems"].items():
            if "ratio" not in s:
                rows.append([j["shape"], j["dtype"], name, "not run", "", "", "", ""])
                continue
            m, lo, hi = s["ratio"]
            target = (f"<= {j['target']:.2f}: {'met' if m <= j['target'] else 'MISSED'}" if name == CHECKED
                      else "")
            rows.append([j["shape"], j["dtype"], name, f"{s['median_ms']:.2f}", f"{m:.3f} [{lo:.3f}, {hi:.3f}]",
                         target, str(s["ops"]), f"{s['agreement']:.1e}"])
    return {"title": "Layer call side by side (benchmarks/layer_versus.py): median ms, paired ratio vs plain",
            "header": ["shape", "dtype", "system", "fwd+bwd ms", "vs plain [95% CI]", "target", "ops",
                       "differs from plain"], "rows": rows}


def _summary(judged: List[dict], failures: List[str], targets_met: Optional[bool], dry_run: bool) -> str:
    parts = []
    for j in judged:
        if "ratio" in j:
            parts.append(f"{j['shape']}: {CHECKED} {j['ratio']:.2f}x plain (target {j['target']:.2f}x "
                         f"{'met' if j['met'] else 'MISSED'})")
        if "error" in j:
            parts.append(f"{j['shape']}: {j['error']}")
    head = ""
    if targets_met is False:
        head = "target missed (dry run on the CPU: no GPU measurement); " if dry_run else "TARGET MISSED; "
    return head + ("; ".join(parts + failures) or "no measurement")


def run(ctx: Context) -> dict:
    cells, failures = measure(ctx)
    by_shape = {c.get("shape"): c for c in cells}
    judged = []
    for shape, target in shapes(ctx):
        if shape in by_shape:
            judged.append(judge(by_shape[shape], target))
        elif not any(f.startswith(f"{shape}:") for f in failures):
            failures.append(f"{shape}: no cell in the benchmark's JSON")
    ratios = [j for j in judged if "ratio" in j]
    complete = len(ratios) == len(shapes(ctx))
    targets_met = all(j["met"] for j in ratios) if complete else None
    ok = complete and not failures and not any("error" in j for j in judged)
    return result(ok, _summary(judged, failures, targets_met, ctx.dry_run), targets_met=targets_met,
                  targets={s: t for s, t in shapes(ctx)}, checked_system=CHECKED, shapes=judged,
                  failures=failures, tables=[table(judged)])
