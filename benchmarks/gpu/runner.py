"""``make gpu-check``: every stage of :data:`STAGES` in its own process (``python benchmarks/gpu_check.py --stage
SPEC``) with its own timeout, the JSON rewritten after each, a Markdown table at the end; exit status 0 only if every
stage passed. A stage that times out, crashes or reports a failure fails the check, never stopping the ones after
it; a skipped one (memcheck without the sanitizer) says why and does not. The timeouts sum at most
:data:`BUDGET_S`, a minute under the Makefile's limit. ``--dry-run`` runs every stage's code on the CPU under the
GPU stand-in (tests/fake_cupy.py) and writes the JSON and the Markdown as a real run does, marked as a dry run.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from benchmarks import common

ROOT = Path(__file__).resolve().parents[2]

#: The Makefile's limit on the whole check; the stages' timeouts leave a minute of it (start, wheelhouse, files).
MAKE_TIMEOUT_S = 540
BUDGET_S = MAKE_TIMEOUT_S - 60
#: A dry run's limit per stage: its figures are the CPU's (a CI machine may be slow); a hang still fails within it.
DRY_RUN_STAGE_TIMEOUT_S = 300
#: Statuses that do not fail the check.
OK_STATUSES = ("passed", "skipped")
MODULE = "benchmarks.gpu_check"


@dataclass(frozen=True)
class Stage:
    """One stage: ``spec`` is ``module[:function]`` (called with a :class:`~benchmarks.gpu.common.Context`) or
    ``pytest PATH...`` (:mod:`benchmarks.gpu.suite`); what each checks: docs/benchmarks.md."""

    name: str
    spec: str
    timeout_s: float


#: In order; cheap and basic first, so that a GPU call cut short still says the most. Sized for one 80 GB H100.
STAGES: Sequence[Stage] = (
    Stage("device", "benchmarks.gpu.device", 20),   # the machine, its HBM bandwidth and bf16 matmul rate
    Stage("tests", "pytest tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_comm.py tests/test_kernels.py", 60),
    Stage("streams", "pytest tests/gpu/test_gpu_streams.py", 20),
    Stage("training", "pytest tests/gpu/test_gpu_training.py", 50),   # on CUDA against the CPU, fp32 and bf16
    Stage("syncs", "pytest tests/gpu/test_gpu_syncs.py", 45),   # the layer call's host syncs, CUDA sync debug mode
    Stage("two_rank_training", "pytest tests/gpu/test_gpu_two_ranks.py", 60),   # the N-rank path on one GPU
    Stage("memcheck", "benchmarks.gpu.suite:memcheck", 40),   # compute-sanitizer on the kernel tests
    Stage("micro", "benchmarks.gpu.micro", 20),   # each kernel's GB/s against HBM and the torch op
    Stage("layer", "benchmarks.gpu.layer", 120),   # the layer benchmark in bf16 against its speed targets
)


def stage_main(args: argparse.Namespace) -> int:
    """``--stage SPEC --out FILE``: one stage in this process, its result (or the exception's) written to FILE."""
    from benchmarks.gpu import suite
    from benchmarks.gpu.common import Context
    prior = json.loads(Path(args.prior).read_text()) if args.prior and Path(args.prior).is_file() else {}
    ctx = Context(quick=args.quick, dry_run=args.dry_run, prior=prior, timeout_s=args.timeout)
    module, _, function = args.stage.partition(":")
    try:
        out = (suite.run(ctx, args.stage.split()[1:]) if args.stage.startswith("pytest ") else
               getattr(importlib.import_module(module), function or "run")(ctx))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a result the runner reports
        lines = traceback.format_exc().strip().splitlines()
        out = {"status": "failed", "summary": f"{type(exc).__name__}: {str(exc)[:200]}", "traceback": lines[-25:]}
        code = 1
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return code


def write_json(path: Path, report: dict) -> None:
    """Atomic rewrite (a kill mid-write leaves the previous version)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


def run_stage(stage: Stage, report_path: Path, quick: bool, dry_run: bool, env: Optional[Dict[str, str]] = None,
              python: str = sys.executable) -> dict:
    """Run one stage in a fresh process (its own session: a timeout kills its children too)."""
    from benchmarks.gpu.common import run_command
    limit = max(stage.timeout_s, DRY_RUN_STAGE_TIMEOUT_S) if dry_run else stage.timeout_s
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{stage.name}_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [python, str(ROOT / "benchmarks" / "gpu_check.py"), "--stage", stage.spec, "--out", str(out),
               "--prior", str(report_path), "--timeout", str(limit)]
        start = time.perf_counter()
        code, log = run_command(cmd + ["--quick"] * quick + ["--dry-run"] * dry_run, limit, env)
        base = {"seconds": round(time.perf_counter() - start, 1), "timeout_s": limit, "returncode": code}
        tail = (log or "").strip().splitlines()[-30:]
        if code is None:
            return {"status": "timeout", "summary": f"timed out after {limit:g} s (killed)", "log_tail": tail, **base}
        try:
            res = json.loads(out.read_text())
        except (OSError, ValueError):
            return {"status": "crashed", "summary": f"exit code {code}, no result", "log_tail": tail, **base}
    if code != 0 and res.get("status") in OK_STATUSES:   # a crash after the result was written (at exit, say)
        res.update(status="crashed", summary=f"exit code {code} after: {res.get('summary', '')}")
    if res.get("status") not in OK_STATUSES:
        res["log_tail"] = tail
    return {**res, **base}


def run_check(stages: Iterable[Stage], out: Path, markdown: Optional[Path], quick: bool = False,
              dry_run: bool = False, env: Optional[Dict[str, str]] = None, python: str = sys.executable,
              log: Callable[[str], None] = print) -> dict:
    """Run ``stages`` in order; the JSON at ``out`` is written first and after every stage."""
    stages = list(stages)
    report: Dict[str, Any] = {
        "dry_run": dry_run, "quick": quick, "budget_s": BUDGET_S, "stage_timeouts_s": sum(s.timeout_s for s in stages),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "stages": {}, "ok": None,
        **({"note": "dry run on the CPU under the GPU stand-in (tests/fake_cupy.py): no figure is a GPU measurement"}
           if dry_run else {})}
    write_json(out, report)
    start = time.perf_counter()
    for stage in stages:
        res = report["stages"][stage.name] = run_stage(stage, out, quick, dry_run, env, python)
        report["seconds"] = round(time.perf_counter() - start, 1)
        write_json(out, report)
        log(f"[gpu-check] {stage.name}: {res['status']} in {res['seconds']} s - {res.get('summary', '')}")
        if res["status"] not in OK_STATUSES:
            for line in (res.get("tail") or [])[-12:] + res.get("log_tail", [])[-12:]:
                log(f"    {line}")
    report["ok"] = all(r["status"] in OK_STATUSES for r in report["stages"].values())
    if markdown is not None:   # a file holding the check's block (docs/benchmarks.md) gets the block replaced
        report["markdown"], text = str(markdown), render_markdown(report, stages)
        if markdown.is_file() and common.markers(MODULE)[0] in markdown.read_text():
            common.replace_block(str(markdown), text.rstrip(), MODULE)
        else:
            markdown.write_text(text)
    write_json(out, report)
    return report


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def failure_lines(report: dict, stages: Sequence[Stage], width: int = 300) -> List[str]:
    """One line per stage that did not pass: its name, its status and why (its summary, else its log's last line)."""
    failed = [(s.name, r) for s in stages if (r := report["stages"].get(s.name)) and r["status"] not in OK_STATUSES]
    return [f"- **{name} {r['status']}**: " + textwrap.shorten(str(r.get("summary") or (r.get("log_tail") or [
        "no output"])[-1]), width, placeholder="...") for name, r in failed]


def render_markdown(report: dict, stages: Sequence[Stage]) -> str:
    """The table docs/benchmarks.md shows: a row per stage (status, seconds, timeout, key figures), then details."""
    device = report["stages"].get("device", {}).get("device_name", "unknown device")
    where = (f"dry run on the CPU (no GPU measurement; each stage given {DRY_RUN_STAGE_TIMEOUT_S} s, the timeouts "
             "below are a GPU's)" if report["dry_run"] else f"one {device}")
    runs = [(s, report["stages"].get(s.name, {"status": "not run", "seconds": ""})) for s in stages]
    rows = [[s.name, r["status"], r["seconds"], f"{s.timeout_s:g}", _cell(r.get("summary", ""))] for s, r in runs]
    rows.append(["**all**", f"**{'passed' if report['ok'] else 'FAILED'}**", report.get("seconds", ""),
                 f"{report['stage_timeouts_s']:g}", f"budget {report['budget_s']} s"])
    lines = [f"make gpu-check: {where}, {report['started']}{', --quick' if report['quick'] else ''}", ""]
    lines += common.table(["stage", "status", "seconds", "timeout s", "key figures"], rows)
    failed = failure_lines(report, stages)
    lines += [""] * bool(failed) + failed
    for table in (t for _, r in runs for t in r.get("tables", [])):
        lines += ["", f"{table['title']}:", ""] + common.table(table["header"], [[_cell(c) for c in row]
                                                                                for row in table["rows"]])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="make gpu-check: the one-command check of the GPU path")
    parser.add_argument("--out", default="runs/gpu_check.json", help="the JSON report, rewritten after every stage")
    parser.add_argument("--markdown", default=None, help="the Markdown table (default: --out with .md)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    parser.add_argument("--dry-run", action="store_true", help="every stage's code path on the CPU; no GPU needed")
    parser.add_argument("--stages", default=None, help="comma-separated subset of: "
                        + ", ".join(s.name for s in STAGES))
    parser.add_argument("--stage", help=argparse.SUPPRESS)     # internal: run one stage in this process
    parser.add_argument("--prior", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        return stage_main(args)
    names = args.stages.split(",") if args.stages else [s.name for s in STAGES]
    if set(names) - {s.name for s in STAGES}:
        parser.error(f"unknown stage(s) {sorted(set(names) - {s.name for s in STAGES})}")
    stages = [s for s in STAGES if s.name in names]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    markdown = Path(args.markdown) if args.markdown else out.with_suffix(".md")
    env = dict(os.environ, **({"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")} if args.dry_run else {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    report = run_check(stages, out, markdown, args.quick, args.dry_run, env)
    print("\n" + render_markdown(report, stages))
    print(f"gpu-check {'passed' if report['ok'] else 'FAILED'}{' (dry run)' if args.dry_run else ''} in "
          f"{report.get('seconds', 0)} s; JSON {out}, Markdown {markdown}")
    return 0 if report["ok"] else 1
