"""How fast is a training step with ds_hecate against the systems a user would pick instead?

    python -m benchmarks.step --trace examples/traces/demo_gpt_moe.jsonl --markdown docs/benchmarks.md
    python -m benchmarks.step --quick                       # 2 workloads, a small model, 2 timed steps
    python -m benchmarks.step --report-only runs/step.json  # the tables again, from a run record

The wrapper starts ``--ranks`` CPU processes through DeepSpeed's launcher (as ``deepspeed --num_gpus 2
benchmarks/step.py ...`` would). Every system (:mod:`benchmarks.step_systems`) trains the same model from the same
weights on the same tokens, its gate forced to route exactly the workload's token-expert pairs (W0-W7 of
:mod:`ds_hecate.sim.workloads`, or a trace replayed with ``--trace``), so all compute the same first loss. The
systems take turns step by step in a rotated order in the same processes; each baseline is compared with ds_hecate by
the paired ratio of their step times. The per-system detail and the simulator's prediction of the run
(:mod:`ds_hecate.sim.calibration`) are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.step_systems import ALL_SYSTEMS, BUILDERS, counterparts, route_sources  # noqa: E402
from ds_hecate.sim.workloads import WORKLOADS  # noqa: E402

QUICK = ["--steps", "2", "--warmup", "1", "--workloads", "W0,W1", "--tokens", "64", "--hidden", "32", "--ffn", "64"]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p.add_argument("--ranks", type=int, default=2, help="ranks the wrapper launches (CPU processes)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per workload")
    p.add_argument("--warmup", type=int, default=6, help="untimed steps per workload first (> hecate.load_window: "
                   "the prediction holds only the current workload)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=512, help="SwiGLU expert hidden size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="mean tokens per rank per step")
    p.add_argument("--top-k", type=int, default=2, choices=(1, 2))
    p.add_argument("--workloads", default="W0,W1,W2,W3,W4,W5,W6,W7", help="comma-separated (empty: traces only)")
    p.add_argument("--trace", action="append", default=[], help="a routing trace (JSONL) to replay; repeatable")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS), help="comma-separated, from " + ", ".join(BUILDERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="the suite's form: " + " ".join(QUICK))
    p.add_argument("--json", default=str(common.RUNS / "step.json"), help="the run record (default %(default)s)")
    p.add_argument("--markdown", help="replace this file's generated block by the table")
    p.add_argument("--report-only", metavar="RECORD", help="no run: the tables of this run record")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.quick:
        args = p.parse_args(QUICK + argv)
    args.argv = [a for a in argv if not a.startswith("--local_rank")]
    unknown = [s for s in args.systems.split(",") if s and s not in BUILDERS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {', '.join(BUILDERS)}")
    return args


def launch(argv: List[str], ranks: int) -> int:
    """This file on ``ranks`` CPU processes through DeepSpeed's launcher, by ``ds_hecate.tools.launch``."""
    from ds_hecate.tools.launch import run
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return run(["--num_gpus", str(ranks), str(ROOT / "benchmarks" / "step.py"), *argv], env=env, cwd=str(ROOT))


HECATE = "ds_hecate"


def _ok(w: dict) -> Dict[str, dict]:
    return {s: r for s, r in w["systems"].items() if r.get("status") == "ok"}


def _args(record: dict) -> argparse.Namespace:
    cfg = record["config"]
    return argparse.Namespace(**{**cfg, "workloads": cfg.get("workloads") or "", "trace": cfg.get("trace") or []})


def replayed_counts(record: dict) -> Dict[str, list]:
    """``counts[step][layer][rank][expert]`` of every workload of the run, as the run forced them."""
    args = _args(record)
    steps = args.warmup + args.steps
    return {name: [[routes.counts(s, layer) for layer in range(args.layers)] for s in range(steps)]
            for name, _, routes in route_sources(args, record["world_size"]) if name in record["workloads"]}


def force_balanced(record: dict) -> Dict[Tuple[str, str], float]:
    """Per (workload, system): the system's median step on the workload's forced-uniform counterpart (same tokens
    per rank, ``force_uniform``) over its median step on the workload (UltraEP's metric; 1.00: the routing's skew
    costs nothing). The counterpart ran in another part of the run: the fraction carries the drift between."""
    args = _args(record)
    sources = {n: r for n, _, r in route_sources(args, record["world_size"]) if n in record["workloads"]}
    ok = {w: _ok(record["workloads"][w]) for w in sources}
    return {(w, s): ok[ref][s]["median_step_s"] / r["median_step_s"]
            for w, ref in counterparts(sources, args.warmup + args.steps, args.layers).items() if ref is not None
            for s, r in ok[w].items() if s in ok[ref]}


def markdown(record: dict, calibrated: str = "") -> str:
    """One row per workload: ds_hecate's median step, each baseline's paired ratio over it (above 1: ds_hecate
    faster; a verdict needs the interval to exclude 1), ds_hecate's fractions of the ideal and of its
    force-balanced step; then ``calibrated`` (the simulator's prediction of the run, in a sentence)."""
    cfg, fb = record["config"], force_balanced(record)
    baselines = [s for s in record["systems"] if s not in (HECATE, "ideal") and record["systems"][s]["status"] == "ok"]
    rows = []
    for wname, w in record["workloads"].items():
        ok = _ok(w)
        if HECATE not in ok:
            continue
        hec = ok[HECATE]
        ratios = [common.ratio_text(common.paired_ratio(ok[s]["step_s"], hec["step_s"])) if s in ok else "skipped"
                  for s in baselines]
        frac = hec.get("fraction_of_ideal")
        label = f"{wname} {w['title']}" if wname in WORKLOADS else wname   # the named workloads' titles
        rows.append([label, f"{1e3 * hec['median_step_s']:.1f}"] + ratios
                    + [f"{frac:.2f}" if frac else "", f"{fb[(wname, HECATE)]:.2f}" if (wname, HECATE) in fb else ""])
    skipped = [f"- **{s}** skipped: {v.get('reason')}" for s, v in record["systems"].items() if v["status"] != "ok"]
    lines = common.header_lines(record) + [
        f"{record['world_size']} CPU ranks over gloo. Model: "
        f"{cfg['layers']} blocks of (Linear {cfg['hidden']}x{cfg['hidden']} + tanh, top-{cfg['top_k']} MoE of "
        f"{cfg['experts']} SwiGLU {cfg['hidden']}x{cfg['ffn']} experts), {cfg['tokens']} tokens per rank per step, "
        f"fp32, ZeRO-2, AdamW; {cfg['warmup']} warm-up and {cfg['steps']} timed steps per workload. Baseline "
        "columns: the median over steps of the baseline's step time over ds_hecate's in the same step, with a 95% "
        "bootstrap interval; above 1 ds_hecate is faster.", ""]
    lines += common.table(["workload", "ds_hecate ms"] + baselines + ["ds_hecate of ideal",
                                                                      "ds_hecate of force-balanced"], rows)
    return "\n".join(lines + ([""] + skipped if skipped else []) + (["", calibrated] if calibrated else []))


def detail(record: dict) -> str:
    """Every system's figures per workload (printed after a run; the record holds them all)."""
    fb = force_balanced(record)
    header = ["workload", "system", "median step ms", "of ideal", "of force-balanced", "compute max/mean",
              "expert rows/rank (max)", "MB sent/step/rank (max)", "fwd / bwd / opt ms"]
    return "\n".join(common.table(header, [
        [w, s, f"{1e3 * r['median_step_s']:.1f}", f"{r.get('fraction_of_ideal') or 0:.2f}",
         f"{fb[(w, s)]:.2f}" if (w, s) in fb else "", f"{r['load_max_over_mean']:.2f}",
         f"{max(r['expert_rows_per_rank']):.0f}", f"{r['bytes_sent_per_step_max'] / 1e6:.2f}",
         " / ".join(f"{1e3 * max(p[k] for p in r['phases_s']):.0f}" for k in ("forward", "backward", "optimizer"))]
        for w, workload in record["workloads"].items() for s, r in _ok(workload).items()]))


def calibration(record: dict) -> Tuple[str, str]:
    """The simulator's prediction of every workload of the run (:func:`ds_hecate.sim.calibration.calibrate`): its
    table and its sentence."""
    from ds_hecate.sim.calibration import CalibrationError, calibrate, format_markdown, summary_line
    try:
        cal = calibrate(record, replayed_counts(record), measured_fb=force_balanced(record))
    except CalibrationError as exc:
        return "", f"Simulator calibration not computed for this run: {exc}"
    return format_markdown(cal), summary_line(cal)


def report(record: dict, json_path: Optional[str], markdown_path: Optional[str], new_run: bool) -> int:
    cal_table, cal_line = calibration(record)
    print(detail(record), "", cal_table, "", sep="\n")
    return common.publish("benchmarks.step", record, markdown(record, cal_line), json_path, markdown_path, new_run)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        return report(json.loads(Path(args.report_only).read_text()), None, args.markdown, False)
    if "RANK" not in os.environ and "LOCAL_RANK" not in os.environ:
        return launch(args.argv, args.ranks)
    from benchmarks.step_measure import run
    record = run(args)
    return report(record, args.json, args.markdown, True) if record is not None else 0


if __name__ == "__main__":
    sys.exit(main())
