"""Shared checks for the checkpoint tests (test_resume, test_faults, test_universal): a resumed run equals the run
that never stopped, step by step; every expert of a checkpoint, with its optimizer state, reaches the ranks that
load it; checkpoints converted to DeepSpeed's universal format in one helper process."""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from typing import Dict, List, Sequence, Tuple

import torch

ExpertKey = Tuple[int, int]   # (layer id, expert)


def _same_floats(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def _assert_same_state(expected: dict, got: dict, where: str) -> None:
    assert expected["dense"].keys() == got["dense"].keys(), where
    for name, value in expected["dense"].items():
        assert torch.equal(value, got["dense"][name]), f"{where}: dense '{name}' differs"
    assert expected["experts"].keys() == got["experts"].keys(), where
    for name, value in expected["experts"].items():
        assert torch.equal(value, got["experts"][name]), f"{where}: experts of '{name}' differ"


def assert_resumes_exactly(straight: List[dict], resumed: List[dict], start: int, label: str) -> None:
    """``resumed`` (loaded at step ``start``) equals ``straight`` from that step on, bit for bit: per-step losses,
    global grad norms, loss scales, per-step weights (when recorded) and final dense and expert weights."""
    assert len(straight) == len(resumed), label
    for rank, (s, r) in enumerate(zip(straight, resumed)):
        where = f"{label} rank {rank}"
        assert r["losses"] and r["losses"] == s["losses"][start:], \
            f"{where}: losses {r['losses']} != {s['losses'][start:]}"
        assert _same_floats(r["norms"], s["norms"][start:]), f"{where}: norms {r['norms']} != {s['norms'][start:]}"
        assert r["scales"] == s["scales"][start:], f"{where}: loss scales {r['scales']} != {s['scales'][start:]}"
        assert r["skipped"] == s["skipped"], f"{where}: skipped steps {r['skipped']} != {s['skipped']}"
        if s["states"]:
            assert len(r["states"]) == len(s["states"][start:]), where
            for i, (a, b) in enumerate(zip(s["states"][start:], r["states"])):
                _assert_same_state(a, b, f"{where} after step {start + i + 1}")
        _assert_same_state(s, r, f"{where} final")
        if s["hecate_stats"] is not None:
            for key in ("steps_applied", "steps_skipped", "reshards"):
                assert r["hecate_stats"][key] == s["hecate_stats"][key], (where, key)


def read_expert_files(tag_dir: str) -> Dict[ExpertKey, dict]:
    """Every ``layerXXX_expertYYYYY.pt`` of ``tag_dir/hecate`` (weights only)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(tag_dir, "hecate", "layer*_expert*.pt"))):
        name = os.path.basename(path)
        out[(int(name[5:8]), int(name[15:20]))] = torch.load(path, map_location="cpu", weights_only=True)
    return out


def dump_expert_state(prefix: str, rank: int, step: int, engine) -> None:
    """Step hook: before the first step this process runs, write the experts this rank owns, with their optimizer
    state, to ``<prefix>.rank<r>.pt`` (what a load installed). With groups (``hecate.ep_size``) the first group's
    ranks write them whole (partitioned state gathered from the expert-data-parallel peers, a collective every
    rank joins), the other groups' ranks write none: every expert is in the dumps once."""
    from ds_hecate.runtime.edp import whole_masters

    path = f"{prefix}.rank{rank}.pt"
    if os.path.exists(path):
        return
    rt = engine.hecate
    dump = {}
    for binding in rt.bindings:
        shard = binding.shard
        masters, states = whole_masters(rt, shard, with_state=True)
        if rt.layout.edp_index != 0:
            continue
        for e, master in masters.items():
            dump[(shard.layer_id, e)] = {"master": master.detach().cpu().clone(),
                                         "state": {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                                   for k, v in states[e].items()}}
    torch.save({"step": step, "experts": dump}, path)


def assert_loaded_every_expert(prefix: str, world: int, tag_dir: str, label: str) -> None:
    """The dumps of :func:`dump_expert_state` (one per rank) hold every expert of the checkpoint ``tag_dir`` exactly
    once, with exactly the saved master weights and optimizer state (Adam's moments and step)."""
    saved = read_expert_files(tag_dir)
    meta = json.load(open(os.path.join(tag_dir, "hecate", "meta.json")))
    expected_keys = {(layer, e) for layer, m in enumerate(meta["layers"]) for e in range(m["num_experts"])}
    assert set(saved) == expected_keys, f"{label}: the checkpoint lacks experts {sorted(expected_keys - set(saved))}"
    loaded: Dict[ExpertKey, dict] = {}
    for rank in range(world):
        for key, blob in torch.load(f"{prefix}.rank{rank}.pt", weights_only=True)["experts"].items():
            assert key not in loaded, f"{label}: expert {key} loaded on two ranks"
            loaded[key] = blob
    assert set(loaded) == expected_keys, f"{label}: experts {sorted(expected_keys - set(loaded))} not loaded"
    for key, blob in saved.items():
        got = loaded[key]
        assert torch.equal(got["master"], blob["master"]), f"{label}: expert {key} master weights differ"
        assert {"exp_avg", "exp_avg_sq", "step"} <= set(blob["state"]), f"{label}: {key} saved without Adam state"
        assert set(got["state"]) == set(blob["state"]), f"{label}: expert {key} optimizer state keys differ"
        for name, value in blob["state"].items():
            assert torch.equal(torch.as_tensor(got["state"][name]).float(), torch.as_tensor(value).float()), \
                f"{label}: expert {key} optimizer state '{name}' differs from the checkpoint"


_CONVERT = """
import json, sys
from deepspeed.checkpoint import ds_to_universal as u
for source, target in json.loads(sys.argv[1]):
    sys.argv = ["ds_to_universal", "--input_folder", source, "--output_folder", target, "--inject_missing_state",
                "--num_extract_workers", "1", "--num_merge_workers", "1"]
    u.main(u.parse_arguments())
"""


def to_universal(*tag_dirs: str) -> None:
    """``ds_to_universal`` on each ``<ckpt>/<tag>`` into ``<ckpt>/<tag>_universal`` (which also writes
    ``<ckpt>/latest_universal``), all in one helper process."""
    pairs = [(d, d.rstrip("/") + "_universal") for d in tag_dirs]
    proc = subprocess.run([sys.executable, "-c", _CONVERT, json.dumps(pairs)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
