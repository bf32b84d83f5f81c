import glob
import os
import sys
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

# DeepSpeed's CPU shared-memory all-reduce (deepspeed_shm_comm_op) creates a 66 MB buffer file per rank and master
# port in /dev/shm and never removes it. The suite starts well over a hundred multi-rank jobs on fresh ports, which
# would leave gigabytes of RAM-backed files behind (and starve the machine); each test removes the ones its jobs
# created. Unlinking is safe even if a process still maps the buffer.
_DS_SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around setup, call and teardown of each test (module-scoped fixtures included)."""
    started = time.time() - 1.0
    before = set(glob.glob(_DS_SHM_BUFFERS))
    yield
    for path in set(glob.glob(_DS_SHM_BUFFERS)) - before:
        try:
            if os.stat(path).st_mtime >= started:
                os.remove(path)
        except OSError:
            pass
