"""Stage ``tests``: pytest on tests/gpu (every kernel against its torch contract, the CuPy transport and the
kernel device ops on the GPU, 2-process NCCL where there are 2 GPUs) and tests/test_kernels.py (the contracts, the
CUDA sources compiling with nvcc).

On a GPU the stage fails if tests/gpu was skipped for want of CUDA or CuPy (its conftest's reasons): a green run
must have run the kernels. The dry run runs tests/gpu under the GPU stand-in (their conftest chooses it where no
GPU is visible; every test runs, none may be skipped) and the CPU contract tests of tests/test_kernels.py.
"""
from __future__ import annotations

import re
import sys
from typing import List

from .common import Context, result, run_command

#: tests/gpu/conftest.py's skip reasons when the GPU path cannot run at all
_UNUSABLE = ("no CUDA device visible to torch", "CuPy cannot run here")


def pytest_args(ctx: Context) -> List[str]:
    args = ["-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider", "tests/gpu", "tests/test_kernels.py"]
    if ctx.dry_run:
        args += ["-k", "contract or accumulate or device_ops or not test_kernels"]
    return args


def summary_counts(text: str) -> dict:
    """pytest's closing counts ("3 passed, 2 skipped in 4.1s") as a dict."""
    counts = {}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", text):
        counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return counts


def run(ctx: Context) -> dict:
    limit = ctx.left_s()
    code, text = run_command([sys.executable, "-m", "pytest", *pytest_args(ctx)], limit)
    lines = text.strip().splitlines()
    counts = summary_counts(lines[-1] if lines else "")
    unusable = sorted({why for why in _UNUSABLE if why in text})
    # pytest's "FAILED test - reason" lines: the tail alone can be all warnings and lose which test failed
    failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    figures = {"pytest_returncode": code, "counts": counts, "failures": failures,
               "tail": failures[-8:] + lines[-12:]}
    summary = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no summary line"
    if code is None:
        return result(False, f"pytest ran past {limit:.0f} s (killed); last line: {lines[-1] if lines else ''}",
                      **figures)
    if code != 0:
        named = "; ".join(line.split(" ", 1)[1].split(" - ")[0] for line in failures[:3])
        return result(False, f"pytest exit {code}: {summary}" + (f" ({named})" if named else ""), **figures)
    if unusable and not ctx.dry_run:
        return result(False, f"tests/gpu skipped ({'; '.join(unusable)}): {summary}", **figures)
    skipped_here = [line for line in lines if line.startswith("SKIPPED") and "tests/gpu" in line]
    figures["skipped"] = skipped_here
    if ctx.dry_run and skipped_here:
        return result(False, f"tests/gpu skipped under the GPU stand-in: {skipped_here[0]}", **figures)
    return result(True, summary, **figures)
