"""Megatron-DeepSpeed's optimizer set-up, as its MoE pretraining scripts get it, for the tiny test model.

Written after Megatron-DeepSpeed (``megatron/optimizer/__init__.py`` ``get_param_groups`` and
``get_megatron_optimizer``; ``megatron/optimizer_param_scheduler.py``), with nothing but torch and DeepSpeed, so the
plain-DeepSpeed oracle processes (which never import ds_hecate) build the same thing:

- :func:`param_groups`: weights in a weight-decay group, biases and 1-d parameters in a no-weight-decay group (each
  with ``wd_mult`` and ``lr_mult``), then ``--create-moe-param-group``: DeepSpeed's
  ``split_params_into_different_moe_groups_for_optimizer`` moves the experts' parameters of each into a group of
  their own. One MoE layer's expert parameters therefore sit in two groups, both holding nothing else.
- :func:`optimizer`: Megatron's CPU optimizer, ``torch.optim.Adam`` (L2-regularized Adam) over those groups.
- :class:`ParamScheduler`: Megatron's ``OptimizerParamScheduler`` for ``--lr-warmup-iters`` and ``--lr-decay-style
  cosine``: built before ``deepspeed.initialize`` (it sets every group's lr to 0 at once: warmup starts at 0), passed
  to it as ``lr_scheduler``, stepped by the engine; it sets each group's ``lr`` to ``lr * lr_mult`` and its
  ``weight_decay`` to ``weight_decay * wd_mult`` (so the no-weight-decay groups get 0 only from the scheduler).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

import torch
from torch import nn


def param_groups(model: nn.Module, moe_groups: bool = True, biases_apart: bool = True) -> List[Dict[str, Any]]:
    """Megatron's groups (``biases_apart`` False: one weight-decay group of every parameter, as a custom
    ``no_weight_decay_cond`` that never answers yes gives)."""
    decay: List[Any] = []
    no_decay: List[Any] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        no_wd = biases_apart and (name.endswith(".bias") or len(getattr(param, "ds_shape", param.shape)) == 1)
        (no_decay if no_wd else decay).append(param)
    groups = [{"name": "wd_no_scale_lr", "params": decay, "wd_mult": 1.0, "lr_mult": 1.0}]
    if no_decay:
        groups.append({"name": "no_wd_no_scale_lr", "params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0})
    if moe_groups:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return groups


def optimizer(groups: List[Dict[str, Any]], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """Megatron's ``Adam(param_groups, lr=..., weight_decay=..., betas=..., eps=...)``; each group's weight decay is
    set to ``weight_decay * wd_mult`` here already (Megatron leaves that to its scheduler), so the groups differ in
    their settings also where one of DeepSpeed's schedulers replaces Megatron's."""
    for group in groups:
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
    return torch.optim.Adam(groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), eps=1e-8)


class ParamScheduler:
    """Megatron's ``OptimizerParamScheduler`` (iteration-based warmup, then cosine decay; constant weight decay)."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_lr: float, min_lr: float, warmup_steps: int,
                 decay_steps: int, weight_decay: float) -> None:
        self.optimizer = optimizer
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.weight_decay = weight_decay
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            return self.max_lr * float(self.num_steps) / float(self.warmup_steps)
        if self.num_steps > self.decay_steps:
            return self.min_lr
        ratio = float(self.num_steps - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        new_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = new_lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    def state_dict(self) -> Dict[str, Any]:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "warmup_steps": self.warmup_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.num_steps = 0
        self.step(int(state["num_steps"]))
