"""What the GPU check's stages share: the run's context (quick, dry run, the report so far), timing, the GPU stand-in
for the dry run, running a command with a limit."""
from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Context:
    """One stage's run: ``quick`` shrinks sizes, ``dry_run`` runs its code on the CPU under the GPU stand-in,
    ``prior`` is the report of the stages before it, ``timeout_s`` its limit (its subprocesses get what is left, so
    they end first and say why)."""

    quick: bool = False
    dry_run: bool = False
    prior: dict = field(default_factory=dict)
    timeout_s: Optional[float] = None
    started: float = field(default_factory=time.monotonic)

    def left_s(self, margin: float = 4.0) -> Optional[float]:
        """Seconds left to a subprocess of this stage (None: no limit)."""
        return None if self.timeout_s is None else max(1.0, self.timeout_s - (time.monotonic() - self.started) - margin)

    def stand_in(self):
        """In a dry run the GPU stand-in (tests/fake_cupy.py: CUDA tensors computed on the CPU, a CuPy whose kernels
        check their launches and compute their contracts, NCCL a loopback or gloo); nothing otherwise."""
        if not self.dry_run:
            return contextlib.nullcontext()
        if str(ROOT / "tests") not in sys.path:   # the stand-ins live with the tests that use them
            sys.path.insert(0, str(ROOT / "tests"))
        from fake_cupy import gpu_stand_in
        return gpu_stand_in()

    def sync(self) -> None:
        if not self.dry_run:
            import torch
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], object], repeat: int) -> float:
        """Median seconds of ``fn`` over ``repeat`` runs after one warm-up, by CUDA events (host clocks under the
        stand-in, whose events read the host clock)."""
        import torch
        fn()
        self.sync()
        times = []
        for _ in range(max(1, repeat)):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    def prior_figure(self, stage: str, key: str) -> Optional[float]:
        """A figure an earlier stage reported (None if it did not run or did not report it)."""
        value = self.prior.get("stages", {}).get(stage, {}).get(key)
        return float(value) if isinstance(value, (int, float)) else None


def run_command(cmd: List[str], timeout: Optional[float], env: Optional[Dict[str, str]] = None
                ) -> Tuple[Optional[int], str]:
    """(exit code, or None if it ran past ``timeout``; stdout and stderr together) of ``cmd`` run from the
    repository root in a session of its own: on a timeout its whole process group is killed (pytest's and the
    sanitizer's children too) and what it printed so far is returned."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def result(ok: bool, summary: str, **figures) -> dict:
    """A stage's result: ``status`` passed/failed, the one-line ``summary`` for the table, and its figures."""
    return {"status": "passed" if ok else "failed", "summary": summary, **figures}


def skipped(why: str, **figures) -> dict:
    return {"status": "skipped", "summary": why, "why": why, **figures}
