"""``python -m ds_hecate.tools.launch``: the ``deepspeed`` launcher, removing its job's ``/dev/shm`` buffers at the end.

Takes the arguments of ``deepspeed`` (``deepspeed.launcher.runner``) unchanged, for instance::

    python -m ds_hecate.tools.launch --num_gpus 2 examples/train_gpt_moe.py --deepspeed_config ds_configs/ds_hecate.json

and runs DeepSpeed's launcher with them. Without ``--master_port`` it picks a free port (DeepSpeed's default, 29500,
would clash with any other job on the machine). When the launcher has returned and the job's processes have ended,
it removes the job's CPU all-reduce buffers (``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, see
:mod:`ds_hecate.deepspeed_glue.shm_buffers`), whatever way the job ended: a normal end, a failing or killed rank
(DeepSpeed's launcher then stops the others), Ctrl-C, or SIGTERM/SIGHUP to this process (passed on to the job's
processes, then the cleanup). Only a SIGKILL of this process itself leaves them (docs/troubleshooting.md).

Why a launcher and not only the hook in ``ds_hecate.initialize``: the hook unlinks the files once every rank has
opened them, in jobs with Hecate enabled; a rank killed before that point, and the baselines without Hecate, leave
theirs. The project's own launches (``make demo``, ``python -m benchmarks.step``) go through here.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..deepspeed_glue.shm_buffers import remove_job_buffers

#: the address DeepSpeed's runner gives the ranks of a job on this machine (it has no hostfile)
LOCAL_MASTER_ADDR = "127.0.0.1"
#: signals this process passes on to the job's processes before it cleans up
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: how long to wait, after the launcher returned, for the job's last processes (DeepSpeed's launch.py itself gives
#: the ranks it stops 30 s before it kills them)
JOB_END_WAIT_S = 40.0


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind((LOCAL_MASTER_ADDR, 0))
        return s.getsockname()[1]


def with_master_port(argv: Sequence[str]) -> List[str]:
    """``argv`` with ``--master_port <free port>`` in front when it gives no ``--master_port`` of the launcher's own
    (one after the script belongs to the script)."""
    from deepspeed.launcher.runner import parse_args

    if parse_args(["--master_port", "-1", *argv]).master_port != -1:
        return list(argv)
    return ["--master_port", str(free_port()), *argv]


def job_master_address(args: argparse.Namespace) -> Optional[str]:
    """The ``MASTER_ADDR`` DeepSpeed's runner gives the ranks of the launch its parsed ``args`` describe: 127.0.0.1
    without a hostfile (the runner then ignores ``--master_addr``), else ``--master_addr``; None when the runner
    would ask the first host for it (``hostname -I`` over ssh)."""
    if not os.path.isfile(args.hostfile):
        return LOCAL_MASTER_ADDR
    return args.master_addr or None


def job_processes(group: int) -> List[int]:
    """Pids of the live processes of process group ``group``, read from /proc; zombies do not count (an orphan's
    may wait long for its reaper)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:   # ended meanwhile
            continue
        state, _, pgrp = stat[stat.rindex(")") + 2:].split()[:3]   # after "pid (comm) "
        if int(pgrp) == group and state not in ("Z", "X"):
            alive.append(int(entry))
    return alive


def _wait_for_job_end(group: int, timeout_s: float) -> bool:
    """Wait until no live process of the job's process group is left; False if some still are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while job_processes(group):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def run(argv: Sequence[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> int:
    """Run DeepSpeed's launcher with ``argv`` (a free ``--master_port`` added when absent) in a process group of its
    own, wait for the job to end, remove its buffers; returns the launcher's exit status (128 + N for signal N).
    Signals of :data:`FORWARDED_SIGNALS` that reach this process meanwhile go to the job's processes (main thread
    only; elsewhere the caller's handlers stay)."""
    from deepspeed.launcher.runner import parse_args

    argv = with_master_port(argv)
    args = parse_args(argv)
    addr = job_master_address(args)
    proc = subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", *argv], env=env, cwd=cwd,
                            start_new_session=True)   # its own process group: the job's processes, and only them

    def forward(signum: int, frame: object) -> None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous: Dict[int, Any] = {}   # the handlers signal.signal returned, given back to it as they are
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        status = proc.wait()
        if not _wait_for_job_end(proc.pid, JOB_END_WAIT_S):
            print(f"ds_hecate.tools.launch: processes of the job (process group {proc.pid}) still run "
                  f"{JOB_END_WAIT_S:.0f} s after DeepSpeed's launcher returned; removing the job's buffers anyway "
                  "(ranks that have started keep theirs mapped)", file=sys.stderr)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if addr is not None:
            remove_job_buffers(addr, args.master_port)
        else:
            print("ds_hecate.tools.launch: no --master_addr with a hostfile, so the job's /dev/shm buffers cannot be "
                  "named and are left (docs/troubleshooting.md)", file=sys.stderr)
    return 128 - status if status < 0 else status


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
