"""DeepSpeed is the oracle: with the same data, training with Hecate follows DeepSpeed's own data-parallel MoE
training step by step.

Each case trains the same tiny two-layer MoE model (8 experts, top-2 unless stated) twice on the same per-rank
data: once as plain DeepSpeed (``deepspeed.moe.layer.MoE``, ``ep_size`` 1, no ``hecate`` section: the experts are
ordinary data-parallel parameters) and once with Hecate owning the experts. All oracle runs of a world size share
one set of processes, which never import ``ds_hecate`` (so ``deepspeed.initialize`` is DeepSpeed's own); all Hecate
runs share another. After EVERY optimizer step, on every rank, :func:`trajectory_checks.assert_same_steps` compares the
losses, the global gradient norm (DeepSpeed's, and under ZeRO stage 0, where DeepSpeed reports none, one the test
computes itself from the averaged gradients), the loss scale, and every dense and expert weight.

DeepSpeed's MoE refuses ZeRO stage 3, so the ZeRO-3 cases run Hecate over ``ds_hecate.MoE`` and compare it with
DeepSpeed's MoE at stage 2: the same math (stage 3 only partitions the dense parameters).

Low-precision cases force the routes (a fixed draw per step, rank and layer, identical in both runs): DeepSpeed
reduces expert gradients in fp16/bf16, Hecate in fp32, and with learned routes that rounding flips a token's choice
now and then, each flip moving a step's loss by about 1e-2, which would hide everything else.

Runtime: four process sets (oracle and Hecate, on 2 and on 4 ranks): about 50 s on 2 idle CPU cores (2.5 min on
busy ones); ``-k "2-"`` runs only the 2-rank sets. The watchdog of each set is 240 s.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any, Dict, List, Tuple

import pytest

from moe_training import Spec, run_against_oracles
from trajectory_checks import assert_same_steps

# Small on purpose: process start-up and engine construction dominate, so many specs share one process set.
BASE = Spec(steps=5, tokens=16, per_step_state=True, master_state=True, independent_norm=True)
LOCAL = {"placement": "local"}      # every expert a rank's tokens route to is materialized there: replicas always
HOT = (3.0, 3.0) + (0.0,) * 6       # experts 0 and 1 (owned by rank 0) take most tokens
DEFAULT: Dict[str, Any] = {}        # the default placement ('hecate': scheduler, prefetch, calibration)
# Low precision: DeepSpeed reduces gradients in fp16/bf16, Hecate expert gradients in fp32, and Adam turns a
# rounding difference in a near-zero gradient element into an update difference of up to lr. With SGD an update is
# linear in the gradient, so the SGD cases are tight, and they see a wrong loss-scale or clip factor, which Adam
# (scale-invariant) would all but hide. Measured worst over all steps and ranks (loss rel / weight abs): fp16 Adam
# 5.5e-4 / 2.9e-4, fp16 SGD 8.5e-6 / 2.1e-7, bf16 Adam 1.6e-3 / 7.3e-4, bf16 SGD 4.1e-3 / 2.7e-3.
FP16_TOL = {"loss_rtol": 2e-3, "param_atol": 2e-3}
FP16_SGD_TOL = {"loss_rtol": 1e-4, "param_atol": 1e-5, "norm_rtol": 1e-4}
BF16_TOL = {"loss_rtol": 1e-2, "param_atol": 1e-2}
FP32_TOL = {"loss_rtol": 1e-5, "param_atol": 2e-5}     # measured worst 3.0e-7 / 2.9e-6
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}
INF_STEP = 2

Case = Tuple[Spec, dict, dict]      # (spec, hecate section, tolerances)


def poison_replica_grad(rank: int, step: int, engine, at_step: int, rank_with_replica: int = 1, expert: int = 0,
                        layer: int = 0) -> None:
    """``Spec.step_hook``: at ``at_step`` rank ``rank_with_replica``'s own gradient for ``expert`` of MoE layer
    ``layer`` becomes Inf, before any reduction. With Hecate that gradient belongs to a materialized replica of an
    expert another rank owns, so the Inf reaches the owner only through SparseReduceScatter; in the oracle it is
    that rank's local gradient before DeepSpeed's all-reduce. Removed at the next step."""
    import torch

    if rank != rank_with_replica:
        return
    runtime = getattr(engine, "hecate", None)
    if runtime is not None:
        from ds_hecate.comm.requests import ReduceScatterRequest
        shard = runtime.bindings[layer].shard
        if step == at_step:
            original = ReduceScatterRequest.start

            def poisoned(request, own_grads, replica_grads):   # the replica rows' gradients, in experts' order
                experts = request.experts
                if request.accumulator.shard is shard and expert in experts and \
                        request.placement.owners[expert] != rank:
                    owned = len(experts) - replica_grads.shape[0]
                    replica_grads = replica_grads.clone()
                    replica_grads[list(experts).index(expert) - owned] = float("inf")
                return original(request, own_grads, replica_grads)
            setattr(ReduceScatterRequest, "start", poisoned)
            engine._oracle_patch = original
        elif step == at_step + 1:
            setattr(ReduceScatterRequest, "start", engine._oracle_patch)   # back to the class's own
        return
    if step == at_step:
        moe = engine.module.blocks[layer].moe
        param = next(moe.deepspeed_moe.experts.deepspeed_experts[expert].parameters())
        engine._oracle_hook = param.register_hook(lambda g: torch.full_like(g, float("inf")))
    elif step == at_step + 1:
        engine._oracle_hook.remove()


def _inf_hook(at_step: int = INF_STEP):
    return functools.partial(poison_replica_grad, at_step=at_step)


def _cases_2() -> Dict[str, Case]:
    fp16 = replace(BASE, fp16=True, forced_routes=True, gate_bias=HOT)
    return {
        # ZeRO stages, fp32. Stage 0: DeepSpeed reports no norm; the test's own norm is compared instead.
        "zero0": (replace(BASE, stage=0), LOCAL, {}),
        "zero0-clip-default": (replace(BASE, stage=0, clip=0.05, gate_bias=HOT), DEFAULT, {}),
        "zero1": (replace(BASE, stage=1), LOCAL, {}),
        "zero2": (BASE, LOCAL, {}),
        "zero2-top1": (replace(BASE, k=1), LOCAL, {}),
        # The default placement with a skewed gate: replicas of the hot experts (checked below, not vacuous).
        "zero2-default-skewed": (replace(BASE, gate_bias=HOT), DEFAULT, {}),
        "zero2-gas3-clip": (replace(BASE, gas=3, clip=0.05), LOCAL, {}),
        # Precision.
        "bf16": (replace(BASE, bf16=True, forced_routes=True), LOCAL, BF16_TOL),
        "bf16-sgd": (replace(BASE, bf16=True, forced_routes=True, extra_config=SGD), LOCAL, BF16_TOL),
        "fp16": (fp16, LOCAL, FP16_TOL),
        "fp16-sgd-clip": (replace(fp16, clip=0.05, extra_config=SGD), LOCAL, FP16_SGD_TOL),
        "fp16-zero0-sgd-clip": (replace(fp16, stage=0, clip=0.05, extra_config=SGD), LOCAL, FP16_SGD_TOL),
        # ZeRO-3 (Hecate over ds_hecate.MoE; the oracle is DeepSpeed's MoE at stage 2).
        "zero3": (replace(BASE, native=True, stage=3, gate_bias=HOT), DEFAULT, {}),
        # DeepSpeed's own TopKGate class (no test bias): its routes come from ds_hecate.ops.topk_gate, which must
        # read the gate's ZeRO-3-partitioned weight as the gate's own forward would
        "zero3-plain-gate": (replace(BASE, native=True, stage=3), LOCAL, {}),
        "zero3-fp16-sgd-clip": (replace(fp16, native=True, stage=3, clip=0.05, extra_config=SGD), LOCAL,
                                FP16_SGD_TOL),
        # DeepSpeed MoE features.
        "drop-top2": (replace(BASE, drop_tokens=True, capacity_factor=0.5, gate_bias=HOT), LOCAL, {}),
        "drop-top1": (replace(BASE, k=1, drop_tokens=True, capacity_factor=0.5, gate_bias=HOT), LOCAL, {}),
        "jitter": (replace(BASE, noisy_gate_policy="Jitter"), LOCAL, {}),
        "rsample-top1": (replace(BASE, k=1, noisy_gate_policy="RSample"), LOCAL, {}),
        "residual": (replace(BASE, use_residual=True), LOCAL, {}),
        # fp16: an Inf in rank 1's gradient of its replica of expert 0 (owned by rank 0), i.e. an overflow that
        # only SparseReduceScatter carries to the owner: the step is skipped everywhere, the scale halved.
        "inf-via-reduce-scatter": (replace(fp16, step_hook=_inf_hook()), LOCAL, FP16_TOL),
        "inf-via-reduce-scatter-zero0": (replace(fp16, stage=0, step_hook=_inf_hook()), LOCAL, FP16_TOL),
    }


def _cases_4() -> Dict[str, Case]:
    fp16 = replace(BASE, fp16=True, forced_routes=True, gate_bias=HOT)
    return {
        "zero2-default-skewed": (replace(BASE, gate_bias=HOT), DEFAULT, {}),
        "zero3": (replace(BASE, native=True, stage=3, gate_bias=HOT), LOCAL, {}),
        "drop-top2": (replace(BASE, drop_tokens=True, capacity_factor=0.5, gate_bias=HOT), LOCAL, {}),
        "inf-via-reduce-scatter": (replace(fp16, step_hook=_inf_hook()), LOCAL, FP16_TOL),
    }


def oracle_of(spec: Spec) -> Spec:
    """Plain DeepSpeed: its own MoE layer, no hecate section, ZeRO-3 replaced by stage 2 (DeepSpeed's MoE refuses
    stage 3; for the dense parameters stage 3 only partitions what stage 2 computes)."""
    return replace(spec, hecate=None, native=False, stage=2 if spec.stage == 3 else spec.stage, zero_init=False)


def _run(world: int, cases: Dict[str, Case]) -> Dict[str, Tuple[List[dict], List[dict]]]:
    return run_against_oracles(world, cases, oracle_of, timeout=240)


CASES = {2: _cases_2(), 4: _cases_4()}
WORLD_CASES = [(w, n) for w, cases in CASES.items() for n in cases]


@pytest.fixture(scope="module")
def runs2() -> Dict[str, Tuple[List[dict], List[dict]]]:
    return _run(2, CASES[2])


@pytest.fixture(scope="module")
def runs4() -> Dict[str, Tuple[List[dict], List[dict]]]:
    return _run(4, CASES[4])


def _runs(request, world: int) -> Dict[str, Tuple[List[dict], List[dict]]]:
    """The runs of one world size (its fixture starts them on first use: ``-k 2-`` runs only the 2-rank ones)."""
    return request.getfixturevalue(f"runs{world}")


@pytest.mark.parametrize("world,name", WORLD_CASES)
def test_follows_deepspeed_step_by_step(request, world, name):
    oracle, mine = _runs(request, world)[name]
    spec, _, tolerances = CASES[world][name]
    assert_same_steps(oracle, mine, label=f"[{world} ranks, {name}]", zero3_vs_stage2=spec.stage == 3,
                      **{**FP32_TOL, **tolerances})


@pytest.mark.parametrize("world", sorted(CASES))
def test_oracle_is_plain_deepspeed(request, world):
    """The oracle processes never imported ds_hecate (deepspeed.initialize unpatched); the Hecate runs did."""
    for name, (oracle, mine) in _runs(request, world).items():
        assert not any(r["hecate_imported"] for r in oracle), name
        assert all(r["hecate_imported"] and r["hecate_stats"] is not None for r in mine), name


@pytest.mark.parametrize("world", sorted(CASES))
def test_inf_arriving_through_sparse_reduce_scatter_skips_the_step(request, world):
    """The Inf was put on rank 1 only, into a replica's gradient; it was seen on the owner, rank 0, after
    SparseReduceScatter. Both runs skip that one step on every rank and halve the loss scale there."""
    results = _runs(request, world)
    names = [n for n in results if n.startswith("inf-via-reduce-scatter")]
    assert names
    for name in names:
        oracle, mine = results[name]
        owner, replica = mine[0]["hecate_stats"], mine[1]["hecate_stats"]
        assert owner["nonfinite_grad_steps"] == 1, (name, owner["nonfinite_grad_steps"])
        assert owner["last_nonfinite_grads"] == {"step": INF_STEP + 1, "experts": ["blocks.0.moe expert 0"]}, \
            (name, owner["last_nonfinite_grads"])
        assert replica["nonfinite_grad_steps"] == 0 and 0 not in replica["layers"][0]["owned_experts"], name
        for o, m in zip(oracle, mine):
            assert o["skipped"] == m["skipped"] == 1, (name, o["skipped"], m["skipped"])
            assert m["hecate_stats"]["steps_skipped"] == 1, name
            assert m["scales"][INF_STEP] == m["scales"][INF_STEP - 1] / 2, (name, m["scales"])
            assert o["scales"] == m["scales"], name
            if "zero0" in name:  # the test's own norm saw the Inf in both runs
                assert not math.isfinite(o["independent_norms"][INF_STEP]), name
                assert not math.isfinite(m["independent_norms"][INF_STEP]), name


@pytest.mark.parametrize("world", sorted(CASES))
def test_default_placement_materializes_replicas(request, world):
    """Not vacuous: with the skewed gate the default placement gathered replicas of other ranks' experts in some
    step (so SparseAllGather and SparseReduceScatter carried experts), and the runs above still matched."""
    _, mine = _runs(request, world)["zero2-default-skewed"]
    for rank, r in enumerate(mine):
        replicas = [sum(s["replicas"]) for s in r["states"]]
        assert any(replicas), (rank, replicas)
        assert r["hecate_stats"]["comm"]["bytes_reducescatter"] > 0, rank


def test_cases_exercise_what_they_claim(runs2):
    """Token dropping dropped routes, noise changed the trajectory, the residual MLP is there, 'local' gathered."""
    tokens = CASES[2]["drop-top2"][0].tokens
    for name, k in (("drop-top2", 2), ("drop-top1", 1)):
        for rank, r in enumerate(runs2[name][1]):
            kept = [sum(layer["tokens_per_expert"]) for layer in r["hecate_stats"]["layers"]]
            assert all(n < 2 * tokens * k for n in kept), (name, rank, kept)   # the capacity limit evicted routes
    for noisy, plain in (("jitter", "zero2"), ("rsample-top1", "zero2-top1")):
        assert runs2[noisy][0][0]["losses"] != runs2[plain][0][0]["losses"], noisy
    dense = runs2["residual"][1][0]["dense"]
    assert any(".moe.coefficient." in n for n in dense) and any(".moe.mlp." in n for n in dense), sorted(dense)
    assert runs2["zero2"][1][0]["hecate_stats"]["comm"]["bytes_reducescatter"] > 0
