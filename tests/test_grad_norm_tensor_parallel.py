"""Which global gradient norm is right with tensor and expert parallelism (issue 56): DeepSpeed's or Hecate's.

4 ranks, a model-parallel unit of tensor-parallel size 2 (tests/grid_mpu.py, Megatron's layout), DeepSpeed MoE layers
with ``ep_size`` 2, ZeRO 1 and 2, fp32, no clipping, 4 steps; plain DeepSpeed (the oracle, processes of its own) and
Hecate with the same mpu. Before every step both runs gather every unique gradient on one rank and compute the norm
there (``grad_norms.gathered_grad_norm``: keys name each dense parameter and each expert once, every copy of a key
must agree), reading no norm either system computed.

The verdict, step by step:

- both runs hold the same gradients: their gathered norms agree (and their trajectories, checked after every step);
- Hecate reports the gathered norm;
- DeepSpeed 0.19.8 reports less: its ZeRO 1/2 norm (``get_grad_norm_direct``) counts a parameter that is not
  tensor-parallel only on model-parallel rank 0, and with an mpu DeepSpeed's expert-parallel groups are consecutive
  world ranks, so with ``ep_size`` 2 and tensor-parallel size 2 experts 2 and 3 of each layer live only on ranks of
  tensor-parallel rank 1 (rank 1 and 3; ranks 0 and 2 hold experts 0 and 1) and are left out. DeepSpeed's norm is
  exactly the gathered norm of the gradients some rank of tensor-parallel rank 0 holds. The same defect without Hecate:
  ``examples/deepspeed_tp_moe_grad_norm.py``; docs/design.md says what a user who must follow DeepSpeed's curve can do.

Cost: two 4-rank process sets (oracle, Hecate), each training both stages: about 25 s on 2 idle cores.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Tuple

import pytest

from moe_training import Spec, run_specs
from trajectory_checks import assert_same_steps

WORLD = 4
BASE = Spec(steps=4, tokens=16, per_step_state=True, tp_size=2, ep_size=2, gathered_norm=True)
STAGES = (1, 2)
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs() -> Dict[int, Tuple[List[dict], List[dict]]]:
    specs = [replace(BASE, stage=stage) for stage in STAGES]
    oracle = run_specs(WORLD, specs, timeout=300)
    mine = run_specs(WORLD, [replace(s, hecate={"enabled": True}) for s in specs], timeout=300)
    return {stage: (o, m) for stage, o, m in zip(STAGES, oracle, mine)}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * abs(b)


@pytest.mark.parametrize("stage", STAGES)
def test_both_runs_hold_the_same_gradients_and_follow_each_other(runs, stage):
    oracle, mine = runs[stage]
    assert not any(r["hecate_imported"] for r in oracle)
    for o, m in zip(oracle, mine):
        for step, (a, b) in enumerate(zip(o["gathered_norms"], m["gathered_norms"])):
            assert _close(b, a), f"ZeRO {stage} step {step}: gathered norms {b} (Hecate) vs {a} (DeepSpeed)"
    reference = [{**r, "norms": r["gathered_norms"]} for r in oracle]   # the trajectory's norm: the gathered one
    assert_same_steps(reference, mine, loss_rtol=1e-5, param_atol=2e-5, norm_rtol=RTOL,
                      label=f"[TP 2 x EP 2, ZeRO {stage}]")


@pytest.mark.parametrize("stage", STAGES)
def test_hecate_reports_the_norm_of_every_gradient(runs, stage):
    _, mine = runs[stage]
    for rank, m in enumerate(mine):
        for step, (reported, gathered) in enumerate(zip(m["norms"], m["gathered_norms"])):
            assert _close(reported, gathered), f"ZeRO {stage} step {step} rank {rank}: {reported} vs {gathered}"


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_leaves_out_the_experts_of_tensor_parallel_rank_1(runs, stage, capsys):
    """DeepSpeed's reported norm is the norm of what tensor-parallel rank 0 holds, well below every gradient's (if a
    DeepSpeed release fixes its count, this fails: the docs' verdict must then change)."""
    oracle, _ = runs[stage]
    for rank, o in enumerate(oracle):
        for step, (reported, tp0, every) in enumerate(zip(o["norms"], o["gathered_tp0_norms"],
                                                          o["gathered_norms"])):
            assert _close(reported, tp0), f"ZeRO {stage} step {step} rank {rank}: DeepSpeed {reported} vs {tp0}"
    reported, every = oracle[0]["norms"], oracle[0]["gathered_norms"]
    assert all(r < e * (1 - 1e-3) for r, e in zip(reported, every)), (reported, every)
    with capsys.disabled():
        print(f"\n[TP 2 x EP 2, ZeRO {stage}] gradient norm per step: every gradient (Hecate reports it) "
              f"{[round(x, 6) for x in every]}, DeepSpeed reports {[round(x, 6) for x in reported]} "
              f"({[f'{100 * (1 - r / e):.1f}%' for r, e in zip(reported, every)]} low)")
