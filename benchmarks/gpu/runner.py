"""The GPU check's runner: every stage in its own process with its own timeout, the JSON rewritten after each, a
Markdown table at the end.

A stage that times out, crashes (no result, or a non-zero exit) or reports a failure fails the check; ``skipped``
(e.g. the 2-process NCCL stage on one GPU) says why and does not; a failed stage never stops the ones after it.
The stages' timeouts sum at most :data:`BUDGET_S`, a minute under the Makefile's limit; ``--quick`` shrinks their
sizes. The Markdown names each failed stage and why in one line under its table. ``--dry-run`` runs every stage's
code on the CPU under the GPU stand-in (tests/fake_cupy.py: the CUDA stand-in of tests/device_shim.py, a CuPy whose
kernels check their launches and compute their contracts, NCCL as a loopback or over gloo) and writes the JSON and
the Markdown as a real run does, marked as a dry run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]

#: The Makefile's outer limit on the whole check (its ``timeout``); the stages' own timeouts sum at most
#: :data:`BUDGET_S`, a minute under it (the interpreter's start, the wheelhouse check, writing the files).
MAKE_TIMEOUT_S = 540
BUDGET_S = MAKE_TIMEOUT_S - 60
#: A dry run's limit per stage: its figures are the CPU's, not a budget's (a shared CI machine may be slow), and a
#: hang still fails within it.
DRY_RUN_STAGE_TIMEOUT_S = 300
#: Statuses that do not fail the check.
OK_STATUSES = ("passed", "skipped")


@dataclass(frozen=True)
class Stage:
    """One stage: ``spec`` is ``module[:function]`` (see :mod:`benchmarks.gpu.stage`)."""

    name: str
    spec: str
    timeout_s: float
    what: str


#: In order; cheap and basic first, so that a GPU call cut short still says the most. Sized for one 80 GB H100.
STAGES: Sequence[Stage] = (
    Stage("device", "benchmarks.gpu.device", 20,
          "GPU, torch, CuPy; HBM bandwidth nominal and measured (copy); bf16 matmul TFLOP/s"),
    Stage("tests", "benchmarks.gpu.suite", 60, "pytest tests/gpu tests/test_kernels.py"),
    Stage("syncs", "benchmarks.gpu.syncs", 30,
          "host syncs of the layer call on CUDA (sync debug mode): fp32, bf16, biased experts; shortcuts on/off"),
    Stage("training", "benchmarks.gpu.training", 25,
          "20 fp32 steps on CUDA (torch and CuPy transports, kernels and torch ops) against the CPU"),
    Stage("training_bf16", "benchmarks.gpu.training:run_bf16", 25,
          "20 bf16 steps: the resident refresh through the pack kernel; kernel runs against torch ops on CUDA"),
    Stage("nccl_round_trips", "benchmarks.gpu.nccl:round_trips", 15,
          "1-rank NCCL: every primitive and every Hecate collective, torch.distributed and CuPy"),
    Stage("nccl_two_process", "benchmarks.gpu.nccl:two_process", 20,
          "2 processes, one GPU each: SparseAllGather over NCCL through CuPy (needs 2 GPUs)"),
    Stage("two_rank_training", "benchmarks.gpu.two_rank_training", 45,
          "2 processes, 2 ranks on one GPU over gloo with CUDA tensors, the N-rank layer path: 20 fp32 steps "
          "against the 2-rank CPU run"),
    Stage("streams", "benchmarks.gpu.streams", 15,
          "stream ordering and its ablation; stream-side waits; the timeout watchdog"),
    Stage("memcheck", "benchmarks.gpu.memcheck", 40,
          "compute-sanitizer memcheck of the kernel tests (PYTORCH_NO_CUDA_MEMORY_CACHING=1)"),
    Stage("micro", "benchmarks.gpu.micro", 20, "kernel micro-benchmarks: GB/s against HBM and the torch ops"),
    Stage("layer_call", "benchmarks.gpu.layer", 75,
          "one layer call fwd+bwd, Qwen3-30B-A3B-like and DeepSeek-V3-like, bf16: grouped GEMM vs loop"),
    Stage("layer_versus", "benchmarks.gpu.versus", 90,
          "side by side, bf16: plain grouped-GEMM layer vs ds_hecate, Qwen3-like (<= 1.25x) and DeepSeek-V3-like "
          "(<= 1.10x)"),
)


def write_json(path: Path, report: dict) -> None:
    """Atomic rewrite (a kill mid-write leaves the previous version)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


def _tail(text: str, lines: int = 30) -> List[str]:
    return (text or "").strip().splitlines()[-lines:]


def run_stage(stage: Stage, report_path: Path, quick: bool, dry_run: bool, env: Optional[Dict[str, str]] = None,
              python: str = sys.executable) -> dict:
    """Run one stage in a fresh process (its own session: a timeout kills its children too)."""
    limit = max(stage.timeout_s, DRY_RUN_STAGE_TIMEOUT_S) if dry_run else stage.timeout_s
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{stage.name}_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [python, "-m", "benchmarks.gpu.stage", stage.spec, "--out", str(out), "--prior", str(report_path),
               "--timeout", str(limit)]
        cmd += (["--quick"] if quick else []) + (["--dry-run"] if dry_run else [])
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            timed_out = True
        seconds = round(time.perf_counter() - start, 1)
        base = {"seconds": seconds, "timeout_s": limit, "returncode": proc.returncode}
        if timed_out:
            return {"status": "timeout", "summary": f"timed out after {limit:g} s (killed)",
                    "log_tail": _tail(log), **base}
        try:
            res = json.loads(out.read_text())
        except (OSError, ValueError):
            return {"status": "crashed", "summary": f"exit code {proc.returncode}, no result", "log_tail": _tail(log),
                    **base}
    if proc.returncode != 0:
        # a crash after the result was written (e.g. at interpreter exit) is still a crash
        res.setdefault("summary", "")
        if res.get("status") in OK_STATUSES:
            res["status"] = "crashed"
            res["summary"] = f"exit code {proc.returncode} after: {res['summary']}"
    if res.get("status") not in OK_STATUSES or proc.returncode != 0:
        res["log_tail"] = _tail(log)
    return {**res, **base}


def run_check(stages: Iterable[Stage], out: Path, markdown: Optional[Path], quick: bool = False,
              dry_run: bool = False, env: Optional[Dict[str, str]] = None, python: str = sys.executable,
              log: Callable[[str], None] = print) -> dict:
    """Run ``stages`` in order; the JSON at ``out`` is written first and after every stage."""
    stages = list(stages)
    report: Dict[str, Any] = {"dry_run": dry_run, "quick": quick, "budget_s": BUDGET_S,
              "stage_timeouts_s": sum(s.timeout_s for s in stages),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "stages": {}, "ok": None}
    if dry_run:
        report["note"] = ("dry run on the CPU under the GPU stand-in (tests/fake_cupy.py: the CUDA stand-in of "
                          "tests/device_shim.py, CuPy and NCCL stand-ins); no figure is a GPU measurement")
    write_json(out, report)
    start = time.perf_counter()
    for stage in stages:
        res = run_stage(stage, out, quick, dry_run, env, python)
        report["stages"][stage.name] = res
        report["seconds"] = round(time.perf_counter() - start, 1)
        write_json(out, report)
        log(f"[gpu-check] {stage.name}: {res['status']} in {res['seconds']} s - {res.get('summary', '')}")
        if res["status"] not in OK_STATUSES:
            for line in (res.get("tail") or [])[-12:] + res.get("log_tail", [])[-12:]:
                log(f"    {line}")
    report["ok"] = all(r["status"] in OK_STATUSES for r in report["stages"].values())
    if markdown is not None:
        report["markdown"] = str(markdown)
        markdown.write_text(render_markdown(report, stages))
    write_json(out, report)
    return report


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def failure_lines(report: dict, stages: Sequence[Stage], width: int = 300) -> List[str]:
    """One line per stage that did not pass: its name, its status and why (the start of its summary, else the last
    line of its log)."""
    out = []
    for stage in stages:
        res = report["stages"].get(stage.name)
        if res is None or res.get("status") in OK_STATUSES:
            continue
        why = str(res.get("summary") or (res.get("log_tail") or ["no output"])[-1]).replace("\n", " ")
        why = why if len(why) <= width else why[:width - 3] + "..."
        out.append(f"- **{stage.name} {res['status']}**: {why}")
    return out


def render_markdown(report: dict, stages: Sequence[Stage]) -> str:
    """The table docs/benchmarks.md promises: one row per stage (status, seconds, timeout, key figures), then each
    stage's detail tables (micro-benchmarks, layer call)."""
    device = report["stages"].get("device", {}).get("device_name", "unknown device")
    where = (f"dry run on the CPU (no GPU measurement; each stage given {DRY_RUN_STAGE_TIMEOUT_S} s, the timeouts "
             "below are a GPU's)" if report["dry_run"] else f"one {device}")
    lines = [f"make gpu-check: {where}, {report['started']}{', --quick' if report['quick'] else ''}", "",
             "| stage | status | seconds | timeout s | key figures |", "|---|---|---|---|---|"]
    for stage in stages:
        res = report["stages"].get(stage.name)
        if res is None:
            lines.append(f"| {stage.name} | not run | | {stage.timeout_s:g} | |")
            continue
        lines.append(f"| {stage.name} | {res['status']} | {res['seconds']} | {stage.timeout_s:g} | "
                     f"{_cell(res.get('summary', ''))} |")
    verdict = "passed" if report["ok"] else "FAILED"
    lines.append(f"| **all** | **{verdict}** | {report.get('seconds', '')} | {report['stage_timeouts_s']:g} | "
                 f"budget {report['budget_s']} s |")
    failed = failure_lines(report, stages)
    if failed:
        lines += [""] + failed
    for stage in stages:
        for table in report["stages"].get(stage.name, {}).get("tables", []):
            lines += ["", f"{table['title']}:", "", "| " + " | ".join(table["header"]) + " |",
                      "|" + "---|" * len(table["header"])]
            lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="make gpu-check: the one-command check of the GPU path")
    parser.add_argument("--out", default="gpu_check.json", help="the JSON report, rewritten after every stage")
    parser.add_argument("--markdown", default=None, help="the Markdown table (default: --out with .md)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    parser.add_argument("--dry-run", action="store_true", help="every stage's code path on the CPU; no GPU needed")
    parser.add_argument("--stages", default=None, help="comma-separated subset of: "
                        + ", ".join(s.name for s in STAGES))
    args = parser.parse_args(argv)
    stages = list(STAGES)
    if args.stages:
        names = args.stages.split(",")
        unknown = sorted(set(names) - {s.name for s in STAGES})
        if unknown:
            parser.error(f"unknown stage(s) {unknown}")
        stages = [s for s in STAGES if s.name in names]
    out = Path(args.out)
    markdown = Path(args.markdown) if args.markdown else out.with_suffix(".md")
    env = dict(os.environ)
    if args.dry_run:
        env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    report = run_check(stages, out, markdown, args.quick, args.dry_run, env)
    print()
    print(markdown.read_text())
    print(f"gpu-check {'passed' if report['ok'] else 'FAILED'}{' (dry run)' if args.dry_run else ''} in "
          f"{report.get('seconds', 0)} s; JSON {out}, Markdown {markdown}")
    return 0 if report["ok"] else 1
