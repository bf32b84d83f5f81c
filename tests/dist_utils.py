"""Run a function on N real processes over gloo, with a watchdog so a hang fails fast instead of eating CI."""
from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Sequence, cast

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = float(os.environ.get("DS_HECATE_TEST_TIMEOUT", "300"))
#: how the rank processes start: ``forkserver`` (default) forks each from a server that imported torch and DeepSpeed
#: once; ``spawn`` starts a fresh interpreter per rank. Why: a fresh interpreter spends about 3 s importing torch, so
#: on 2 cores a 2-rank run of nothing took 3.4 s and a 4-rank one 8 s (0.7 and 1.3 s forked), over a suite of a few
#: hundred runs. The server preloads torch, DeepSpeed and what its ``initialize`` imports (:data:`SERVER_PRELOAD`;
#: never ds_hecate: oracle ranks check that it is never imported, and an editable install has no autoload hook), and
#: each rank gets the caller's environment as it is when the run starts, as a spawned one would. DeepSpeed picks its
#: accelerator once, at import: the server imports it with ``DS_ACCELERATOR=cpu``, which every rank sets anyway
#: (:func:`_become_rank`), so that a CUDA machine's ranks do not inherit a CUDA accelerator.
START_METHOD = os.environ.get("DS_HECATE_TEST_START_METHOD", "forkserver")
if START_METHOD not in ("forkserver", "spawn"):
    raise ValueError(f"DS_HECATE_TEST_START_METHOD must be 'forkserver' or 'spawn', got {START_METHOD!r}")
#: What every training rank imports anyway, heaviest last: ``deepspeed.initialize`` builds a torch Adam, whose
#: constructor imports ``torch._dynamo``, and checks the optimizer against ZeRO's list, which imports DeepSpeed's Muon
#: (``torch.compile`` decorators, inductor's config): most of a short training's time in each rank, on every run,
#: where the server pays it once. A module that fails to import (another DeepSpeed
#: release) is skipped by the server.
SERVER_PRELOAD = ["torch", "deepspeed", "torch._dynamo", "deepspeed.runtime.engine",
                  "deepspeed.runtime.zero.muon.muon_optimizer"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _become_rank(rank: int, world_size: int, port: int, environ: Dict[str, str]) -> None:
    """The environment torch.distributed / DeepSpeed read, as a launcher would set it, and one thread. ``environ``:
    the caller's environment when the run started (a forked rank otherwise keeps the fork server's)."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": os.environ.get("TEST_LOCAL_WORLD_SIZE", str(world_size)),
                       "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    import torch
    torch.set_num_threads(1)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any], results,
            environ: Dict[str, str]) -> None:
    _become_rank(rank, world_size, port, environ)
    try:
        # Plain pickle (tensor data inline): the shared-memory handles of torch's queue die with this process.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure to the parent, which fails the test
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def _start_fork_server(ctx) -> None:
    """Start the fork server (once; later calls find it running) with :data:`SERVER_PRELOAD` imported under the
    environment a rank has for DeepSpeed's import-time choices (``DS_ACCELERATOR=cpu``); the caller's own environment
    is left as it was."""
    from multiprocessing import forkserver

    ctx.set_forkserver_preload(SERVER_PRELOAD)
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["DS_ACCELERATOR"]
        else:
            os.environ["DS_ACCELERATOR"] = saved


def _spawn(target: Callable, world_size: int, fn: Callable, args: Sequence[Any]):
    """Start ``world_size`` processes (:data:`START_METHOD`) running ``target(rank, world_size, port, fn, args,
    results, environ)``."""
    ctx = cast(Any, mp.get_context(START_METHOD))   # spawn or forkserver (typeshed's BaseContext has no Process)
    if START_METHOD == "forkserver":
        _start_fork_server(ctx)
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=target, args=(r, world_size, port, fn, args, results, environ), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, results


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the per-rank results.

    Raises AssertionError with the failing rank's traceback, or when the processes do not finish within
    ``timeout`` seconds (then every process is killed).
    """
    procs, results = _spawn(_worker, world_size, fn, args)
    out: List[Any] = [None] * world_size
    failures: List[str] = []
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    dead_since: Dict[int, float] = {}
    hung = False
    try:
        while pending and not failures:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                now = time.monotonic()
                if now > deadline:
                    hung = True   # no grace for the ranks below: they are killed at once
                    raise AssertionError(f"watchdog: {world_size}-rank run of {fn.__name__} did not finish within "
                                         f"{timeout:.0f} s (hang?); ranks still running: {sorted(pending)}") from None
                for r in pending:  # a rank that died without reporting (crash, kill) fails the run
                    if procs[r].exitcode is not None and now - dead_since.setdefault(r, now) > 5:
                        failures.append(f"rank {r} exited with code {procs[r].exitcode} without a result")
                continue
            pending.discard(rank)
            if ok:
                out[rank] = pickle.loads(payload)
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=0 if hung else 5 if not failures else 1)
            if p.is_alive():
                p.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    return out


def _worker_until_exit(rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any], results,
                       environ: Dict[str, str]) -> None:
    """Like ``_worker``, but a failure ends the process with a non-zero exit code, as a real job's rank would."""
    _become_rank(rank, world_size, port, environ)
    try:
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)


def run_ranks_until_exit(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> List[dict]:
    """Run ``fn`` on ``world_size`` processes and let each end on its own (nobody kills the survivors when one
    rank dies). Returns per rank ``{"exitcode", "exit_time" (time.time() when seen ended), "ok", "payload"}``;
    processes still running after ``timeout`` are killed and reported with ``exitcode`` None."""
    procs, results = _spawn(_worker_until_exit, world_size, fn, args)
    out: List[dict] = [{"exitcode": None, "exit_time": None, "ok": False, "payload": None} for _ in procs]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(o["exit_time"] is None for o in out):
        try:
            rank, ok, payload = results.get(timeout=0.2)
            out[rank]["ok"] = ok
            out[rank]["payload"] = pickle.loads(payload) if ok else payload
        except queue.Empty:
            pass
        for r, p in enumerate(procs):
            if out[r]["exit_time"] is None and p.exitcode is not None:
                out[r]["exit_time"], out[r]["exitcode"] = time.time(), p.exitcode
    while True:  # results that arrived just before the exit
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            break
        out[rank]["ok"] = ok
        out[rank]["payload"] = pickle.loads(payload) if ok else payload
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    return out
