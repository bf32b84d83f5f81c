"""Stage ``memcheck``: ``compute-sanitizer --tool memcheck`` on the kernel tests (tests/gpu/test_gpu_kernels.py),
with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that every torch tensor is its own allocation and an access past a
tensor's end is outside any allocation (with the caching allocator it would land in a neighbouring block of the
same segment, unseen).

Where the sanitizer is not on PATH, or refuses the device (gVisor machines: "Device not supported"), the stage is
skipped and says why. The dry run builds the same command and runs the tests without the sanitizer (they skip on
the CPU), so the command line and the environment are exercised.
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import List, Optional

from .common import Context, result, run_command, skipped
from .suite import summary_counts

#: what compute-sanitizer prints when it cannot run on the machine (not a finding about our kernels)
_UNSUPPORTED = ("Device not supported", "Target application terminated before first instrumented API call")


def command(tool: Optional[str], quick: bool) -> List[str]:
    tests = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/gpu/test_gpu_kernels.py"]
    if quick:
        tests += ["-k", "not 1000003"]
    if tool is None:
        return tests
    return [tool, "--tool", "memcheck", "--error-exitcode", "3", "--print-limit", "20", *tests]


def run(ctx: Context) -> dict:
    tool = shutil.which("compute-sanitizer")
    if tool is None and not ctx.dry_run:
        return skipped("compute-sanitizer is not on PATH")
    cmd = command(None if ctx.dry_run else tool, ctx.quick)
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    code, text = run_command(cmd, ctx.left_s(), env)
    tail = text.strip().splitlines()[-15:]
    counts = summary_counts(next((line for line in reversed(text.splitlines()) if " in " in line), ""))
    figures = {"command": " ".join(cmd), "pytest_returncode": code, "counts": counts, "tail": tail,
               "sanitizer": tool if not ctx.dry_run else None}
    if code is None:
        return result(False, f"ran past the stage's limit (killed); last line: {tail[-1] if tail else ''}",
                      **figures)
    if not ctx.dry_run and any(marker in text for marker in _UNSUPPORTED):
        return skipped("compute-sanitizer cannot run on this machine: "
                       + next(m for m in _UNSUPPORTED if m in text), **figures)
    errors = next((line.strip() for line in text.splitlines() if "ERROR SUMMARY" in line), "")
    summary = (f"{errors or 'no ERROR SUMMARY line'}; " if not ctx.dry_run else "dry run, no sanitizer; ") + \
        ", ".join(f"{n} {w}" for w, n in counts.items())
    ok = code == 0 and (ctx.dry_run or "ERROR SUMMARY: 0 errors" in text)
    return result(ok, summary, **figures)
