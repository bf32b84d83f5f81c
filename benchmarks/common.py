"""What every benchmark shares: the machine record, paired ratios with bootstrap intervals, run records and the
generated Markdown blocks.

A run record (the JSON an entry point writes, by default under the git-ignored ``runs/``) holds the command, the
date, the commit and the machine beside the figures, so a table rendered from it later (``--report-only``) still
says where its numbers came from. A generated block of a Markdown file lies between two marker lines naming the
command that owns it; everything around it stays as written by hand.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs"
Ratio = Tuple[float, float, float]


# -- the machine -------------------------------------------------------------------------------------------------
def _first_line(path: str, prefix: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(prefix)), None)
    except OSError:
        return None


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception as exc:  # any import failure: say so in the record
        return f"not importable ({type(exc).__name__})"


def describe_machine() -> Dict[str, Any]:
    """The machine and the software versions a figure depends on; glibc's ``MALLOC_`` settings too, since whether
    freed memory is kept (no first-touch page faults) moves CPU layer calls by 10-30%."""
    mem = _first_line("/proc/meminfo", "MemTotal")
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": _first_line("/proc/cpuinfo", "model name") or platform.processor(), "vcpus": os.cpu_count(),
            "memory_gib": round(int(mem.split()[0]) / 2 ** 20, 1) if mem else None, "gpu": gpu,
            "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": _version("deepspeed"), "transformers": _version("transformers"),
            "numpy": _version("numpy"), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "malloc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")},
            "load_average_1min": load_average()}


def load_average() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine_line(m: Dict[str, Any], load_after: Optional[float] = None) -> str:
    """One sentence for a table's header: the machine, the versions, the allocator settings and the load."""
    where = f"GPU {m['gpu']}" if m.get("gpu") else "no GPU"
    malloc = "".join(f", {k}={v}" for k, v in (m.get("malloc_env") or {}).items())
    load = m.get("load_average_1min")
    if isinstance(load, list):   # older records: [before, after]
        load, load_after = load
    loads = f"; 1-minute load average {load} before, {load_after} after" if load is not None and load_after else ""
    return (f"{m['cpu']}, {m['vcpus']} CPUs, {m.get('memory_gib')} GiB, {where}; Python {m.get('python')}, torch "
            f"{m.get('torch')}, DeepSpeed {m.get('deepspeed')}, transformers {m.get('transformers')}, "
            f"OMP_NUM_THREADS={m.get('omp_num_threads')}{malloc}{loads}")


def git_commit() -> str:
    """The checkout's commit, marked when tracked files outside docs/ differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_record(schema: str, module: str, argv: Sequence[str], machine: Dict[str, Any], **fields: Any) -> dict:
    """A run's JSON: schema, command, date, commit, the machine as it was before the run (its load after), and
    ``fields``."""
    return {"schema": schema, "command": f"python -m {module} " + " ".join(argv),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "commit": git_commit(),
            "machine": machine, "load_after": load_average(), **fields}


def header_lines(record: dict) -> List[str]:
    """The lines above a generated table: the command (less where its record went), date and commit, the machine."""
    commit = f", commit {record['commit']}" if record.get("commit") else ""
    command = re.sub(r" --(json|out) \S+", "", record["command"])
    return [f"Generated by `{command}` on {record['date']}{commit}.", "",
            "Machine: " + machine_line(record["machine"], record.get("load_after")) + ".", ""]


# -- paired ratios -----------------------------------------------------------------------------------------------
def paired_ratio(times: Sequence[float], reference: Sequence[float], resamples: int = 2000, seed: int = 0) -> Ratio:
    """Median over rounds of ``times[i] / reference[i]`` with a 95% bootstrap interval of that median (seeded).

    Paired because the systems take turns round by round: round i of both ran under the same drift of the machine,
    and the ratio per round removes most of it."""
    ratios = [a / b for a, b in zip(times, reference) if b > 0]
    if not ratios:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]


def ratio_text(ratio: Sequence[float]) -> str:
    return "{:.3f} [{:.3f}, {:.3f}]".format(*ratio)


def interleaved(calls: Dict[str, Any], rounds: int) -> Dict[str, List[float]]:
    """``rounds`` rounds in which every ``calls[name]()`` (returning its seconds) runs once, in an order rotated
    round by round; the garbage collector runs between rounds, not inside them."""
    import gc
    names = list(calls)
    times: Dict[str, List[float]] = {n: [] for n in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                times[n].append(calls[n]())
            gc.collect()
    finally:
        gc.enable()
    return times


# -- Markdown ----------------------------------------------------------------------------------------------------
def markers(module: str) -> Tuple[str, str]:
    """The marker lines of ``python -m <module>``'s generated block."""
    return (f"<!-- BEGIN generated by python -m {module}: do not edit by hand -->",
            f"<!-- END generated by python -m {module} -->")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def replace_block(path: str, block: str, module: str) -> None:
    """Write ``block`` between ``module``'s markers in ``path`` (a missing file gets just the block); SystemExit
    naming the marker lines when the file lacks them."""
    begin, end = markers(module)
    block = "\n".join([begin, "", block, "", end])
    if not os.path.exists(path):
        Path(path).write_text(block + "\n", encoding="utf-8")
        return
    text = Path(path).read_text(encoding="utf-8")
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{path}: add the lines\n{begin}\n{end}\nonce, in that order, where the table goes")
    head, rest = text.split(begin, 1)
    Path(path).write_text(head + block + rest.split(end, 1)[1], encoding="utf-8")


def publish(module: str, record: dict, block: str, json_path: Optional[str], markdown: Optional[str],
            new_run: bool = True) -> int:
    """A run's outputs: its record as JSON (a new run only), its block into ``markdown``, the block printed."""
    if new_run and json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"[{module}] wrote {json_path}", file=sys.stderr)
    if markdown:
        replace_block(markdown, block, module)
    print(block)
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
