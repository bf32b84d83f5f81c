"""What the GPU check's stages share: the run's context (quick, dry run, the report so far), timing, the CUDA
stand-in for the dry run, and the machine's ceilings as named constants with their sources."""
from __future__ import annotations

import contextlib
import os
import tempfile
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]

#: Dense bf16 matrix rate of one H200 as measured on this workplace's machines (/work/.library/device/KINDS.md,
#: 2026-11: an 8192x8192x8192 bf16 product through PyTorch, 769 to 798 TFLOP/s on random data). The device stage
#: also measures it on the machine at hand; the layer-call stage reports TFLOP/s against both.
H200_BF16_TFLOPS_MEASURED_HERE = 790.0
#: The vendor's datasheet figure for dense bf16 (H100/H200 SXM, no sparsity): the ceiling nobody reaches.
H200_BF16_TFLOPS_DATASHEET = 989.0
#: HBM3e bandwidth of the H200 by the vendor's datasheet, GB/s (the device stage reads the nominal figure from the
#: device's attributes and measures a device-to-device copy: about 4,300 GB/s read + written here, KINDS.md).
H200_HBM_GBS_DATASHEET = 4800.0


@dataclass
class Context:
    """One stage's run: ``quick`` shrinks sizes, ``dry_run`` runs the stage's code path on the CPU (the CUDA
    stand-in for device code, fakes for CuPy and NCCL), ``prior`` is the report of the stages before it,
    ``timeout_s`` the stage's own limit (its subprocesses get what is left of it, so they end first and say
    why)."""

    quick: bool = False
    dry_run: bool = False
    prior: dict = field(default_factory=dict)
    timeout_s: Optional[float] = None
    started: float = field(default_factory=time.monotonic)

    def left_s(self, margin: float = 4.0) -> Optional[float]:
        """Seconds left to a subprocess of this stage (None: no limit)."""
        if self.timeout_s is None:
            return None
        return max(1.0, self.timeout_s - (time.monotonic() - self.started) - margin)

    def stand_in(self, kernels: bool = True):
        """In a dry run the GPU stand-in (tests/fake_cupy.py: the CUDA stand-in of tests/device_shim.py, a CuPy whose
        kernels check their launches and compute their contracts, NCCL as a loopback or over gloo; ``kernels``:
        whether the kernels' probe answers usable); nothing otherwise. Yields its handle (``.shim``, ``.cupy``) or
        None."""
        if not self.dry_run:
            return contextlib.nullcontext()
        test_fixtures()
        from fake_cupy import gpu_stand_in
        return gpu_stand_in(kernels)

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


def test_fixtures() -> None:
    """Put tests/ on the import path: the dry run's stand-ins (device_shim, fake_cupy, gpu_fakes) live there, with
    the unit tests that import them."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))


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


def spawn_ranks(target: Callable, world: int, args: Tuple, timeout: float) -> Dict[int, Tuple[bool, object]]:
    """Run ``target(rank, world, store, *args, queue)`` in ``world`` spawned processes (``store``: a file for
    ``init_method="file://..."``) and collect what each puts on the queue, ``(rank, ok, payload)``, for at most
    ``timeout`` seconds: a rank that dies or hangs ends the wait (a hang fails fast, never the stage's own timeout),
    and every process still alive then is killed. Returns ``{rank: (ok, payload)}`` of the ranks that answered."""
    import torch.multiprocessing as mp
    store = tempfile.mktemp(prefix="gpu_check_ranks_")
    mp_ctx = mp.get_context("spawn")
    q = mp_ctx.Queue()
    procs = [mp_ctx.Process(target=target, args=(r, world, store, *args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: Dict[int, Tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, ok, payload = q.get(timeout=0.5)
                results[rank] = (ok, payload)
            except Exception:  # noqa: BLE001 - queue.Empty: look whether a worker died
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if os.path.exists(store):
            os.remove(store)
    return results


def host_seconds(fn: Callable[[], object]) -> float:
    """Host time of one call (what a stream-side wait must keep small)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def result(ok: bool, summary: str, **figures) -> dict:
    """A stage's result: ``status`` passed/failed, the one-line ``summary`` for the table, and its figures."""
    return {"status": "passed" if ok else "failed", "summary": summary, **figures}


def skipped(why: str, **figures) -> dict:
    return {"status": "skipped", "summary": why, "why": why, **figures}
