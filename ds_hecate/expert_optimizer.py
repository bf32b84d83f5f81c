"""Optimizer for the expert shards: DeepSpeed's own optimizer class and hyper-parameters, on owned masters only.

Expert parameters are pruned from the optimizer DeepSpeed builds; this optimizer steps them instead, with the same
algorithm and the same per-group settings (betas, eps, weight decay), and with a learning rate that follows the
DeepSpeed param group the expert parameters came from, so every DeepSpeed or client LR schedule drives experts too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import torch
from torch import nn

from .errors import HecateUnsupportedError


@dataclass
class LrSource:
    """Where an expert param group takes its scheduled hyper-parameters from, at each step.

    ``group`` is the dense param-group dict of the DeepSpeed optimizer the experts came from (same dict object);
    when that group became empty after pruning and DeepSpeed dropped it, ``group`` is the first remaining group
    and ``ratio`` carries the initial ratio between the two groups' learning rates. Besides the learning rate,
    schedules may drive momentum (OneCycle cycles Adam's ``betas``): those are followed as they are.
    """

    group: Dict[str, Any]
    ratio: float = 1.0

    def lr(self) -> float:
        return float(self.group["lr"]) * self.ratio

    def hyperparameters(self) -> Dict[str, Any]:
        out = {k: self.group[k] for k in SCHEDULED_KEYS if k in self.group}
        out["lr"] = self.lr()
        return out


#: Param-group entries DeepSpeed's LR schedules change during training.
SCHEDULED_KEYS = ("lr", "betas", "momentum")


class ExpertOptimizer:
    """Wraps ``optimizer_cls`` over the owned expert masters, one param group per source group."""

    def __init__(self, optimizer_cls: type, groups: Sequence[Dict[str, Any]], lr_sources: Sequence[LrSource]):
        if len(groups) != len(lr_sources):
            raise ValueError("one LrSource per expert param group")
        self.lr_sources = list(lr_sources)
        # A group may own no expert on this rank (now, or after re-sharding); a zero-size placeholder keeps it.
        placeholder = [{**g, "params": list(g["params"]) or [nn.Parameter(torch.zeros(0))]} for g in groups]
        try:
            self.optimizer = optimizer_cls(placeholder)
        except TypeError as exc:
            raise HecateUnsupportedError(
                f"cannot build the expert optimizer as {optimizer_cls.__name__}(param_groups): {exc}; "
                "use the DeepSpeed 'optimizer' section (Adam/AdamW) or a torch.optim optimizer") from None

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def current_hyperparameters(self) -> List[Dict[str, Any]]:
        """What each expert group gets now (read before DeepSpeed's step advances the schedule)."""
        return [source.hyperparameters() for source in self.lr_sources]

    def step(self, grad_scale: float, hyperparameters: Sequence[Dict[str, Any]]) -> None:
        """Multiply accumulated gradients by ``grad_scale`` (averaging, unscale, clip), set the scheduled
        hyper-parameters, and step."""
        for group, hyper in zip(self.optimizer.param_groups, hyperparameters):
            group.update(hyper)
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        self.optimizer.step()

    # -- re-sharding: parameters (with their state) leave and join this rank --------------------------------------
    def state_of(self, param: nn.Parameter) -> Dict[str, Any]:
        return self.optimizer.state.get(param, {})

    def remove(self, param: nn.Parameter) -> None:
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p is not param]
        self.optimizer.state.pop(param, None)

    def add(self, group_index: int, param: nn.Parameter, state: Dict[str, Any]) -> None:
        self.optimizer.param_groups[group_index]["params"].append(param)
        if state:
            self.optimizer.state[param] = state

    def state_bytes(self) -> int:
        total = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def group_hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
    """A param group's settings without its parameters (and without scheduler bookkeeping)."""
    return {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
