"""The GPU check's test stages (pytest on files of tests/gpu and tests/test_kernels.py) and ``memcheck``. On a GPU a
stage fails when tests/gpu was skipped for want of CUDA or CuPy: a green run must have run the kernels. Without one,
tests/gpu runs under the GPU stand-in, where a skipped test fails the stage too; of tests/test_kernels.py the dry run
takes the CPU contract tests."""
from __future__ import annotations

import os
import re
import shutil
import sys
from typing import List, Sequence

from .common import Context, result, run_command, skipped

#: tests/gpu/conftest.py's skip reasons when the GPU path cannot run at all
_UNUSABLE = ("no CUDA device visible to torch", "CuPy cannot run here")


def pytest_args(ctx: Context, paths: Sequence[str]) -> List[str]:
    args = ["-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider", *paths]
    if ctx.dry_run and "tests/test_kernels.py" in paths:
        args += ["-k", "contract or accumulate or device_ops or not test_kernels"]
    return args


def summary_counts(text: str) -> dict:
    """pytest's closing counts ("3 passed, 2 skipped in 4.1s") as a dict."""
    return {word.rstrip("s") if word.startswith("error") else word: int(number) for number, word in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", text)}


def run(ctx: Context, paths: Sequence[str]) -> dict:
    limit = ctx.left_s()
    code, text = run_command([sys.executable, "-m", "pytest", *pytest_args(ctx, paths)], limit)
    lines = text.strip().splitlines()
    counts = summary_counts(lines[-1] if lines else "")
    # pytest's "FAILED test - reason" lines: the tail alone can be all warnings and lose which test failed
    failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    skipped_here = [line for line in lines if line.startswith("SKIPPED") and "tests/gpu" in line]
    figures = {"pytest_returncode": code, "counts": counts, "failures": failures, "skipped": skipped_here,
               "tail": failures[-8:] + lines[-12:]}
    summary = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no summary line"
    if code is None:
        return result(False, f"pytest ran past {limit:.0f} s (killed); last line: {lines[-1] if lines else ''}",
                      **figures)
    if code != 0:
        named = "; ".join(line.split(" ", 1)[1].split(" - ")[0] for line in failures[:3])
        return result(False, f"pytest exit {code}: {summary}" + (f" ({named})" if named else ""), **figures)
    unusable = sorted({why for why in _UNUSABLE if why in text})
    if unusable and not ctx.dry_run:
        return result(False, f"tests/gpu skipped ({'; '.join(unusable)}): {summary}", **figures)
    if ctx.dry_run and skipped_here:
        return result(False, f"tests/gpu skipped under the GPU stand-in: {skipped_here[0]}", **figures)
    return result(True, summary, **figures)


#: what compute-sanitizer prints when it cannot run on the machine (not a finding about our kernels)
_UNSUPPORTED = ("Device not supported", "Target application terminated before first instrumented API call")


def memcheck(ctx: Context) -> dict:
    """tests/gpu/test_gpu_kernels.py under ``compute-sanitizer --tool memcheck`` with
    ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, so every tensor is its own allocation and an access past its end falls
    outside any (with the caching allocator it would land in a neighbouring block, unseen). Skipped, saying why,
    where the sanitizer is missing or refuses the device; the dry run runs the command without it."""
    tool = shutil.which("compute-sanitizer")
    if tool is None and not ctx.dry_run:
        return skipped("compute-sanitizer is not on PATH")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/gpu/test_gpu_kernels.py"]
    cmd += ["-k", "not 1000003"] if ctx.quick else []
    if tool is not None and not ctx.dry_run:
        cmd = [tool, "--tool", "memcheck", "--error-exitcode", "3", "--print-limit", "20", *cmd]
    code, text = run_command(cmd, ctx.left_s(), {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    tail = text.strip().splitlines()[-15:]
    counts = summary_counts(next((line for line in reversed(text.splitlines()) if " in " in line), ""))
    figures = {"command": " ".join(cmd), "pytest_returncode": code, "counts": counts, "tail": tail}
    if code is None:
        return result(False, f"ran past the stage's limit (killed); last line: {tail[-1] if tail else ''}", **figures)
    if not ctx.dry_run and any(marker in text for marker in _UNSUPPORTED):
        return skipped("compute-sanitizer cannot run on this machine: " + next(m for m in _UNSUPPORTED if m in text),
                       **figures)
    errors = next((line.strip() for line in text.splitlines() if "ERROR SUMMARY" in line), "no ERROR SUMMARY line")
    summary = ("dry run, no sanitizer; " if ctx.dry_run else f"{errors}; ") + ", ".join(
        f"{n} {w}" for w, n in counts.items())
    return result(code == 0 and (ctx.dry_run or "ERROR SUMMARY: 0 errors" in text), summary, **figures)
