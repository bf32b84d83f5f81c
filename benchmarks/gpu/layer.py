"""Stage ``layer``: ``python -m benchmarks.layer`` on the GPU in bf16, the plain grouped-GEMM layer against ds_hecate
on the Qwen3-30B-A3B-like and the DeepSeek-V3-like layer, ds_hecate's paired ratio against its target
(:data:`TARGETS`), one subprocess per shape with every core (the weights are drawn on the host). It passes when
every shape ran and the two systems agree; a missed speed target leads its summary (``TARGET MISSED``) but does not
fail it: the check says whether the GPU path works and is right. Dry run: the CPU, fp32, the ``quick`` shape.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .common import Context, result, run_command

#: shape -> the largest paired ratio of ds_hecate's call over the plain layer's
TARGETS: Dict[str, float] = {"qwen3-30b-a3b": 1.25, "deepseek-v3": 1.10}
CHECKED = "ds_hecate"


def shapes(ctx: Context) -> List[Tuple[str, float]]:
    return [("quick", TARGETS["qwen3-30b-a3b"])] if ctx.dry_run else list(TARGETS.items())


def command(ctx: Context, shape: str, out: Path) -> List[str]:
    device, dtype, reps = ("cpu", "fp32", 3) if ctx.dry_run else ("cuda", "bf16", 10 if ctx.quick else 20)
    return [sys.executable, "-m", "benchmarks.layer", "--device", device, "--dtype", dtype, "--shape", shape,
            "--reps", str(reps), "--warmup", "1" if ctx.dry_run else "3", "--systems", "plain," + CHECKED,
            "--json", str(out)]


def judge(cell: dict, target: float) -> dict:
    """One shape's figures, the checked system's ratio against its target; ``error`` when a system did not run or
    computes another function."""
    from benchmarks.layer import AGREEMENT_TOL
    tol = AGREEMENT_TOL.get(str(cell.get("dtype")), 1e-4)
    out: dict = {"shape": cell.get("shape"), "dtype": cell.get("dtype"), "target": target, "systems": {}}
    errors = []
    for name, rec in cell.get("systems", {}).items():
        if rec.get("status") != "ok":
            out["systems"][name] = {"status": rec.get("status"), "reason": rec.get("reason")}
            errors.append(f"{name} not run: {str(rec.get('reason'))[:160]}")
            continue
        agree = max(rec["agreement"].values())
        out["systems"][name] = {"median_ms": 1e3 * rec["median_s"], "ratio": rec["ratio_vs_plain"],
                                "agreement": agree, "ops": rec["ops"]["top"]}
        if agree > tol:
            errors.append(f"{name} differs from the plain layer by {agree:.1e} (tol {tol:g})")
    if "ratio" in out["systems"].get(CHECKED, {}):
        out.update(ratio=out["systems"][CHECKED]["ratio"][0], met=out["systems"][CHECKED]["ratio"][0] <= target)
    elif not errors:
        errors.append(f"no {CHECKED} figures")
    return {**out, "error": "; ".join(errors)} if errors else out


def measure(ctx: Context) -> Tuple[List[dict], List[str]]:
    """The benchmark's cells (one subprocess per shape) and the failures."""
    env = dict(os.environ, **({} if ctx.dry_run else {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}))
    cells, failures = [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_layer_") as tmp:
        for shape, _ in shapes(ctx):
            out, limit = Path(tmp) / f"{shape}.json", ctx.left_s()
            code, text = run_command(command(ctx, shape, out), limit, env)
            last = ([line for line in text.strip().splitlines() if line.strip()] or [""])[-1]
            if code is None or code != 0 or not out.is_file():
                failures.append(f"{shape}: " + (f"ran past {limit:.0f} s (killed)" if code is None else
                                                f"exit {code}: {last}"))
            else:
                cells += json.loads(out.read_text()).get("cells", [])
    return cells, failures


def run(ctx: Context) -> dict:
    cells, failures = measure(ctx)
    by_shape = {c.get("shape"): c for c in cells}
    judged = [judge(by_shape[s], t) for s, t in shapes(ctx) if s in by_shape]
    failures += [f"{s}: no cell in the benchmark's record" for s, _ in shapes(ctx)
                 if s not in by_shape and not any(f.startswith(f"{s}:") for f in failures)]
    complete = sum("ratio" in j for j in judged) == len(shapes(ctx))
    targets_met: Optional[bool] = all(j["met"] for j in judged if "ratio" in j) if complete else None
    parts = [f"{j['shape']}: {CHECKED} {j['ratio']:.2f}x plain (target {j['target']:.2f}x "
             f"{'met' if j['met'] else 'MISSED'})" for j in judged if "ratio" in j]
    parts += [f"{j['shape']}: {j['error']}" for j in judged if "error" in j] + failures
    head = ("" if targets_met is not False else
            "target missed (dry run on the CPU: no GPU measurement); " if ctx.dry_run else "TARGET MISSED; ")
    rows = [[j["shape"], j["dtype"], name, f"{s['median_ms']:.2f}" if "ratio" in s else "not run",
             "{:.3f} [{:.3f}, {:.3f}]".format(*s["ratio"]) if "ratio" in s else "",
             (f"<= {j['target']:.2f}: {'met' if s['ratio'][0] <= j['target'] else 'MISSED'}"
              if name == CHECKED and "ratio" in s else ""), str(s.get("ops", ""))]
            for j in judged for name, s in j["systems"].items()]
    table = {"title": "Layer call (python -m benchmarks.layer): median ms, paired ratio to the plain layer",
             "header": ["shape", "dtype", "system", "fwd+bwd ms", "vs plain [95% CI]", "target", "ops"],
             "rows": rows}
    ok = complete and not failures and not any("error" in j for j in judged)
    return result(ok, head + ("; ".join(parts) or "no measurement"), targets_met=targets_met, shapes=judged,
                  failures=failures, tables=[table])
