"""Set-up errors are said once per job (issue 43): a misspelled hecate key in a 2-rank launched job (RANK/WORLD_SIZE
set, as the deepspeed launcher and torchrun set them) fails in deepspeed.initialize before any DeepSpeed set-up, with
one message from rank 0 naming the key and the one meant, no traceback, every rank exiting with status 1; a single
process keeps Python's ordinary exception."""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import time
started = time.time()
import torch, deepspeed, ds_hecate
from deepspeed.moe.layer import MoE
model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(8, torch.nn.Linear(8, 8), num_experts=2))
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 1, "hecate": {"enabled": True, "materialise_budget_mb": 64}}}
before = time.time()
try:
    deepspeed.initialize(model=model, config=config)
finally:
    print(f"initialize took {time.time() - before:.3f} s", flush=True)
"""
NEEDLE = "unknown key 'zero_optimization.hecate.materialise_budget_mb' (did you mean 'materialize_budget_mb'?)"


def _start(env_extra: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **env_extra})
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_a_config_error_is_reported_once_per_job_without_traceback():
    procs = [_start({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}) for r in range(2)]
    single = _start({})
    outs = [p.communicate(timeout=180) for p in procs]
    single_out, single_err = single.communicate(timeout=180)
    assert [p.returncode for p in procs] == [1, 1], outs
    errs = [err for _, err in outs]
    assert sum(err.count(NEEDLE) for err in errs) == 1, errs
    assert errs[0].count("ds_hecate: error: invalid hecate config") == 1, errs[0]
    assert NEEDLE not in errs[1], errs[1]
    assert not any("Traceback" in err for err in errs), errs
    for stdout, _ in outs:   # before DeepSpeed's set-up: initialize returned at once
        took = float(stdout.split("initialize took ")[1].split(" s")[0])
        assert took < 5.0, stdout
    # one process: Python's ordinary report
    assert single.returncode == 1 and "Traceback" in single_err and NEEDLE in single_err, single_err
