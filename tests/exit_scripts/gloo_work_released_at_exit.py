"""One rank of a 2-rank gloo world whose last collective completes on gloo's worker thread while the main thread
holds the GIL up to interpreter exit: the race behind the Trainer's exit abort (ds_hecate/comm/exit_guard.py),
made certain on rank 0. ``--guard`` registers ds_hecate's exit guard; without it rank 0 aborts (exit -6).
Rank, world size and rendezvous come from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _exit_guard():
    """ds_hecate/comm/exit_guard.py alone, loaded from its file: ``import ds_hecate`` would bring DeepSpeed, whose
    own exit handlers hand the GIL over by chance and would hide whether the guard does."""
    path = Path(__file__).resolve().parents[2] / "ds_hecate" / "comm" / "exit_guard.py"
    spec = importlib.util.spec_from_file_location("exit_guard", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--guard", action="store_true", help="register ds_hecate's exit guard")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if args.guard:
        _exit_guard().release_gloo_works_at_exit()
    # A waiting thread never forces the main thread to drop the GIL now: only a blocking call (a sleep) hands it.
    sys.setswitchinterval(1000.0)
    print(f"rank {dist.get_rank()}: gathering", flush=True)   # printing releases the GIL: before, not after
    if dist.get_rank() > 0:
        # Rank 0's gather completes only now, long after it let go of the work: its worker thread makes the last
        # release. (A rank whose gather completes at once, before it drops its references, releases them itself.)
        time.sleep(0.2)
    gathered = [torch.empty(4) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.full((4,), float(dist.get_rank())), async_op=True)
    del gathered   # the worker thread now holds the last references to the work's tensors
    deadline = time.perf_counter() + 0.8
    while time.perf_counter() < deadline:   # bytecode only: the collective completes, its release waits for the GIL
        pass


if __name__ == "__main__":
    main()
