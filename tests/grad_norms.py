"""Gradient norms the tests compute themselves, to check the norm DeepSpeed and Hecate report (from
:func:`moe_training.train`, which records them per step when its ``Spec`` asks).

- :func:`independent_grad_norm`: ZeRO stage 0 (DeepSpeed reports no norm there unless it clips).
- :func:`full_grad_norm`: plain DeepSpeed, ZeRO 1/2: every parameter's full gradient on every rank.
- :func:`gathered_grad_norm`: every unique gradient gathered on one rank and the norm computed there, for plain
  DeepSpeed and Hecate alike, with tensor and expert parallelism (issue 56).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch


def independent_grad_norm(engine, world_size: int) -> float:
    """The global gradient norm of this step, computed by the test, not by DeepSpeed's optimizer nor by Hecate.

    Called (``Spec.independent_norm``) on every rank after the last ``engine.backward`` of a step and before
    ``engine.step``, under ZeRO stage 0 only: there DeepSpeed has all-reduced (averaged) the dense gradients into
    ``param.grad`` by the end of ``backward`` and nothing is partitioned (stages 1-3 keep reduced gradients inside
    the ZeRO optimizer, and report a norm themselves). DeepSpeed's stage 0 reports no norm unless it clips, so the
    per-step comparison (:func:`trajectory_checks.assert_same_steps`) would otherwise have no norm to compare there.

    - Oracle (plain DeepSpeed): the L2 norm of every parameter's averaged gradient (experts included: with
      ``ep_size`` 1 DeepSpeed averages expert gradients over all ranks like dense ones; with ``ep_size`` > 1 a rank
      holds only its expert-parallel share, reduced over its expert-data-parallel group: their squares are summed
      over the world and divided by the world / ep_size ranks that hold each).
    - Hecate: dense gradients as above; expert gradients consolidated by the test from the owners' accumulators
      (each owner holds the sum over its group's ranks of its experts' gradients, what SparseReduceScatter
      delivered; with groups the expert-data-parallel sum happens in the step, after this). The test all-reduces
      them into ``[E, numel]`` per layer over the default group, checks every expert has exactly one owner per
      group, and divides by the world size. It does not call ``hecate.expert_grad_norm`` or read the norm
      Hecate gives DeepSpeed, so a gradient lost or double-counted on its way to the owner shows here.

    Both are divided by the loss scale in force (fp16), so the value is the unscaled norm. Collective (Hecate).
    """
    scale = float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0)
    import torch.distributed as dist

    sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    ep_sizes = {int(getattr(m, "ep_size", 1)) for m in engine.module.modules() if type(m).__name__ == "MoE"}
    ep_size = max(ep_sizes) if ep_sizes else 1
    for p in engine.module.parameters():
        if p.grad is not None:
            part = p.grad.detach().double().pow(2).sum()
            if ep_size > 1 and getattr(p, "allreduce", True) is False:   # DeepSpeed's expert-parallel share
                expert_sq += part
            else:
                sq += part
    if ep_size > 1:
        dist.all_reduce(expert_sq)
        sq += expert_sq / (world_size // ep_size)
    runtime = getattr(engine, "hecate", None)
    if runtime is not None:
        for full in consolidated_expert_grads(runtime).values():
            sq += (full.double() / world_size).pow(2).sum()
    return float(sq.sqrt()) / scale


def full_grad_norm(engine) -> float:
    """The global gradient norm of this step from every parameter's full (averaged) gradient, assembled by
    DeepSpeed's ``safe_get_full_grad`` (a collective under ZeRO 1/2): each parameter counted once, experts included.
    Called after the last backward of a step, before ``engine.step``; plain DeepSpeed only (Hecate's experts are not
    module parameters). Divided by the loss scale in force."""
    from deepspeed.utils import safe_get_full_grad

    sq = torch.zeros((), dtype=torch.float64)
    for p in engine.module.parameters():
        grad = safe_get_full_grad(p)
        if grad is not None:
            sq += grad.detach().double().pow(2).sum().cpu()
    return float(sq.sqrt()) / float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0)


def consolidated_expert_grads(runtime) -> Dict[str, torch.Tensor]:
    """Every expert's accumulated gradient (the owner's ``.grad``: summed over ranks, loss-scaled, not averaged) as
    fp32 ``[num_experts, numel]`` per layer, on every rank; zeros for an expert no token reached. Collective over
    the default process group; raises if an expert has no owner or more than one."""
    import torch.distributed as dist

    out = {}
    # with groups (hecate.ep_size) every group's owner holds its group's sum, before the expert-data-parallel
    # reduction of the step: the world's sum adds them up, and every expert has one owner per group
    groups = runtime.layout.edp_size
    for name, binding in zip(runtime.layer_names, runtime.bindings):
        shard = binding.shard
        full = torch.zeros(shard.num_experts, shard.kernel.numel, dtype=torch.float32)
        holders = torch.zeros(shard.num_experts, dtype=torch.float32)
        for e, master in shard.masters.items():
            holders[e] += 1
            if master.grad is not None:
                full[e] = master.grad.detach().float().reshape(-1).cpu()
        dist.all_reduce(full)
        dist.all_reduce(holders)
        if not torch.equal(holders, torch.full_like(holders, groups)):
            raise AssertionError(f"layer '{name}': experts held by {holders.tolist()} ranks (each must have one owner "
                                 f"in each of the {groups} group(s))")
        out[name] = full
    return out


def _deepspeed_expert_keys(module) -> Dict[int, Tuple[str, int, str]]:
    """Plain DeepSpeed's expert parameters on this rank: id -> (layer, global expert, parameter name). A rank holds
    ``num_experts / ep_size`` local experts; local expert ``i`` is global expert ``ep_rank * num_local + i``, its
    rank in the layer's expert-parallel group (DeepSpeed's registry)."""
    from deepspeed.utils import groups

    keys: Dict[int, Tuple[str, int, str]] = {}
    for layer, moe in module.named_modules():
        inner = getattr(moe, "deepspeed_moe", None)
        if inner is None:
            continue
        experts = list(inner.experts.deepspeed_experts)
        local = len(experts)
        ep_rank = 0 if local == moe.num_experts else groups._get_expert_parallel_rank(moe.expert_group_name)
        for i, expert in enumerate(experts):
            for name, p in expert.named_parameters():
                keys[id(p)] = (layer, ep_rank * local + i, name)
    return keys


def gathered_grad_norm(engine) -> Tuple[float, float]:
    """The global gradient norm of this step from every unique gradient, gathered on one rank and summed there
    (every rank gets the same value), unscaled; and the norm of only those gradients some rank of tensor-parallel
    rank 0 holds (what DeepSpeed's ZeRO 1/2 norm counts of parameters that are not tensor-parallel). Called after
    the last backward of a step, before ``engine.step``; collective. Works for plain DeepSpeed and for Hecate, with
    a model-parallel unit and expert parallelism, at ZeRO 1/2.

    Each rank contributes (key, averaged gradient) pairs, the key naming a parameter once however many ranks hold it:

    - module parameters: the full averaged gradient ZeRO holds (``safe_get_full_grad``); a dense parameter is one
      parameter on every tensor-parallel rank unless it is tensor-parallel (Megatron's ``tensor_model_parallel``
      attribute: then one per tensor-parallel rank); plain DeepSpeed's local expert ``i`` is its layer's global expert
      (:func:`_deepspeed_expert_keys`), whichever expert-parallel and expert-data-parallel ranks hold it;
    - Hecate's experts (no longer module parameters): every owner's accumulated gradient summed over the world (each
      group's owner holds its group's sum; :func:`consolidated_expert_grads`), or with partitioned expert state every
      peer's slice of that sum (the reduction over the groups ran in backward), divided by the data-parallel size
      (world / tensor-parallel size), the average DeepSpeed takes of every gradient.

    The gathering rank keeps one gradient per key and checks every other copy equals it (a key counted twice, or two
    ranks disagreeing on a gradient, fails here), then sums the squares. Nothing reads the norm DeepSpeed's optimizer
    or Hecate computes.
    """
    import torch.distributed as dist
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils import safe_get_full_grad

    mpu = engine.mpu
    tp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
    tp_size = mpu.get_model_parallel_world_size() if mpu is not None else 1
    world = dist.get_world_size()
    scale = float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0)
    experts = _deepspeed_expert_keys(engine.module)
    mine: Dict[tuple, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        grad = safe_get_full_grad(p)   # collective (ZeRO 1/2), on every rank in the same order
        if grad is None:
            continue
        if id(p) in experts:
            key: tuple = ("expert",) + experts[id(p)]
        elif is_model_parallel_parameter(p):
            key = ("dense", name, tp_rank)
        else:
            key = ("dense", name)
        mine[key] = grad.detach().double().cpu().reshape(-1) / scale
    runtime = getattr(engine, "hecate", None)
    dp_size = world // tp_size
    if runtime is not None and runtime.layout.partitioned:   # reduced over the groups in backward: every peer's slice
        for layer, binding in zip(runtime.layer_names, runtime.bindings):
            shard = binding.shard
            for e, master in shard.masters.items():
                if master.grad is not None:
                    key = ("hecate expert slice", layer, e, shard.partition.index)
                    mine[key] = master.grad.detach().double().cpu().reshape(-1) / dp_size / scale
    elif runtime is not None:
        for layer, full in consolidated_expert_grads(runtime).items():   # collective: every rank gets every row
            if dist.get_rank() == 0:
                for e, row in enumerate(full):
                    mine[("hecate expert", layer, e)] = row.double() / dp_size / scale
    parts: list = [None] * world
    dist.all_gather_object(parts, (tp_rank, mine))
    unique: Dict[tuple, torch.Tensor] = {}
    on_tp_rank0 = set()
    for rank, (tp, part) in enumerate(parts):
        for key, grad in part.items():
            first = unique.setdefault(key, grad)
            if first is not grad and not torch.allclose(first, grad, rtol=1e-6, atol=1e-12):
                raise AssertionError(f"gathered_grad_norm: rank {rank}'s gradient of {key} differs from another "
                                     f"rank's by {(first - grad).abs().max().item():.3e}")
            if tp == 0:
                on_tp_rank0.add(key)
    return (float(sum(g.pow(2).sum() for g in unique.values()) ** 0.5),
            float(sum(g.pow(2).sum() for k, g in unique.items() if k in on_tp_rank0) ** 0.5))
