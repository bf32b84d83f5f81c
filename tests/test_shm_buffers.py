"""DeepSpeed's CPU all-reduce buffers (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, 66 MiB
per rank, never unlinked by DeepSpeed) do not outlive the jobs the project launches (issue 58).

- A 2-rank job started by ``ds_hecate.tools.launch`` (what ``make demo`` and the benchmarks run) whose rank 1 is
  killed after both created their buffers: DeepSpeed's launcher survives and stops rank 0, and afterwards no buffer
  of that job's master port is left.
- ``ds_hecate.initialize`` with Hecate enabled unlinks the job's buffers once every rank has opened them: none is
  left in ``/dev/shm`` while the job still runs (so none can outlive it, however it ends), and DeepSpeed's
  shared-memory all-reduce still adds up right on the unlinked buffers.

- ``make demo`` runs its job through that launcher (read with ``make -n``, which runs nothing).

The names are matched here by the literal pattern, not by ds_hecate's helper, so a wrong name there fails here.
Cost: the launch 10-15 s (DeepSpeed's runner, its launch.py and the two ranks each import DeepSpeed), the initialize
a few seconds, ``make -n`` nothing.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List

from dist_utils import free_port, run_ranks
from moe_training import Spec, TinyMoE, ds_config

ROOT = Path(__file__).resolve().parents[1]

#: a rank of the launched job: start DeepSpeed's backend (each rank creates its buffer and opens its peer's), write
#: the job's buffers it sees, then rank 1 is killed and rank 0 waits for DeepSpeed's launcher to stop it
KILLED_RANK_SCRIPT = """
import os, signal, sys, time
import deepspeed
import deepspeed.comm as dist

deepspeed.init_distributed(dist_backend="gloo")
dist.barrier()
rank = dist.get_rank()
prefix = "deepspeed_allreduce_buffer_%d_%s_%s_" % (os.getuid(), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
with open(os.path.join(os.environ["SHM_TEST_OUT"], "rank%d.txt" % rank), "w") as f:
    f.write("\\n".join(sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))))
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""


def _buffers_of(port: int) -> List[str]:
    return sorted(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"))


def test_launch_removes_its_jobs_buffers_after_a_killed_rank(tmp_path):
    from ds_hecate.tools.launch import run

    script = tmp_path / "killed_rank.py"
    script.write_text(KILLED_RANK_SCRIPT)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", SHM_TEST_OUT=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    status = run(["--num_gpus", "2", "--master_port", str(port), str(script)], env=env, cwd=str(ROOT))
    seen = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(2)]
    expected = [f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{r}" for r in range(2)]
    assert seen == [expected, expected]   # the job made them: the check below is not vacuous
    assert status != 0                    # rank 1 was killed; DeepSpeed's launcher reports it
    assert _buffers_of(port) == []


def _hecate_job(rank: int, world: int) -> dict:
    import deepspeed
    import torch

    import ds_hecate  # noqa: F401

    deepspeed.init_distributed(dist_backend="gloo")
    port = int(os.environ["MASTER_PORT"])
    out: Dict[str, Any] = {"created": [os.path.basename(p) for p in _buffers_of(port)]}
    spec = Spec(num_experts=4, layers=1)
    deepspeed.initialize(model=TinyMoE(spec), config=ds_config(replace(spec, hecate={"enabled": True})))
    torch.distributed.barrier()   # both ranks are past initialize
    out["left"] = _buffers_of(port)
    x = torch.full((4096,), float(rank + 1))
    deepspeed.comm.inference_all_reduce(x)
    from deepspeed.comm import comm
    out["sum"] = x.unique().tolist()
    out["shm_kernel_level"] = getattr(comm.cdb, "shm_vector_kernel_level", 0)
    return out


def test_hecate_initialize_unlinks_the_jobs_buffers_once_every_rank_attached(monkeypatch):
    monkeypatch.setenv("LOCAL_SIZE", "2")   # as DeepSpeed's launcher sets it: every rank here, shm all-reduce on
    for out in run_ranks(2, _hecate_job):
        assert [n.rsplit("_", 1)[1] for n in out["created"]] == ["0", "1"], out
        assert out["left"] == [], out
        assert out["sum"] == [3.0], out
    print("shm kernel level", out["shm_kernel_level"], "(>= 1: the all-reduce ran on the unlinked buffers)")


def test_make_demo_goes_through_the_cleaning_launcher():
    """``make demo`` itself installs, so only its commands are read here (``make -n`` runs nothing)."""
    commands = subprocess.run(["make", "-n", "demo", f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
    assert f"{sys.executable} -m ds_hecate.tools.launch --num_gpus 2" in commands, commands
    assert "deepspeed.launcher.runner" not in commands, commands
