"""Checkpoints keep every expert: exact resume, loading at another world size, and refusing (on every rank, before
anything is loaded) a checkpoint whose expert files are missing, truncated or hostile."""
from __future__ import annotations

import os
import pickle
from dataclasses import replace

import pytest
import torch

from dist_utils import run_ranks
from moe_training import Spec, run_specs

HOT = (3.0, 3.0) + (0.0,) * 6
SCHEDULED = Spec(steps=10, gate_bias=HOT, reseed_each_step=True,
                 hecate={"enabled": True, "placement": "hecate", "overlap_degree": 1, "reshard_interval": 3})


def test_resume_is_bitwise_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = run_specs(2, [replace(SCHEDULED, save_after=6, ckpt_dir=ckpt)])[0]
    assert straight[0]["hecate_stats"]["reshards"] >= 1
    assert open(os.path.join(ckpt, "latest")).read().strip() == "global_step6"
    files = os.listdir(os.path.join(ckpt, "global_step6", "hecate"))
    assert "meta.json" in files and sum(f.endswith(".pt") for f in files) == 2 * 8  # every expert, once
    resumed = run_specs(2, [replace(SCHEDULED, resume_from=ckpt)])[0]
    for rank in range(2):
        assert resumed[rank]["losses"] == straight[rank]["losses"][6:], rank
        assert resumed[rank]["norms"] == straight[rank]["norms"][6:], rank
        for name, value in straight[rank]["dense"].items():
            assert torch.equal(value, resumed[rank]["dense"][name]), name
        for name, value in straight[rank]["experts"].items():
            assert torch.equal(value, resumed[rank]["experts"][name]), name


def test_load_at_another_world_size_reshards_experts(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_specs(2, [replace(SCHEDULED, steps=4, save_after=4, ckpt_dir=ckpt)])[0]
    on_one = run_specs(1, [replace(SCHEDULED, steps=0, resume_from=ckpt, load_module_only=True)])[0][0]
    assert on_one["hecate_stats"]["layers"][0]["owned_experts"] == list(range(8))
    for name, value in saved[0]["experts"].items():
        assert torch.equal(value, on_one["experts"][name]), name
    for name, value in saved[0]["dense"].items():
        assert torch.equal(value, on_one["dense"][name]), name


class _Payload:
    """Unpickling this would create a marker file: a stand-in for code execution."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _load_broken(rank: int, world: int, ckpt: str) -> dict:
    """Load a damaged checkpoint; report the error and whether any weight changed."""
    import deepspeed

    from ds_hecate import HecateError
    from moe_training import TinyMoE, ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    spec = replace(SCHEDULED, steps=0)
    torch.manual_seed(spec.seed)
    engine, *_ = deepspeed.initialize(model=TinyMoE(spec), model_parameters=None, config=ds_config(spec))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    experts_before = engine.hecate.full_expert_weights()
    try:
        engine.load_checkpoint(ckpt)
        message = "NO ERROR"
    except HecateError as exc:
        message = str(exc)
    unchanged = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    experts_after = engine.hecate.full_expert_weights()
    unchanged &= all(torch.equal(experts_before[k], experts_after[k]) for k in experts_before)
    return {"message": message, "unchanged": unchanged}


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "run")
    run_specs(2, [replace(SCHEDULED, steps=2, save_after=2, ckpt_dir=ckpt)])
    return os.path.join(ckpt, "global_step2", "hecate")


@pytest.mark.parametrize("damage", ["missing", "truncated", "pickle-payload", "wrong-shape", "no-optimizer-state"])
def test_damaged_expert_file_fails_everywhere_naming_it(saved_checkpoint, tmp_path, damage):
    import shutil
    ckpt = str(tmp_path / "run")
    shutil.copytree(os.path.dirname(os.path.dirname(saved_checkpoint)), ckpt)
    target = os.path.join(ckpt, "global_step2", "hecate", "layer001_expert00005.pt")
    marker = str(tmp_path / "executed")
    if damage == "missing":
        os.remove(target)
    elif damage == "truncated":
        data = open(target, "rb").read()
        open(target, "wb").write(data[: len(data) // 2])
    elif damage == "pickle-payload":
        with open(target, "wb") as f:
            pickle.dump({"master": _Payload(marker), "state": {}}, f)
    elif damage == "wrong-shape":
        torch.save({"master": torch.zeros(3), "state": {}}, target)
    else:  # its weights intact, its Adam moments and step gone: loading would silently restart them
        blob = torch.load(target, weights_only=True)
        torch.save({"master": blob["master"], "state": {}}, target)
    results = run_ranks(2, _load_broken, ckpt)
    for r in results:
        assert "expert 5 of MoE layer 'blocks.1.moe'" in r["message"], r["message"]
        if damage == "no-optimizer-state":
            assert "no optimizer state ['exp_avg', 'exp_avg_sq', 'step']" in r["message"], r["message"]
        assert r["unchanged"], "a failed load must not change any weight"
    assert not os.path.exists(marker), "loading executed code from a checkpoint file"


def test_consolidated_fp32_state_dict_equals_the_live_model(tmp_path):
    import subprocess
    import sys

    from moe_training import TinyMoE

    ckpt = str(tmp_path / "ckpt")
    spec = replace(SCHEDULED, steps=4, save_after=4, ckpt_dir=ckpt)
    live = run_specs(2, [spec])[0][0]
    outputs = {}
    for layout in ("hecate", "deepspeed"):
        out = str(tmp_path / f"{layout}.pt")
        proc = subprocess.run([sys.executable, "-m", "ds_hecate.tools.cli", "consolidate", ckpt, "--layout", layout,
                               "-o", out], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "64 expert tensors" in proc.stdout, proc.stdout  # 2 layers x 8 experts x 4 tensors
        outputs[layout] = torch.load(out, weights_only=True)
    consolidated = outputs["hecate"]
    for name, value in live["dense"].items():
        assert torch.equal(consolidated[name], value), name
    for layer, full in live["experts"].items():
        for e in range(full.shape[0]):
            ordered = torch.cat([consolidated[f"{layer}.experts.{e}.{p}"].reshape(-1)
                                 for p in ("0.weight", "0.bias", "2.weight", "2.bias")])
            assert torch.equal(ordered, full[e]), (layer, e)
    # The DeepSpeed layout loads strictly into the unconverted model the user built.
    model = TinyMoE(replace(spec, hecate=None))
    model.load_state_dict(outputs["deepspeed"], strict=True)
    assert torch.equal(model.blocks[1].moe.deepspeed_moe.experts.deepspeed_experts[5][2].bias,
                       outputs["deepspeed"]["blocks.1.moe.deepspeed_moe.experts.deepspeed_experts.5.2.bias"])


def _load_each(rank: int, world: int, ckpts: list) -> list:
    """Try to load each damaged checkpoint in turn on one engine; report the errors and whether anything changed."""
    import deepspeed

    from ds_hecate import HecateError
    from moe_training import TinyMoE, ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    spec = replace(SCHEDULED, steps=0)
    torch.manual_seed(spec.seed)
    engine, *_ = deepspeed.initialize(model=TinyMoE(spec), model_parameters=None, config=ds_config(spec))
    before = engine.hecate.full_expert_weights()
    messages = []
    for ckpt in ckpts:
        try:
            engine.load_checkpoint(ckpt)
            messages.append("NO ERROR")
        except HecateError as exc:
            messages.append(str(exc))
    after = engine.hecate.full_expert_weights()
    return {"messages": messages, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def test_pickle_payload_in_place_of_each_hecate_file_is_refused_unexecuted(saved_checkpoint, tmp_path):
    import shutil
    source = os.path.dirname(os.path.dirname(saved_checkpoint))
    names = sorted(os.listdir(saved_checkpoint))
    assert "meta.json" in names and len(names) == 1 + 2 * 8
    ckpts, markers = [], []
    for i, name in enumerate(names):
        ckpt = str(tmp_path / f"run{i}")
        shutil.copytree(source, ckpt)
        markers.append(str(tmp_path / f"executed{i}"))
        with open(os.path.join(ckpt, "global_step2", "hecate", name), "wb") as f:
            pickle.dump({"master": _Payload(markers[-1]), "state": {}, "format": _Payload(markers[-1])}, f)
        ckpts.append(ckpt)
    results = run_ranks(2, _load_each, ckpts)
    for name, i in zip(names, range(len(names))):
        for r in results:
            message = r["messages"][i]
            if name == "meta.json":
                assert "meta.json is not a Hecate checkpoint index" in message, message
            else:
                layer, expert = int(name[5:8]), int(name[15:20])
                assert f"expert {expert} of MoE layer 'blocks.{layer}.moe'" in message, message
        assert not os.path.exists(markers[i]), f"loading executed code hidden in {name}"
    assert all(r["unchanged"] for r in results), "a refused load must not change any weight"


def test_saved_schedule_is_kept_and_a_damaged_one_is_refused(saved_checkpoint, tmp_path):
    """meta.json carries each layer's last scheduler result (so a resumed run reuses it as the original would);
    one that cannot belong to the model fails on every rank before anything is loaded."""
    import json
    import shutil
    meta = json.load(open(os.path.join(saved_checkpoint, "meta.json")))
    saved = meta["layers"][1]["schedule"]
    assert saved, "the hot layer was scheduled before the save: its schedule must be in the checkpoint"
    assert len(saved["placement"]) == 2 and len(saved["planned_for"]) == 2 and len(saved["owners"]) == 8
    ckpt = str(tmp_path / "run")
    shutil.copytree(os.path.dirname(os.path.dirname(saved_checkpoint)), ckpt)
    meta["layers"][1]["schedule"]["placement"][0].append(99)   # an expert the layer does not have
    with open(os.path.join(ckpt, "global_step2", "hecate", "meta.json"), "w") as f:
        json.dump(meta, f)
    for r in run_ranks(2, _load_broken, ckpt):
        assert "MoE layer 'blocks.1.moe': the checkpoint's saved schedule does not fit" in r["message"], r["message"]
        assert r["unchanged"], "a failed load must not change any weight"
