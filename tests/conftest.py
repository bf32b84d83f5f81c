import glob
import os
import socket
import sys
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

# DeepSpeed's CPU shared-memory all-reduce (deepspeed_shm_comm_op) creates a 66 MB buffer file per rank and master
# port in /dev/shm and never removes it. The suite starts well over a hundred multi-rank jobs on fresh ports, which
# would leave gigabytes of RAM-backed files behind (and starve the machine); each test removes the ones its jobs
# created. Only buffers whose job has ended go: a job's master port is bound (rank 0's store listens on it) while
# it runs, and a job running beside the suite (another test run, a benchmark) may create its buffers during a
# test and open its peers' a moment later. Unlinking is safe even if a process still maps the buffer.
_DS_SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


def _job_ended(path: str) -> bool:
    """Whether the job of a buffer (``..._<uid>_<addr>_<port>_<rank>``) has ended: nothing listens on its port."""
    try:
        port = int(os.path.basename(path).rsplit("_", 2)[-2])
    except ValueError:
        return False
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # (closed connections may linger on it)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around setup, call and teardown of each test (module-scoped fixtures included)."""
    started = time.time() - 1.0
    before = set(glob.glob(_DS_SHM_BUFFERS))
    yield
    for path in set(glob.glob(_DS_SHM_BUFFERS)) - before:
        try:
            if os.stat(path).st_mtime >= started and _job_ended(path):
                os.remove(path)
        except OSError:
            pass
