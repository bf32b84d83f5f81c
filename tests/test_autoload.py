"""Automatic activation, the way users meet it: ds_hecate installed non-editable into a fresh venv, then scripts
that never import ds_hecate, each started by a launcher, each with a config holding ``zero_optimization.hecate``.

- `make demo`'s script with its own import switched off (a plain ``import deepspeed``), under the ``deepspeed``
  launcher: trains, and says so once, without torch's all-gather FutureWarning;
- a DeepSpeed-MoE script that first probes for DeepSpeed (``importlib.util.find_spec``, ``importlib.metadata``,
  ``pkgutil``) and then imports a submodule first (``deepspeed.accelerator``), under the ``deepspeed`` launcher;
- a Hugging Face Trainer script that imports transformers first (transformers and accelerate probe for DeepSpeed
  with ``find_spec``), under the ``deepspeed`` launcher with ``--deepspeed ds.json``;
- the same Trainer script under ``accelerate launch`` with an accelerate config naming a DeepSpeed config file.

Each must report that Hecate took over. ``DS_HECATE_AUTOLOAD=0`` switches activation off (DeepSpeed then rejects
the key, loudly), a ds_hecate that fails to import leaves DeepSpeed usable, and a process that never imports
DeepSpeed pays only for the small standard-library hook.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

from dist_utils import free_port
from venv_utils import chained_venv

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "autoload_scripts"
TIMEOUT_S = 300  # one launch; a hang fails the test instead of eating CI

# What Hugging Face users write: "auto" where the Trainer fills values in; the one addition is the hecate key.
HF_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto", "torch_adam": True}},
    "zero_optimization": {"stage": 2, "hecate": {"enabled": True}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with ds_hecate installed as a user installs it (not editable). Chained to the interpreter
    running the tests (a venv's, a conda env's or the base's): DeepSpeed, torch and transformers come from there."""
    python = chained_venv(tmp_path_factory.mktemp("venv") / "env")
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python


def _never_imports_ds_hecate(script: Path) -> None:
    """The scripts must not do the hook's work themselves (a docstring may name ds_hecate, code may not)."""
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        assert not any(n.split(".")[0] == "ds_hecate" for n in names), f"{script.name} imports ds_hecate"


def _run(cmd: List[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Run outside the checkout (cwd, no PYTHONPATH), so only the installed copy can be imported."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environment.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", **env)
    return subprocess.run(cmd, cwd=cwd, env=environment, capture_output=True, text=True, timeout=TIMEOUT_S)


def _deepspeed(python: Path, cwd: Path, script: str, *args: str, ranks: int = 2,
               **env: str) -> subprocess.CompletedProcess:
    _never_imports_ds_hecate(SCRIPTS / script)
    return _run([str(python), "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
                 str(free_port()), str(SCRIPTS / script), *args], cwd, **env)


def _took_over(proc: subprocess.CompletedProcess, layers: int) -> str:
    """Trained, and said so once (rank 0's log line) without DeepSpeed's all-gather FutureWarning on every rank."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    took_over = [line for line in out.splitlines() if "Hecate took over" in line]
    assert len(took_over) == 1, out[-3000:]
    assert took_over[0].startswith(f"[ds_hecate] Hecate took over {layers} MoE layer(s)"), took_over
    assert "all_gather_into_tensor` is deprecated" not in out, out[-3000:]
    return out


def test_demo_script_trains_with_hecate_without_an_import(venv, tmp_path):
    """`make demo`'s script with its own ds_hecate import switched off: a plain `import deepspeed` script."""
    cmd = [str(venv), "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           str(ROOT / "examples" / "train_gpt_moe.py"), "--deepspeed_config",
           str(ROOT / "ds_configs" / "ds_hecate.json"), "--no-hecate-import", "--steps", "2"]
    out = _took_over(_run(cmd, tmp_path), layers=2)
    assert "hecate: on" in out, out[-3000:]


def test_script_probing_for_deepspeed_first_trains_with_hecate(venv, tmp_path):
    proc = _deepspeed(venv, tmp_path, "probe_first.py", "--deepspeed_config",
                      str(ROOT / "ds_configs" / "ds_hecate.json"))
    out = _took_over(proc, layers=1)
    assert "autoload probe: loaded after probing []" in out, out[-3000:]  # probing imported nothing heavy
    assert "autoload probe: engine.hecate=yes" in out, out[-3000:]
    # The installed copy did it, not the checkout.
    where = _run([str(venv), "-c", "import ds_hecate; print(ds_hecate.__file__)"], tmp_path)
    assert str(venv.parent.parent) in where.stdout, where.stdout + where.stderr


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = tmp_path_factory.mktemp("hf") / "ds.json"
    path.write_text(json.dumps(HF_DS_CONFIG), encoding="utf-8")
    return path


def _half_precision() -> Tuple[str, str]:
    """(the Trainer's switch, Hecate's compute dtype): fp16 as run_clm.py users switch it on, where DeepSpeed accepts
    it; on a CPU without native fp16 matmul (its capability probe, mkldnn fp16) DeepSpeed refuses fp16 for any
    script, so bf16, the other "auto" half precision, which every CPU DeepSpeed runs on accepts."""
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        native = False
    return ("--fp16", "float16") if native or torch.cuda.is_available() else ("--bf16", "bfloat16")


def test_trainer_script_importing_transformers_first_trains_with_hecate(venv, hf_config, tmp_path):
    # half precision as run_clm.py users switch it on (--fp16 / --bf16, "auto" in the config); docs/huggingface.md
    # says it runs.
    switch, dtype = _half_precision()
    proc = _deepspeed(venv, tmp_path, "trainer_script.py", "--deepspeed", str(hf_config), switch)
    out = _took_over(proc, layers=2)
    assert f"compute dtype={dtype}" in out, out[-3000:]
    assert "autoload trainer: engine.hecate=yes steps=2" in out, out[-3000:]


def test_trainer_script_under_accelerate_launch_trains_with_hecate(venv, hf_config, tmp_path):
    # accelerate refuses mixed_precision & co. next to deepspeed_config_file (the JSON file owns them). On a
    # CPU-only machine the script's TrainingArguments(use_cpu=True) puts the ranks on the CPU, over gloo.
    accelerate_config = tmp_path / "accelerate.yaml"
    accelerate_config.write_text("\n".join([
        "compute_environment: LOCAL_MACHINE", "distributed_type: DEEPSPEED", "deepspeed_config:",
        f"  deepspeed_config_file: {hf_config}", "  zero3_init_flag: false", "num_machines: 1",
        "machine_rank: 0", "num_processes: 2", f"main_process_port: {free_port()}", "use_cpu: false", ""]),
        encoding="utf-8")
    _never_imports_ds_hecate(SCRIPTS / "trainer_script.py")
    proc = _run([str(venv), "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config),
                 str(SCRIPTS / "trainer_script.py")], tmp_path)
    out = _took_over(proc, layers=2)
    assert "autoload trainer: engine.hecate=yes steps=2" in out, out[-3000:]


def test_switch_off_makes_deepspeed_reject_the_key(venv, tmp_path):
    proc = _deepspeed(venv, tmp_path, "probe_first.py", "--deepspeed_config",
                      str(ROOT / "ds_configs" / "ds_hecate.json"), ranks=1, DS_HECATE_AUTOLOAD="0")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "extra_forbidden" in out and "hecate" in out and "Hecate took over" not in out, out[-3000:]


def test_a_failing_ds_hecate_import_leaves_deepspeed_usable(venv, tmp_path):
    """DeepSpeed must keep working for runs without Hecate when ds_hecate cannot be imported; a warning names why."""
    broken = tmp_path / "broken" / "ds_hecate"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('planted for the test')\n", encoding="utf-8")
    proc = _run([str(venv), "-c", "import deepspeed; print('deepspeed', deepspeed.__version__)"], tmp_path,
                PYTHONPATH=str(broken.parent))
    assert proc.returncode == 0 and "deepspeed " in proc.stdout, proc.stderr[-3000:]
    assert "ds_hecate_autoload: `import ds_hecate` failed" in proc.stderr and "planted for the test" in proc.stderr


def test_costs_only_the_standard_library_hook_without_deepspeed(venv, tmp_path):
    probe = ("import sys; print(sorted(m for m in ('torch', 'deepspeed', 'ds_hecate', 'pydantic', 'numpy') "
             "if m in sys.modules))")
    proc = _run([str(venv), "-c", probe], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == "[]"
    # What the hook itself imports, measured from a bare interpreter (-S: no site, no .pth files).
    purelib = _run([str(venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path)
    bare = ("import sys; before = set(sys.modules); sys.path.insert(0, sys.argv[1]); import ds_hecate_autoload; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    proc = _run([str(venv), "-S", "-c", bare, purelib.stdout.strip()], tmp_path)
    assert proc.returncode == 0, proc.stderr
    stdlib = getattr(sys, "stdlib_module_names", None)
    if stdlib is not None:  # Python 3.10+
        foreign = [m for m in proc.stdout.split() if m != "ds_hecate_autoload" and m.split(".")[0] not in stdlib]
        assert foreign == [], foreign
