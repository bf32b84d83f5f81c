"""Hugging Face Trainer + DeepSpeed + Hecate on tiny random transformers MoE models (2 CPU ranks, no downloads).

One spawned 2-rank job runs every Trainer run (tests/hf_trainer.py); the tests below check its results, and the
saved / exported checkpoints are reloaded here, in a single process, with ``from_pretrained``.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List, Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_ranks  # noqa: E402
from hf_trainer import run_cases  # noqa: E402

# (name, model, stage, options): each runs with plain DeepSpeed and with Hecate
PAIRS: List[Tuple[str, str, int, Dict[str, Any]]] = [
    ("mixtral_z2", "mixtral", 2, dict(gas=2, save_steps=5)),
    ("mixtral_z3", "mixtral", 3, dict(gas=2, grad_ckpt=True, save_steps=10)),
    ("qwen3_z2", "qwen3_moe", 2, dict(ds_optimizer=False)),
    ("qwen3_z3", "qwen3_moe", 3, dict(grad_ckpt=True)),
    ("olmoe_z2", "olmoe", 2, dict(steps=2)),
    ("qwen2_z3", "qwen2_moe", 3, dict(steps=2)),
    ("dsv3_z2", "deepseek_v3", 2, dict(steps=2)),
]
SAVED = {"mixtral_z2", "mixtral_z3", "qwen3_z3"}


def _cases():
    cases = []
    for name, model, stage, opts in PAIRS:
        for hecate in (False, True):
            case: Dict[str, Any] = dict(name=f"{name}_{'hecate' if hecate else 'plain'}", model=model, stage=stage,
                                        hecate=hecate, **opts)
            if hecate and name in SAVED:
                case["save"] = True
            cases.append(case)
    # Resumed from the Trainer checkpoint the Hecate run wrote at step 5 (`resume_from_checkpoint`).
    for case in cases:
        if case["name"] == "mixtral_z2_hecate":
            case["final_state"] = True
            cases.append(dict(case, name="mixtral_z2_resumed", resume_from=("mixtral_z2_hecate", 5), save=False))
            break
    cases.append(dict(name="llama_error", model="llama", stage=2, hecate=True, steps=1, expect_error=True))
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("hf"))
    cases = _cases()
    results = run_ranks(2, run_cases, cases, workdir, timeout=600)[0]
    return {c["name"]: r for c, r in zip(cases, results)}, workdir


def _max_rel(a, b):
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize("name", [p[0] for p in PAIRS])
def test_loss_log_matches_plain_deepspeed(runs, name):
    results, _ = runs
    plain, hecate = results[f"{name}_plain"], results[f"{name}_hecate"]
    assert hecate["hecate_layers"], "Hecate took no experts module over"
    assert all(n.endswith(".mlp.experts") for n in hecate["hecate_layers"])  # shared experts stay dense
    steps = next(p[3].get("steps", 10) for p in PAIRS if p[0] == name)
    assert len(hecate["loss"]) == steps
    loss_rel, norm_rel = _max_rel(hecate["loss"], plain["loss"]), _max_rel(hecate["grad_norm"], plain["grad_norm"])
    print(f"{name}: max relative loss diff {loss_rel:.2e}, grad-norm diff {norm_rel:.2e} over {steps} step(s)")
    assert loss_rel < 1e-5
    assert norm_rel < 1e-5
    # Parameter counts reported to the user include the experts Hecate holds.
    assert hecate["num_parameters"] == plain["num_parameters"] == hecate["ds_hecate_num_parameters"]
    assert hecate["trainer_param_count"] == plain["trainer_param_count"] == plain["num_parameters"]
    # ... while DeepSpeed itself sees no routed-expert parameter at all (the plain run's engine does).
    assert hecate["expert_params_seen_by_deepspeed"] == [] and plain["expert_params_seen_by_deepspeed"]


def test_deepseek_and_qwen2_keep_shared_experts_dense(runs):
    results, _ = runs
    assert results["dsv3_z2_hecate"]["hecate_layers"] == ["model.layers.1.mlp.experts"]  # layer 0 is dense
    assert len(results["qwen2_z3_hecate"]["hecate_layers"]) == 2


def _check_reload(directory, result, config_name):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=result["probe"]).logits
    torch.testing.assert_close(logits, result["logits"], rtol=1e-5, atol=1e-5)
    params = dict(model.named_parameters())
    assert result["experts"], config_name
    for key, value in result["experts"].items():
        assert key in params, f"{config_name}: expert tensor {key} missing after reload"
        assert torch.equal(params[key].detach(), value), f"{config_name}: {key} differs from the consolidated shards"
    assert model.num_parameters() == result["num_parameters"]


@pytest.mark.parametrize("name", sorted(SAVED))
def test_save_model_reloads_with_every_expert(runs, name):
    results, _ = runs
    result = results[f"{name}_hecate"]
    _check_reload(result["save_dir"], result, name)


@pytest.mark.parametrize("name", ["mixtral_z2", "mixtral_z3"])
def test_export_hf_from_trainer_checkpoint(runs, name, tmp_path, capsys):
    from ds_hecate.tools.cli import main

    results, workdir = runs
    result = results[f"{name}_hecate"]
    checkpoint = os.path.join(workdir, f"{name}_hecate", "checkpoint-10")
    out = str(tmp_path / "hf")
    assert main(["export-hf", checkpoint, "-o", out]) == 0
    assert any(f.endswith(".safetensors") for f in os.listdir(out))
    _check_reload(out, result, f"{name} export")
    # A checkpoint with an expert file removed fails, naming the layer and the expert.
    broken = str(tmp_path / "broken")
    shutil.copytree(checkpoint, broken)
    tag = open(os.path.join(broken, "latest")).read().strip()
    os.remove(os.path.join(broken, tag, "hecate", "layer001_expert00002.pt"))
    capsys.readouterr()
    assert main(["export-hf", broken, "-o", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert "expert 2 of MoE layer 'model.layers.1.mlp.experts'" in err


def test_trainer_resume_from_checkpoint_is_exact(runs):
    """`Trainer.train(resume_from_checkpoint=...checkpoint-5)` on a Hecate run continues exactly as the run that
    never stopped: the same loss, grad-norm and learning-rate log for steps 6-10, the same final weights (dense and
    every expert's fp32 master), bit for bit. (The checkpoint comes after Hecate's last cost profiling, at step 4,
    so both runs plan with the same measured costs.)"""
    results, _ = runs
    straight, resumed = results["mixtral_z2_hecate"], results["mixtral_z2_resumed"]
    # the resumed log starts with the checkpoint's history of steps 1-5 (trainer_state.json)
    assert straight["steps"] == resumed["steps"] == list(range(1, 11)), resumed["steps"]
    for key in ("loss", "grad_norm", "learning_rate"):
        assert resumed[key][5:] == straight[key][5:], (key, resumed[key], straight[key])
    assert resumed["dense"].keys() == straight["dense"].keys()
    for name, value in straight["dense"].items():
        assert torch.equal(value, resumed["dense"][name]), name
    assert straight["expert_masters"] and resumed["expert_masters"].keys() == straight["expert_masters"].keys()
    for name, value in straight["expert_masters"].items():
        assert torch.equal(value, resumed["expert_masters"][name]), name


def test_model_without_moe_block_fails_with_docs_pointer(runs):
    results, _ = runs
    error = results["llama_error"]["error"]
    assert "LlamaForCausalLM" in error and "docs/huggingface.md" in error


def test_registering_an_architecture(runs):
    """The documented few-line registration makes a renamed experts class convertible (detection by class)."""
    from ds_hecate.hf import MoEArchitecture, architecture_of, register_architecture
    from ds_hecate.hf.registry import ARCHITECTURES
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class MyExperts(torch.nn.Module):
        pass

    assert architecture_of(MyExperts()) is None
    try:
        register_architecture(MoEArchitecture(name="my_moe", experts_classes=("MyExperts",)))
        mine = architecture_of(MyExperts())
        assert mine is not None and mine.name == "my_moe"
    finally:
        ARCHITECTURES.pop("my_moe", None)
    preset = architecture_of(MixtralExperts.__new__(MixtralExperts))
    assert preset is not None and preset.name == "mixtral"  # AutoEP preset name
