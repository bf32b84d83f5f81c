"""What the benchmark reports say about the machine that produced them (shared by every benchmark script)."""
from __future__ import annotations

import os
import platform
from typing import Tuple


def cpu_model() -> Tuple[str, int]:
    """(CPU model name, vCPUs) from /proc/cpuinfo, falling back to ``platform`` where it does not exist."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return (names[0] if names else cpu), (len(names) or os.cpu_count() or 0)
    except OSError:
        return cpu, os.cpu_count() or 0


def describe_machine() -> dict:
    """The benchmark run's machine and software versions, for its results JSON (benchmarks/run.py)."""
    import torch
    import deepspeed
    cpu, vcpus = cpu_model()
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            mem_gib = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) / (1 << 20)
    except (OSError, StopIteration):
        mem_gib = None
    try:
        import transformers
        tf = transformers.__version__
    except Exception as exc:  # any import failure: report it
        tf = f"not importable ({type(exc).__name__})"
    return {"cpu": cpu, "vcpus": vcpus, "memory_gib": round(mem_gib, 1) if mem_gib else None,
            "gpu": torch.cuda.is_available(), "python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "transformers": tf, "backend": "gloo",
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            # glibc's allocator settings: whether freed memory is kept (no first-touch page faults, as a GPU's
            # caching allocator keeps its blocks) moves CPU layer calls by 10-30% (docs/benchmarks.md)
            "malloc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}}


def allocator_settings(machine: dict) -> str:
    """The run's glibc allocator settings (``describe_machine``'s ``malloc_env``) for a table's machine line:
    ``, NAME=value`` each, nothing when none was set (or the record predates them)."""
    return "".join(f", {k}={v}" for k, v in machine.get("malloc_env", {}).items())
