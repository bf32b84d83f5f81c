"""An unmodified DeepSpeed-MoE training script (deepspeed.moe.layer.MoE + deepspeed.initialize, plus
``import ds_hecate``), started with the ``deepspeed`` launcher on 2 CPU ranks, trains with Hecate and matches the
same script without Hecate."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]


def _launch(config: str, log_file: Path, hecate_import: bool, steps: int = 6) -> str:
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           str(ROOT / "examples" / "train_gpt_moe.py"), "--deepspeed_config", str(ROOT / "ds_configs" / config),
           "--steps", str(steps), "--log-file", str(log_file)]
    if not hecate_import:
        cmd.append("--no-hecate-import")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def test_deepspeed_launcher_trains_unmodified_script_with_hecate(tmp_path):
    out = _launch("ds_hecate.json", tmp_path / "hecate.json", hecate_import=True)
    took_over = [line for line in out.splitlines() if "[ds_hecate] Hecate took over" in line]
    assert len(took_over) == 1, out[-3000:]  # one line, from rank 0
    assert "2 MoE layer(s) with 16 experts" in took_over[0]
    baseline_out = _launch("ds_baseline.json", tmp_path / "baseline.json", hecate_import=False)
    assert "Hecate took over" not in baseline_out
    hecate = json.loads((tmp_path / "hecate.json").read_text())
    baseline = json.loads((tmp_path / "baseline.json").read_text())
    assert len(hecate) == len(baseline) == 6
    for h, b in zip(hecate, baseline):
        assert abs(h["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (h, b)


def _run(cmd, tmp_path, env=None) -> str:
    environment = dict(os.environ, OMP_NUM_THREADS="1",
                       PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    proc = subprocess.run(cmd, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "[ds_hecate] Hecate took over" in output, output[-3000:]
    return output


def test_torchrun_and_mpirun_train_like_the_deepspeed_launcher(tmp_path):
    import shutil

    script = str(ROOT / "examples" / "train_gpt_moe.py")
    args = ["--deepspeed_config", str(ROOT / "ds_configs" / "ds_hecate.json"), "--steps", "4"]
    reference = tmp_path / "deepspeed.json"
    _launch("ds_hecate.json", reference, hecate_import=True, steps=4)
    logs = {}
    logs["torchrun"] = tmp_path / "torchrun.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
          script, *args, "--log-file", str(logs["torchrun"])], tmp_path)
    mpirun = shutil.which("mpirun")
    assert mpirun is not None, "mpirun not found: `pip install mpich mpi4py` (requirements.txt) provides it"
    logs["mpirun"] = tmp_path / "mpirun.json"
    _run([mpirun, "-n", "2", sys.executable, script, *args, "--log-file", str(logs["mpirun"])], tmp_path,
         env={"MASTER_PORT": str(free_port())})
    expected = [r["loss"] for r in json.loads(reference.read_text())]
    for launcher, log in logs.items():
        got = [r["loss"] for r in json.loads(log.read_text())]
        assert got == expected, (launcher, got, expected)
