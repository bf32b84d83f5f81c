"""``ds-hecate plan``: the expert part of the memory plan equals the shard store's accounting of a real 2-rank run
to the byte; the CLI prints the breakdown for the paper/production shapes and warns when a rank will not fit."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from typing import cast

import pytest

from dist_utils import run_ranks
from moe_training import Spec, TinyMoE, batch, ds_config

SPEC = Spec(hecate={"enabled": True, "materialize_budget_mb": 3.0}, num_experts=5, layers=2, hidden=16, ffn=32,
            tokens=24, steps=1)


def _memory_worker(rank: int, world: int, spec: Spec) -> dict:
    import torch

    import deepspeed
    import ds_hecate  # noqa: F401  (patches deepspeed.initialize)

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(spec.seed)
    engine, *_ = deepspeed.initialize(model=TinyMoE(spec), model_parameters=None, config=ds_config(spec))
    out = {"init": engine.hecate.memory_bytes()}
    x, y, used = batch(spec, 0, 0, rank, torch.bfloat16 if spec.bf16 else torch.float32)
    engine.backward(engine(x, y, used))
    engine.hecate.flush_reductions()          # gradients land in the owners' accumulators
    out["after_backward"] = engine.hecate.memory_bytes()
    engine.step()
    out["after_step"] = engine.hecate.memory_bytes()
    out["owned"] = [len(s.owned) for s in engine.hecate.store.layers]
    out["numel"] = engine.hecate.store.layers[0].kernel.numel
    return out


@pytest.mark.parametrize("ranks,precision,stage,ep_size", [
    (2, "fp32", 2, 1),    # one group, fp32: the masters are the resident weights
    (2, "bf16", 2, 1),    # one group, bf16: the resident bf16 copy beside the fp32 masters
    (4, "fp32", 1, 2),    # groups of 2 x 2 peers, ZeRO-1: sliced masters, the resident whole fp32 weights apart
], ids=["fp32", "bf16-resident", "fp32-partitioned"])
def test_plan_matches_shard_store_to_the_byte(ranks, precision, stage, ep_size):
    import torch

    from ds_hecate.config import HecateConfig
    from ds_hecate.sim.memory_plan import optimizer_layout_from_ds_config, plan_memory, probe_optimizer_state
    from ds_hecate.sim.presets import ModelShape

    spec = replace(SPEC, bf16=precision == "bf16", stage=stage,
                   hecate={**cast(dict, SPEC.hecate), **({"ep_size": ep_size} if ep_size > 1 else {})})
    results = run_ranks(ranks, _memory_worker, spec)
    model = ModelShape(name="tiny", moe_layers=spec.layers, hidden_size=spec.hidden, ffn_size=spec.ffn,
                       num_experts=spec.num_experts, top_k=spec.k, vocab_size=0, seq_len=spec.tokens,
                       expert_bias=True)
    assert results[0]["numel"] == model.expert_params
    layout = optimizer_layout_from_ds_config(ds_config(spec))
    assert layout == probe_optimizer_state(torch.optim.AdamW)   # what the expert optimizer steps with
    config = HecateConfig(**cast(dict, spec.hecate))
    plan = plan_memory(model, config, world_size=ranks, ranks_per_node=ranks, zero_stage=stage,
                       precision=precision, optimizer=layout)
    for rank, got in enumerate(results):
        want = plan.expert_memory_bytes(rank)
        assert plan.owned_experts[rank] == sum(got["owned"])
        assert got["init"]["expert_master"] == want["expert_master"]
        assert got["init"]["expert_weights"] == want.get("expert_weights", 0)
        assert got["after_step"]["expert_weights"] == want.get("expert_weights", 0)
        if ep_size == 1:   # partitioned, the whole rows live only until the reduction (transient_grad_bytes)
            assert got["after_backward"]["expert_grad"] == want["expert_grad"]
        assert got["after_step"]["expert_optimizer_state"] == want["expert_optimizer_state"]
        assert got["after_step"]["materialize_budget"] == want["materialize_budget"]
    if precision == "bf16":
        assert plan.weights(0) == plan.owned_experts[0] * model.expert_params * 2 > 0
    if ep_size == 1:   # 5 experts over 2 ranks: 3 and 2 per layer, so the two ranks differ and both are checked
        assert plan.owned_experts == [6, 4]
        assert plan.expert_master[0] == 6 * model.expert_params * 4 != plan.expert_master[1]
    else:
        assert plan.edp_size == 2 and plan.weights(0) == plan.owned_experts[0] * model.expert_params * 4


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_hecate.tools.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_plan_cli_breakdown_and_warning(tmp_path):
    cfg = ds_config(replace(SPEC, bf16=True, stage=2, hecate={"enabled": True}))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    proc = _cli("plan", "--config", str(path), "--model", "deepseek-v3", "--world-size", "64",
                "--ranks-per-node", "8", "--cluster", "h100-128x8")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in ("dense params", "dense optimizer states", "master weights", "optimizer states",
                   "materialization budget", "overlap degree t", "memory cap"):
        assert needle in out, out
    # 58 x 256 experts over 64 ranks: 232 per rank, 44,040,192 fp32 params each
    assert f"({232 * 44040192 * 4:,} B)" in out
    assert "WARNING" in out and "will not fit" in out            # 671B on 64 x 80 GB does not fit
    proc = _cli("plan", "--config", str(path), "--model", "gpt-moe-s", "--world-size", "32", "--ranks-per-node",
                "8", "--device-memory-gb", "80")
    assert proc.returncode == 0, proc.stderr
    assert "fits:" in proc.stdout and "WARNING" not in proc.stdout
    sizes = tmp_path / "model.json"
    sizes.write_text(json.dumps({"moe_layers": 2, "hidden_size": 16, "ffn_size": 32, "num_experts": 4, "top_k": 2,
                                 "vocab_size": 0, "seq_len": 8, "expert_bias": True}))
    proc = _cli("plan", "--model", str(sizes), "--world-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert f"({2 * 2 * 1072 * 4:,} B)" in proc.stdout                # 2 layers x 2 owned x 1072 params x 4 B
    sizes.write_text(json.dumps({"moe_layers": 2, "hiden_size": 16}))
    proc = _cli("plan", "--model", str(sizes), "--world-size", "2")
    assert proc.returncode == 2 and "unknown field(s) ['hiden_size']" in proc.stderr


def test_plan_partitions_expert_state_over_expert_data_parallel_peers(tmp_path):
    """Mixtral-8x7B on 1,024 ranks: the runtime's rule picks ep_size 8 (one node per group, 128 peers per expert).
    Under ZeRO >= 1 each peer keeps 1/128 of the fp32 master, gradient and Adam state and whole bf16 weights, plus
    two layers' whole fp32 gradient rows in the backward that ends the window; under ZeRO-0 every peer keeps the
    whole state. An ep_size that does not divide the
    world is refused naming the key."""
    from ds_hecate.config import HecateConfig
    from ds_hecate.sim.model_state import ADAM
    from ds_hecate.sim.presets import MODELS
    from ds_hecate.sim.memory_plan import plan_memory

    model = MODELS["mixtral-8x7b"]
    numel, part, layers = model.expert_params, -(-model.expert_params // 128), model.moe_layers
    hecate = HecateConfig(enabled=True)
    plan = plan_memory(model, hecate, 1024, 8, 1, "bf16", ADAM)
    assert (plan.ep_size, plan.edp_size) == (8, 128) and plan.owned_experts == [layers] * 1024
    assert plan.expert_memory_bytes(5) == {"expert_weights": layers * numel * 2, "expert_master": layers * part * 4,
                                           "expert_grad": layers * part * 4 + 2 * numel * 4,
                                           "expert_optimizer_state": layers * (part * 8 + 4),
                                           "materialize_budget": 1 << 30}
    assert plan_memory(model, HecateConfig(enabled=True, ep_size=4), 1024, 8, 1, "bf16", ADAM).edp_size == 256
    full = plan_memory(model, hecate, 1024, 8, 0, "bf16", ADAM).expert_memory_bytes(5)
    # ZeRO-0: whole fp32 masters on every peer, and the resident bf16 copy the calls compute from beside them
    assert full["expert_master"] == layers * numel * 4 and full["expert_weights"] == layers * numel * 2
    fp32 = plan_memory(model, hecate, 1024, 8, 0, "fp32", ADAM).expert_memory_bytes(5)
    assert "expert_weights" not in fp32   # fp32 whole masters are the resident weights
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}))
    proc = _cli("plan", "--config", str(cfg), "--model", "mixtral-8x7b", "--world-size", "1024", "--ranks-per-node",
                "8")
    assert proc.returncode == 0, proc.stderr
    assert "ep_size 8 (128 groups of 8 consecutive ranks" in proc.stdout
    assert f"({layers * part * 4:,} B)" in proc.stdout and f"({layers * numel * 2:,} B)" in proc.stdout
    proc = _cli("plan", "--config", str(cfg), "--model", "mixtral-8x7b", "--world-size", "1024", "--ep-size", "12")
    assert proc.returncode == 2 and "hecate.ep_size = 12 must be a positive divisor" in proc.stderr
