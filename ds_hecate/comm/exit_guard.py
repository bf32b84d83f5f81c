"""What a rank does with its gloo process groups when the interpreter exits.

Why a module of its own: the failure it prevents is torch's, not Hecate's, but every CPU run meets it. A gloo
worker thread that has executed a collective drops its reference to the work *after* the caller's ``wait`` has
returned (and at any time for a work nobody waits for). The work's tensors have Python objects, so that last
release takes the GIL. When the worker asks for the GIL only once the interpreter is finalizing, CPython ends the
thread inside a C++ destructor and the process aborts: "terminate called without an active exception", exit -6,
on every rank. Core dumps of the Hugging Face Trainer under ``accelerate launch`` (about 1 run in 12 on 2 cores)
show ``~AsyncAllgatherWork`` <- ``ProcessGroupGloo::runLoop`` <- ``PyThread_exit_thread``:
the Trainer's last collective (``store_flos``'s all-gather on the default group) came within a switch interval
of the end of the script. torch's discussion: pytorch/pytorch#190489 and #179291.

Destroying the groups does not prevent it: the script's, DeepSpeed's and Hecate's own objects keep the groups,
and so their worker threads, alive, and ``shutdown`` does not stop gloo's workers. What does is to give those
threads the GIL before finalization: a sleep releases it at once to a thread waiting for it, and frees the core
for a worker not yet scheduled. The grace is local (no collective), so a rank whose peers died cannot hang here.
NCCL's watchdog threads do not take the GIL for completed works; the grace is for gloo only.
"""
from __future__ import annotations

import atexit
import time
from typing import Iterable

import torch.distributed as dist

#: seconds gloo's worker threads get the GIL at exit to release the works they completed
GLOO_WORKER_GRACE_S = 0.05

_registered = False


def release_gloo_works_at_exit(groups: Iterable = ()) -> None:
    """Register, once per process, an exit handler that destroys ``groups`` (Hecate's own; ones the script already
    destroyed are skipped) and then, on gloo, sleeps :data:`GLOO_WORKER_GRACE_S` so that gloo's worker threads
    release their completed works while the interpreter is whole. Later calls add their groups to the same
    handler. Local to the rank: no collective."""
    global _registered, _on_gloo
    _groups.extend(groups)
    # Remembered now: a script that destroys its process groups before exiting (the usual ending) leaves no
    # backend to ask at exit, and its gloo workers may still be waiting for the GIL to release their last works.
    _on_gloo = _on_gloo or (dist.is_initialized() and dist.get_backend() == "gloo")
    if not _registered:
        atexit.register(_at_exit)
        _registered = True


_groups: list = []
_on_gloo = False


def _at_exit() -> None:
    """Destroy Hecate's groups if the script left them, then give gloo's workers the grace: also when the script
    destroyed every group itself (``destroy_process_group()`` before exit), since destroying does not hand them
    the GIL (a DeepSpeed-MoE script ending in barrier + destroy aborted on one rank)."""
    if dist.is_initialized():
        for group in _groups:
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):   # already destroyed by the script
                pass
    _groups.clear()
    if _on_gloo:
        time.sleep(GLOO_WORKER_GRACE_S)
