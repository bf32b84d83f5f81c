"""Automatic activation: after `pip install .`, a script that never imports ds_hecate, launched with the `deepspeed`
launcher and a config holding `zero_optimization.hecate`, trains with Hecate. It costs nothing for processes that
never import deepspeed, and DS_HECATE_AUTOLOAD=0 switches it off (DeepSpeed then rejects the key, loudly)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dist_utils import free_port
from venv_utils import chained_venv

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    # Chained to the interpreter running the tests (a venv's, a conda env's or the base's): DeepSpeed and torch
    # come from there, ds_hecate is installed into the scratch venv itself.
    python = chained_venv(tmp_path_factory.mktemp("venv") / "env")
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python


def _launch(python: Path, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    cmd = [str(python), "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           str(ROOT / "examples" / "train_gpt_moe.py"),
           "--deepspeed_config", str(ROOT / "ds_configs" / "ds_hecate.json"),
           "--no-hecate-import", "--steps", "3"]
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environment.update(OMP_NUM_THREADS="1", **env)
    return subprocess.run(cmd, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)


def test_installed_package_activates_hecate_without_an_import(venv, tmp_path):
    proc = _launch(venv, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[ds_hecate] Hecate took over 2 MoE layer(s)" in out, out[-3000:]
    # The installed copy did it, not the checkout.
    where = subprocess.run([str(venv), "-c", "import ds_hecate; print(ds_hecate.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert str(venv.parent.parent) in where.stdout, where.stdout


def test_switch_off_makes_deepspeed_reject_the_key(venv, tmp_path):
    proc = _launch(venv, tmp_path, DS_HECATE_AUTOLOAD="0")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "extra_forbidden" in out and "Hecate took over" not in out, out[-3000:]


def test_costs_nothing_without_deepspeed(venv, tmp_path):
    probe = ("import sys; print(sorted(m for m in ('torch', 'deepspeed', 'ds_hecate', 'pydantic') "
             "if m in sys.modules))")
    proc = subprocess.run([str(venv), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == "[]"
