"""Two `torchrun --nnodes 2` launches on this machine (2 ranks each) form one 4-rank job over 2 "nodes": Hecate
detects 2 nodes from the launcher's LOCAL_WORLD_SIZE, trains like plain DeepSpeed on 4 ranks, and its dispatch sends
tokens to another node only when no rank of their own node holds the expert."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train_gpt_moe.py")
STEPS = "6"


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _torchrun_two_nodes(tmp_path: Path, config: Path, name: str) -> list:
    """Two ``torchrun --nnodes 2`` launches of the example (2 ranks each) as one 4-rank job; their outputs."""
    port = free_port()
    common = ["--nnodes", "2", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    args = [SCRIPT, "--deepspeed_config", str(config), "--steps", STEPS, "--experts", "4",
            "--log-file", str(tmp_path / f"{name}.json"), "--stats-file", str(tmp_path / f"{name}-stats.json")]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *common, "--node_rank", str(n), *args],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    outputs = []
    try:
        for proc in nodes:
            out, _ = proc.communicate(timeout=600)
            outputs.append(out)
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
    for proc, out in zip(nodes, outputs):
        assert proc.returncode == 0, out[-4000:]
    return outputs


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> list:
    """Plain DeepSpeed on 4 ranks, the same data and model: the losses both Hecate jobs must follow."""
    tmp_path = tmp_path_factory.mktemp("baseline")
    run = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port", str(free_port()),
         SCRIPT, "--deepspeed_config", str(ROOT / "ds_configs" / "ds_baseline.json"), "--steps", STEPS,
         "--experts", "4", "--no-hecate-import", "--log-file", str(tmp_path / "baseline.json")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return json.loads((tmp_path / "baseline.json").read_text())


def _same_losses(tmp_path: Path, name: str, plain: list) -> dict:
    hecate = json.loads((tmp_path / f"{name}.json").read_text())
    assert len(hecate) == len(plain)
    for h, b in zip(hecate, plain):
        assert abs(h["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (h, b)
    return json.loads((tmp_path / f"{name}-stats.json").read_text())


def test_two_torchrun_nodes_train_with_node_aware_dispatch(tmp_path, baseline):
    outputs = _torchrun_two_nodes(tmp_path, ROOT / "ds_configs" / "ds_hecate.json", "hecate")
    assert "on 4 rank(s) in 2 node(s)" in outputs[0], outputs[0][-3000:]
    stats = _same_losses(tmp_path, "hecate", baseline)
    assert stats["nodes"] == 2 and stats["ranks_per_node"] == 2
    crossing = sum(layer["cross_node_tokens"] for layer in stats["layers"])
    avoidable = sum(layer["avoidable_cross_node_tokens"] for layer in stats["layers"])
    assert crossing > 0, "with 4 experts on 4 ranks some tokens must reach experts on the other node"
    assert avoidable == 0, f"{avoidable} token rows crossed nodes although a rank of their node had the expert"


def test_two_torchrun_nodes_with_one_group_per_node(tmp_path, baseline):
    """``hecate.ep_size`` = the node size (issue 25): each node is a group holding every expert once, the two nodes
    expert-data-parallel replicas; the job trains like plain DeepSpeed and no token ever crosses the nodes."""
    config = json.loads((ROOT / "ds_configs" / "ds_hecate.json").read_text())
    config["zero_optimization"]["hecate"]["ep_size"] = 2
    path = tmp_path / "ds_hecate_groups.json"
    path.write_text(json.dumps(config))
    outputs = _torchrun_two_nodes(tmp_path, path, "groups")
    assert "groups of 2 consecutive ranks (hecate.ep_size) x 2 expert-data-parallel replicas" in outputs[0], \
        outputs[0][-3000:]
    stats = _same_losses(tmp_path, "groups", baseline)
    assert (stats["nodes"], stats["ep_size"], stats["expert_data_parallel_size"]) == (2, 2, 2)
    assert sum(layer["cross_node_tokens"] for layer in stats["layers"]) == 0
