"""DeepSpeed's CPU all-reduce buffers in ``/dev/shm``: which files are a job's, and when they can go.

Why a module of its own: the files are DeepSpeed's, not Hecate's, but every CPU job meets them. DeepSpeed's
shared-memory all-reduce (``deepspeed/ops/csrc/cpu/comm/shm.cpp``, loaded as ``deepspeed_shm_comm_op`` by the CPU
accelerator's ``TorchBackend``, or inside its oneCCL op) is set up once per process, while DeepSpeed starts its
distributed backend (``deepspeed.init_distributed``), when every rank of the job runs on this machine (the
launcher's ``LOCAL_SIZE`` equals the world size). Each rank then creates
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (66 MiB) and opens every peer's
file, retrying for as long as it does not exist yet. DeepSpeed never unlinks them: each job leaves one such file
per rank in RAM-backed ``/dev/shm`` until the machine reboots.

Two points are safe to remove them:

- once every rank has opened every peer's file (:func:`unlink_own_buffer_after_attach`, which ``ds_hecate.initialize``
  calls): the names go, the mappings stay, so the all-reduce works on and the kernel frees the memory when the last
  rank exits, however it exits (a normal end, an exception, a kill). Earlier, a peer still opening the file would
  retry forever.
- once every process of the job has ended (:func:`remove_job_buffers`, what ``ds_hecate.tools.launch`` does after
  DeepSpeed's launcher returns): this also covers ranks killed before they attached.

Both touch only their own job's files: the user id, the master address and the master port name the job, and no two
live jobs share a master address and port (the job's store listens on it).
"""
from __future__ import annotations

import os
from typing import List, Optional, Union

import torch.distributed as dist

#: where POSIX shared memory lives on Linux (``shm_open`` names are files there)
SHM_DIR = "/dev/shm"
#: DeepSpeed's ``SHM_BUFFER_NAME``; the full name adds ``_<uid>_<master addr>_<master port>_<rank>``
BUFFER_NAME = "deepspeed_allreduce_buffer"


def job_buffer_prefix(master_addr: str, master_port: Union[int, str], uid: Optional[int] = None) -> str:
    """The name of a job's buffers up to the rank: ``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_``."""
    return f"{BUFFER_NAME}_{os.getuid() if uid is None else uid}_{master_addr}_{master_port}_"


def job_buffers(master_addr: str, master_port: Union[int, str], uid: Optional[int] = None) -> List[str]:
    """Paths of the job's buffers now in ``/dev/shm``, by rank: the prefix followed by a rank number and nothing else
    (so port 2950 never matches port 29500's files)."""
    prefix = job_buffer_prefix(master_addr, master_port, uid)
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    ranks = sorted(int(n[len(prefix):]) for n in names if n.startswith(prefix) and n[len(prefix):].isdigit())
    return [os.path.join(SHM_DIR, f"{prefix}{rank}") for rank in ranks]


def remove_job_buffers(master_addr: str, master_port: Union[int, str]) -> List[str]:
    """Unlink this user's buffers of the job named by ``master_addr`` and ``master_port``; returns the paths removed.
    Call it once no rank of the job can still be opening them (the job has ended)."""
    removed = []
    for path in job_buffers(master_addr, master_port):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:   # another cleanup came first
            pass
    return removed


def creates_buffers(world_size: int) -> bool:
    """Whether DeepSpeed's shared-memory all-reduce serves this job: the CPU accelerator, and every rank on this
    machine (shm.cpp's test: ``LOCAL_SIZE`` equals the world size). Every rank of a job answers alike."""
    from deepspeed.accelerator import get_accelerator

    local = os.environ.get("LOCAL_SIZE", "").strip()
    return get_accelerator().device_name() == "cpu" and local.isdigit() and int(local) == world_size


def unlink_own_buffer_after_attach() -> bool:
    """Wait until every rank has started DeepSpeed's backend, then unlink this rank's buffer; True if it did.

    Collective over the world when :func:`creates_buffers` (a barrier: each rank's ``init_distributed`` returns only
    once it has opened every peer's buffer, so past the barrier nobody opens one again; DeepSpeed sets the
    all-reduce up once per process). Call it on every rank after ``deepspeed.init_distributed``. Without the
    buffers it issues nothing."""
    if not dist.is_initialized() or not creates_buffers(dist.get_world_size()):
        return False
    dist.barrier()
    own = os.path.join(SHM_DIR, job_buffer_prefix(os.environ.get("MASTER_ADDR", ""),
                                                  os.environ.get("MASTER_PORT", "")) + str(dist.get_rank()))
    try:
        os.unlink(own)
    except FileNotFoundError:   # the op was not built here, or a launcher's cleanup came first
        return False
    return True
