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
