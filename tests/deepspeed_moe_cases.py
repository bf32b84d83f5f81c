"""DeepSpeed's own MoE unit tests, reproduced with the ``hecate`` key injected (issue 43): the cases of
``tests/unit/v1/moe/test_moe.py`` and ``test_moe_tp.py`` in DeepSpeed's repository that call ``deepspeed.initialize``
(read at deepspeedai/DeepSpeed edaa722, the suite DeepSpeed 0.19.8 ships with), with the same models, configs and
assertions in spirit, written here (CI has no GitHub access and DeepSpeed's PyPI sdist ships no tests). Each config
gets ``"zero_optimization": {"hecate": {"enabled": true}}`` and nothing else, as a user would add it.

Run by tests/test_deepspeed_moe_cases.py inside ranks of ``dist_utils.run_ranks``: one job per world size, every case
of it in turn; a case's outcome is a dict of what the test asserts on (or the error it raised, as text).

Where DeepSpeed's test reads what Hecate replaces, the property it checks is shown another way (the docstring of
each case says how):

- ``TestMoESingleton.test_all_to_all``: DeepSpeed counts its own ``sharded_moe._AllToAll`` (none at ``ep_size`` 1, one
  each way at 2); Hecate's token exchange is its own (``AllToAllTokens``), counted instead.
- ``TestExpertWeightGradWithZero``: DeepSpeed reads ``moe.deepspeed_moe.experts`` (expert modules Hecate removes);
  the equality of the expert gradients of an ``ep_size`` 1 and an ``ep_size`` 2 model is checked on Hecate's
  consolidated expert gradients, and the weights after each step through ``engine.hecate.full_expert_weights()``.
"""
from __future__ import annotations

import copy
import traceback
from typing import Callable, Dict, List

import torch
from torch import nn

HECATE = {"enabled": True}


def with_hecate(config: dict) -> dict:
    """``config`` with the hecate key added, as the issue's reporter injected it into every initialize."""
    config = copy.deepcopy(config)
    config.setdefault("zero_optimization", {})["hecate"] = dict(HECATE)
    return config


def ds_moe(hidden: int, expert: nn.Module, **kwargs) -> nn.Module:
    from deepspeed.moe.layer import MoE
    return MoE(hidden_size=hidden, expert=expert, **kwargs)


class TwoMoELayers(nn.Module):
    """DeepSpeed's ``SimpleMoEModel``: linear, MoE, linear, MoE, linear, mean over the sequence, cross-entropy; the
    two MoE layers copy one expert module (their experts must not share storage)."""

    def __init__(self, hidden: int, num_experts: int = 4, ep_size: int = 1, use_residual: bool = False,
                 use_rts: bool = True) -> None:
        super().__init__()
        expert = nn.Sequential(nn.Linear(hidden, hidden), nn.Linear(hidden, hidden))
        options = dict(ep_size=ep_size, use_residual=use_residual, num_experts=num_experts, k=1, use_rts=use_rts)
        self.linear1 = nn.Linear(hidden, hidden)
        self.moe_1 = ds_moe(hidden, expert, **options)
        self.linear2 = nn.Linear(hidden, hidden)
        self.moe_2 = ds_moe(hidden, expert, **options)
        self.linear3 = nn.Linear(hidden, hidden)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        h = self.linear1(x)
        out = self.linear3(self.moe_2(self.linear2(self.moe_1(h)[0]))[0])
        return self.loss((h + out).mean(1), y)


class PyramidResidualMoE(nn.Module):
    """DeepSpeed's ``SimplePRMoEModel``: two MoE layers of linear experts, the second with twice the experts."""

    def __init__(self, hidden: int, num_experts: int = 2, ep_size: int = 1, use_residual: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.linear2 = ds_moe(hidden, nn.Linear(hidden, hidden), ep_size=ep_size, use_residual=use_residual,
                              num_experts=num_experts, k=1)
        self.linear3 = ds_moe(hidden, nn.Linear(hidden, hidden), ep_size=ep_size, use_residual=use_residual,
                              num_experts=2 * num_experts, k=1)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        h = self.linear(x)
        out = self.linear3(self.linear2(h)[0])[0]
        return self.loss((h + out).mean(1), y)


def sequences(engine, step: int, hidden: int, dtype: torch.dtype, seq_len: int = 8, data_rank=None):
    """A micro-batch like DeepSpeed's ``sequence_dataloader``: ``[micro, seq_len, hidden]`` and class labels below
    ``hidden``; drawn from (rank, step), or from ``data_rank`` (the tensor-parallel ranks of a slice share it)."""
    import torch.distributed as dist

    rank = dist.get_rank() if data_rank is None else data_rank
    g = torch.Generator().manual_seed(1000 * rank + step)
    micro = engine.train_micro_batch_size_per_gpu()
    x = torch.randn(micro, seq_len, hidden, generator=g).to(dtype)
    y = torch.randint(0, hidden, (micro,), generator=g)
    return x, y


def train(engine, steps: int, hidden: int, dtype: torch.dtype, data_rank=None) -> List[float]:
    losses = []
    for step in range(steps):
        x, y = sequences(engine, step, hidden, dtype, data_rank=data_rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def _fp16_on_cpu() -> None:
    from moe_training import _allow_fp16_on_cpu
    _allow_fp16_on_cpu()


def run_cases(cases: Dict[str, Callable[..., dict]]) -> Dict[str, dict]:
    """Each case in turn; an exception becomes ``{"error": traceback}`` (every rank raises alike in these cases, so
    the next case still starts on all ranks together)."""
    out = {}
    for name, case in cases.items():
        torch.manual_seed(11)
        try:
            out[name] = case()
        except Exception:  # noqa: BLE001 - reported by the test, per case
            out[name] = {"error": traceback.format_exc()}
    return out


# ---------------------------------------------------------------------------------------------------------------
# world size 2 (test_moe.py: TestSimpleMoE, TestMoESingleton.test_all_to_all, TestExpertWeightGradWithZero)
def simple_moe(stage: int) -> dict:
    """TestSimpleMoE: fp16, DeepSpeed's Adam from the config, ZeRO stage 0/1/2, ``ep_size`` 1; DeepSpeed creates the
    MoE parameter groups itself. Trains."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "fp16": {"enabled": True},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(config=with_hecate(config), model=TwoMoELayers(16, ep_size=1))
    losses = train(engine, 3, 16, torch.float16)
    return {"engine": type(engine).__name__, "losses": losses, "hecate_layers": len(engine.hecate.bindings),
            "steps": engine.global_steps}


def singleton_all_to_all(ep_size: int) -> dict:
    """TestMoESingleton.test_all_to_all: the model IS a MoE layer (2 experts, top-1, min_capacity 0) with a client
    AdamW; one forward and backward of ``[1, 4, 8]``. DeepSpeed's test counts its ``_AllToAll`` calls (0 at ep_size 1,
    2 at ep_size 2; none added by backward), that the input gets a gradient, and that a parameter does. Counted here:
    DeepSpeed's ``_AllToAll`` (never called: Hecate dispatches the tokens) and Hecate's token exchange."""
    import deepspeed
    import deepspeed.moe.sharded_moe as sharded_moe
    from ds_hecate.comm.collectives import AllToAllTokens

    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1}
    expert = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model = ds_moe(8, expert, num_experts=2, ep_size=ep_size, k=1, min_capacity=0)
    optimizer = torch.optim.AdamW(params=model.parameters())
    engine, *_ = deepspeed.initialize(config=with_hecate(config), model=model, optimizer=optimizer,
                                      dist_init_required=False)
    deepspeed_calls, hecate_calls = [], []
    original_ds, original_hecate = sharded_moe._AllToAll.apply, AllToAllTokens.apply

    def counted_ds(group, input):
        deepspeed_calls.append(tuple(input.shape))
        return original_ds(group, input)

    def counted_hecate(*args):
        hecate_calls.append(tuple(args[0].shape))
        return original_hecate(*args)

    sharded_moe._AllToAll.apply = counted_ds
    setattr(AllToAllTokens, "apply", counted_hecate)
    try:
        x = torch.randn(1, 4, 8, requires_grad=True)
        output, l_aux, _ = engine(x)
        forward = (len(deepspeed_calls), len(hecate_calls))
        engine.backward(output.float().sum() + l_aux.float())
        backward = (len(deepspeed_calls), len(hecate_calls))
    finally:
        sharded_moe._AllToAll.apply = original_ds
        setattr(AllToAllTokens, "apply", original_hecate)
    return {"module_is_the_model": engine.module is model, "module_type": type(engine.module).__name__,
            "num_local_experts": engine.num_local_experts, "forward_calls": forward, "after_backward": backward,
            "input_grad": x.grad is not None,
            "param_grad": any(p.grad is not None for p in engine.module.parameters())}


def expert_grads_ep1_vs_ep2(stage: int) -> dict:
    """TestExpertWeightGradWithZero: the same two-layer model built with ``ep_size`` 1 and with ``ep_size`` 2 (each
    rank's local expert the ``ep_size`` 1 model's expert of its rank), DeepSpeed's Adam lr 0.1, fp32, ZeRO stage
    0/1/2, 2 steps on the same data: the expert weight gradients of the two are equal (rtol 1e-4, atol 0) at every
    step. DeepSpeed's test reads them from ``moe.deepspeed_moe.experts``, which Hecate removes; here from the
    experts' owners (``moe_training.consolidated_expert_grads``), and the weights after every step through
    ``engine.hecate.full_expert_weights()``."""
    import deepspeed
    import torch.distributed as dist
    from moe_training import consolidated_expert_grads

    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
    torch.manual_seed(11)
    ep1 = TwoMoELayers(4, num_experts=2, ep_size=1, use_rts=False)
    ep2 = TwoMoELayers(4, num_experts=2, ep_size=2, use_rts=False)
    rank = dist.get_rank()
    state = {}
    for key, value in ep1.state_dict().items():
        marker = "deepspeed_moe.experts.deepspeed_experts."
        if marker not in key:
            state[key] = value.clone()
        elif key.split(marker)[1].startswith(f"{rank}."):
            state[key.replace(f"{marker}{rank}.", f"{marker}0.")] = value.clone()
    ep2.load_state_dict(state)
    engine1, *_ = deepspeed.initialize(config=with_hecate(config), model=ep1)
    engine2, *_ = deepspeed.initialize(config=with_hecate(config), model=ep2)
    worst_grad, worst_weight = 0.0, 0.0
    grads_equal = weights_equal = True
    for step in range(2):
        x, y = sequences(engine1, step, 4, torch.float32)
        loss1, loss2 = engine1(x, y), engine2(x, y)
        engine1.backward(loss1)
        engine2.backward(loss2)
        g1, g2 = consolidated_expert_grads(engine1.hecate), consolidated_expert_grads(engine2.hecate)
        for name in g1:
            grads_equal &= torch.allclose(g1[name], g2[name], rtol=1e-4, atol=0)
            worst_grad = max(worst_grad, (g1[name] - g2[name]).abs().max().item())
        engine1.step()
        engine2.step()
        w1, w2 = engine1.hecate.full_expert_weights(), engine2.hecate.full_expert_weights()
        for name in w1:
            weights_equal &= torch.allclose(w1[name], w2[name], rtol=1e-4, atol=0)
            worst_weight = max(worst_weight, (w1[name] - w2[name]).abs().max().item())
    return {"grads_equal": grads_equal, "weights_equal": weights_equal, "worst_grad": worst_grad,
            "worst_weight": worst_weight, "layers": sorted(g1), "nonzero": all(v.abs().sum() > 0 for v in g1.values())}


def world2_cases(rank: int, world: int) -> Dict[str, dict]:
    import deepspeed
    import ds_hecate  # noqa: F401  (the training script's import; `pip install .` makes it automatic)
    deepspeed.init_distributed(dist_backend="gloo")
    _fp16_on_cpu()
    cases: Dict[str, Callable[..., dict]] = {f"TestSimpleMoE[{s}]": (lambda s=s: simple_moe(s)) for s in (0, 1, 2)}
    cases.update({f"TestMoESingleton.test_all_to_all[{n}]": (lambda ep=ep: singleton_all_to_all(ep))
                  for n, ep in (("single", 1), ("multi", 2))})
    cases.update({f"TestExpertWeightGradWithZero[{s}]": (lambda s=s: expert_grads_ep1_vs_ep2(s)) for s in (0, 1, 2)})
    return run_cases(cases)


# ---------------------------------------------------------------------------------------------------------------
# world size 4 (test_moe.py: TestMoE, TestPRMoE; test_moe_tp.py: TestMOETensorParallel)
def moe_ep(ep_size: int, stage: int, use_residual: bool) -> dict:
    """TestMoE: ``ep_size`` 2 (expert + data parallel) or 4 (expert parallel only), fp16, ZeRO stage 0/1/2, residual
    MoE or not, a client AdamW over ``split_params_into_different_moe_groups_for_optimizer``. DeepSpeed's test wraps
    ZeRO's ``average_tensor`` to check that every gradient slice it reduces uses its parameter's process group
    (expert-data-parallel for expert parameters, data-parallel for the rest): under Hecate no expert parameter
    reaches ZeRO, so every reduced bucket must be free of MoE parameters (checked on each call), and training runs."""
    import deepspeed
    from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1, "fp16": {"enabled": True},
              "zero_optimization": {"stage": stage}}
    model = TwoMoELayers(16, ep_size=ep_size, use_residual=use_residual)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "random-unique-name"})
    optimizer = torch.optim.AdamW(params=groups)
    engine, optimizer, *_ = deepspeed.initialize(config=with_hecate(config), model=model, optimizer=optimizer,
                                                 dist_init_required=False)
    buckets = []
    if "average_tensor" in dir(optimizer):
        def strict_average_tensor(tensor, communication_data_type):
            bucket = optimizer.ipg_buckets[communication_data_type]
            params = [optimizer.bit16_groups[i][j] for i, j, _ in bucket.params]
            buckets.append((bool(bucket.has_moe_params), any(is_moe_param(p) for p in params), len(params)))
            return type(optimizer).average_tensor(optimizer, tensor, communication_data_type)
        optimizer.average_tensor = strict_average_tensor
    losses = train(engine, 2, 16, torch.float16)
    return {"engine": type(engine).__name__, "losses": losses, "buckets": buckets,
            "moe_params_in_zero": any(is_moe_param(p) for p in engine.module.parameters())}


def pr_moe(use_residual: bool) -> dict:
    """TestPRMoE: the pyramid model (2 and 4 experts), ``ep_size`` 2, fp16, train_batch_size 8 over 4 ranks, a client
    AdamW over all parameters. Trains."""
    import deepspeed

    config = {"train_batch_size": 8, "steps_per_print": 1, "fp16": {"enabled": True}}
    model = PyramidResidualMoE(16, ep_size=2, use_residual=use_residual)
    optimizer = torch.optim.AdamW(params=model.parameters())
    engine, *_ = deepspeed.initialize(config=with_hecate(config), model=model, optimizer=optimizer,
                                      dist_init_required=False)
    losses = train(engine, 2, 16, torch.float16)
    return {"engine": type(engine).__name__, "losses": losses,
            "experts": [b.shard.num_experts for b in engine.hecate.bindings]}


def tensor_parallel(ep_size: int, tp_size: int, expert_tp: bool, use_residual: bool) -> dict:
    """TestMOETensorParallel: the model IS a MoE layer of 4 experts (an FFN of width 64 / tp), ``ep_size`` 1 or 2, a
    model-parallel unit of tensor-parallel size 2 or 4 (tests/grid_mpu.py, DeepSpeed's test MPU's layout), fp16,
    train_batch_size 8. DeepSpeed's test asserts ``num_local_experts == world / ep_size`` and the expert-model-parallel
    world size (tp with expert tensor parallelism, else 1). Hecate refuses expert tensor parallelism at initialize
    (naming the flag; ds_hecate.deepspeed_glue.model_parallel says why); without it the same assertions, plus one
    training step on inputs shared by each tensor-parallel slice."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups
    from ds_hecate import HecateUnsupportedError
    from grid_mpu import GridMPU

    config = {"train_batch_size": 8, "steps_per_print": 1, "fp16": {"enabled": True}}
    world = dist.get_world_size()
    expert = nn.Sequential(nn.Linear(16, 4 * 16 // tp_size), nn.ReLU(), nn.Linear(4 * 16 // tp_size, 16))
    model = ds_moe(16, expert, num_experts=world, ep_size=ep_size, use_residual=use_residual,
                   enable_expert_tensor_parallelism=expert_tp)
    optimizer = torch.optim.AdamW(params=model.parameters())
    mpu = GridMPU(tp_size)
    try:
        engine, *_ = deepspeed.initialize(config=with_hecate(config), model=model, optimizer=optimizer,
                                          dist_init_required=False, mpu=mpu)
    except HecateUnsupportedError as exc:
        return {"refused": str(exc)}
    x, _ = sequences(engine, 0, 16, torch.float16, data_rank=mpu.get_data_parallel_rank())
    output, l_aux, _ = engine(x)
    engine.backward(output.float().sum() + l_aux.float())
    engine.step()
    name = engine.module.expert_group_name
    return {"num_local_experts": engine.num_local_experts,
            "expert_model_parallel_world_size": groups._get_expert_model_parallel_world_size(),
            "expert_parallel_world_size": groups._get_expert_parallel_world_size(name),
            "expert_data_parallel_world_size": groups._get_expert_data_parallel_world_size(name),
            "engine_expert_groups": sorted(engine.expert_parallel_group),
            "stats": {k: engine.hecate.stats()[k] for k in ("ep_size", "expert_data_parallel_size",
                                                            "tensor_parallel_size")}}


def world4_cases(rank: int, world: int) -> Dict[str, dict]:
    import deepspeed
    import ds_hecate  # noqa: F401  (the training script's import; `pip install .` makes it automatic)
    deepspeed.init_distributed(dist_backend="gloo")
    _fp16_on_cpu()
    cases: Dict[str, Callable[..., dict]] = {
        f"TestMoE[{ep}-{stage}-{res}]": (lambda ep=ep, stage=stage, res=res: moe_ep(ep, stage, res))
        for res in (True, False) for stage in (0, 1, 2) for ep in (2, 4)}
    cases.update({f"TestPRMoE[2-{res}]": (lambda res=res: pr_moe(res)) for res in (True, False)})
    cases.update({f"TestMOETensorParallel[{ep}-{tp}-{etp}-{res}]":
                  (lambda ep=ep, tp=tp, etp=etp, res=res: tensor_parallel(ep, tp, etp, res))
                  for res in (True, False) for etp in (True, False) for ep, tp in ((1, 2), (1, 4), (2, 2))})
    return run_cases(cases)
