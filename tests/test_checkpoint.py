"""Checkpoints keep every expert: exact resume, loading at another world size, and refusing (on every rank, before
anything is loaded) a checkpoint whose expert files are missing, truncated or hostile."""
from __future__ import annotations

import os
import pickle
from dataclasses import replace
from typing import Any, cast

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


def rewrite_meta(hecate_dir: str, meta: dict) -> None:
    """Replace ``meta.json`` and record the tag's files anew in its completion mark, as a save that wrote them
    would: the checks behind the mark then see the content."""
    import json

    from ds_hecate.deepspeed_glue.checkpoint_integrity import tag_files

    json.dump(meta, open(os.path.join(hecate_dir, "meta.json"), "w"))
    marker_path = os.path.join(hecate_dir, "complete.json")
    marker = json.load(open(marker_path))
    marker["files"] = tag_files(os.path.dirname(hecate_dir))
    json.dump(marker, open(marker_path, "w"))


def rerecord_digest(hecate_dir: str, name: str) -> None:
    """Record the current content of expert file ``name`` in ``meta.json`` and the mark, as if the save had
    written it: the checks behind the digest (shape, optimizer state) then see the file."""
    import hashlib
    import json

    meta = json.load(open(os.path.join(hecate_dir, "meta.json")))
    data = open(os.path.join(hecate_dir, name), "rb").read()
    meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    rewrite_meta(hecate_dir, meta)


def flip_tensor_byte(path: str) -> None:
    """Flip 8 bytes inside the tensor data of an expert file (the archive stays readable): a bit-flip on disk."""
    data = bytearray(open(path, "rb").read())
    at = data.index(b"/data/0") + 200   # past the storage record's name, inside the master's values
    for i in range(at, at + 8):
        data[i] ^= 0x40
    open(path, "wb").write(bytes(data))
    blob = torch.load(path, weights_only=True)   # still a valid file: only the digest can tell
    assert torch.is_tensor(blob["master"])


@pytest.mark.parametrize("damage", ["missing", "truncated", "pickle-payload", "flipped-byte", "wrong-shape",
                                    "no-optimizer-state"])
def test_damaged_expert_file_fails_everywhere_naming_it(saved_checkpoint, tmp_path, damage):
    import shutil
    ckpt = str(tmp_path / "run")
    shutil.copytree(os.path.dirname(os.path.dirname(saved_checkpoint)), ckpt)
    hecate_dir = os.path.join(ckpt, "global_step2", "hecate")
    target = os.path.join(hecate_dir, "layer001_expert00005.pt")
    marker = str(tmp_path / "executed")
    if damage == "missing":
        os.remove(target)
    elif damage == "truncated":
        data = open(target, "rb").read()
        open(target, "wb").write(data[: len(data) // 2])
    elif damage == "pickle-payload":
        with open(target, "wb") as f:
            pickle.dump({"master": _Payload(marker), "state": {}}, f)
    elif damage == "flipped-byte":
        flip_tensor_byte(target)
    elif damage == "wrong-shape":
        torch.save({"master": torch.zeros(3), "state": {}}, target)
        rerecord_digest(hecate_dir, os.path.basename(target))
    else:  # its weights intact, its Adam moments and step gone: loading would silently restart them
        blob = torch.load(target, weights_only=True)
        torch.save({"master": blob["master"], "state": {}}, target)
        rerecord_digest(hecate_dir, os.path.basename(target))
    results = run_ranks(2, _load_broken, ckpt)
    for r in results:
        assert "expert 5 of MoE layer 'blocks.1.moe'" in r["message"], r["message"]
        if damage == "no-optimizer-state":
            assert "no optimizer state ['exp_avg', 'exp_avg_sq', 'step']" in r["message"], r["message"]
        if damage == "flipped-byte":
            meta = __import__("json").load(open(os.path.join(hecate_dir, "meta.json")))
            expected = meta["files"]["layer001_expert00005.pt"]["sha256"]
            assert f"layer001_expert00005.pt does not match its recorded digest (sha256 expected {expected}, found " \
                in r["message"], r["message"]
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
    assert torch.equal(cast(Any, model.blocks[1]).moe.deepspeed_moe.experts.deepspeed_experts[5][2].bias,
                       outputs["deepspeed"]["blocks.1.moe.deepspeed_moe.experts.deepspeed_experts.5.2.bias"])


def _load_each(rank: int, world: int, ckpts: list) -> dict:
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
    assert "meta.json" in names and "complete.json" in names and len(names) == 2 + 2 * 8
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
            elif name == "complete.json":
                assert "is an incomplete save: hecate/complete.json is damaged" in message, message
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
    rewrite_meta(os.path.join(ckpt, "global_step2", "hecate"), meta)
    for r in run_ranks(2, _load_broken, ckpt):
        assert "MoE layer 'blocks.1.moe': the checkpoint's saved schedule does not fit" in r["message"], r["message"]
        assert r["unchanged"], "a failed load must not change any weight"


def _load_tags(rank: int, world: int, loads: list) -> dict:
    """Load each (save_dir, tag) in turn on one engine; the errors, the ds_hecate warnings and whether a refused
    load changed anything."""
    import logging

    import deepspeed

    from ds_hecate import HecateError
    from moe_training import TinyMoE, ds_config

    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("ds_hecate").addHandler(Collect(level=logging.WARNING))
    deepspeed.init_distributed(dist_backend="gloo")
    spec = replace(SCHEDULED, steps=0)
    torch.manual_seed(spec.seed)
    engine, *_ = deepspeed.initialize(model=TinyMoE(spec), model_parameters=None, config=ds_config(spec))
    messages = []
    for save_dir, tag in loads:
        try:
            engine.load_checkpoint(save_dir, tag=tag)
            messages.append("NO ERROR")
        except HecateError as exc:
            messages.append(str(exc))
    return {"messages": messages, "warnings": warnings}


def test_incomplete_saves_are_refused_by_tag_reported_and_cleaned_and_old_checkpoints_load(saved_checkpoint,
                                                                                          tmp_path, capsys):
    """A tag whose save did not complete (no completion mark: here an overwrite interrupted after its expert files,
    with a temporary file left behind) is refused by tag naming the missing mark, ``ds-hecate check`` reports it
    and its leftovers, and the next completed save of the same tag removes them. A checkpoint from before digests
    (format ds_hecate/1) loads, with one warning per job (rank 0)."""
    import json
    import shutil

    from ds_hecate.tools.cli import main

    source = os.path.dirname(os.path.dirname(saved_checkpoint))
    interrupted, legacy = str(tmp_path / "interrupted"), str(tmp_path / "legacy")
    shutil.copytree(source, interrupted)
    shutil.copytree(source, legacy)
    hecate_dir = os.path.join(interrupted, "global_step2", "hecate")
    os.remove(os.path.join(hecate_dir, "complete.json"))
    leftover = os.path.join(hecate_dir, "layer000_expert00001.pt.tmp4242")
    shutil.copy(os.path.join(hecate_dir, "layer000_expert00001.pt"), leftover)
    legacy_dir = os.path.join(legacy, "global_step2", "hecate")
    meta = json.load(open(os.path.join(legacy_dir, "meta.json")))
    meta["format"] = "ds_hecate/1"
    del meta["files"]
    json.dump(meta, open(os.path.join(legacy_dir, "meta.json"), "w"))
    os.remove(os.path.join(legacy_dir, "complete.json"))

    capsys.readouterr()
    assert main(["check", interrupted]) == 1
    out = capsys.readouterr().out
    assert "global_step2 (latest): incomplete" in out and "hecate/complete.json is missing" in out, out
    assert "layer000_expert00001.pt.tmp4242" in out, out
    assert main(["check", source]) == 0
    assert "global_step2 (latest): complete, 16 expert file(s) verified" in capsys.readouterr().out

    results = run_ranks(2, _load_tags, [(interrupted, "global_step2"), (legacy, "global_step2")])
    for rank, r in enumerate(results):
        assert "global_step2 is an incomplete save: hecate/complete.json is missing" in r["messages"][0], r
        assert r["messages"][1] == "NO ERROR", r
        legacy_warnings = [w for w in r["warnings"] if "saved before ds_hecate recorded expert-file digests" in w]
        assert len(legacy_warnings) == (1 if rank == 0 else 0), r["warnings"]

    # the next completed save of the same tag: the mark is back, the leftover gone
    run_specs(2, [replace(SCHEDULED, steps=2, save_after=2, ckpt_dir=interrupted)])
    assert not os.path.exists(leftover)
    assert main(["check", interrupted]) == 0, capsys.readouterr().out


def test_consolidate_verifies_the_digests(saved_checkpoint, tmp_path, capsys):
    import shutil

    from ds_hecate.tools.cli import main

    ckpt = str(tmp_path / "run")
    shutil.copytree(os.path.dirname(os.path.dirname(saved_checkpoint)), ckpt)
    flip_tensor_byte(os.path.join(ckpt, "global_step2", "hecate", "layer000_expert00002.pt"))
    capsys.readouterr()
    assert main(["consolidate", ckpt, "-o", str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "expert 2 of MoE layer 'blocks.0.moe'" in err and "does not match its recorded digest" in err, err
    assert not os.path.exists(tmp_path / "out.pt")
    assert main(["check", ckpt]) == 1
    assert "global_step2 (latest): damaged" in capsys.readouterr().out
