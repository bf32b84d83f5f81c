"""Optimizer for the expert shards: DeepSpeed's own optimizer class and hyper-parameters, on owned masters only.

Expert parameters are pruned from the optimizer DeepSpeed builds; this optimizer steps them instead, with the same
algorithm and the same per-group settings (betas, eps, weight decay), and with a learning rate that follows the
DeepSpeed param group the expert parameters came from, so every DeepSpeed or client LR schedule drives experts too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..errors import HecateUnsupportedError


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


#: Optimizer attributes (not param-group entries) the expert optimizer copies from DeepSpeed's.
INSTANCE_SETTINGS = ("adam_w_mode",)

#: Param-group entries DeepSpeed's LR schedules change during training.
SCHEDULED_KEYS = ("lr", "betas", "momentum")


class ExpertOptimizer:
    """Wraps ``optimizer_cls`` over the owned expert masters, one param group per source group."""

    def __init__(self, optimizer_cls: type, groups: Sequence[Dict[str, Any]], lr_sources: Sequence[LrSource],
                 like: Optional[torch.optim.Optimizer] = None, device: Optional[torch.device] = None):
        if len(groups) != len(lr_sources):
            raise ValueError("one LrSource per expert param group")
        self.lr_sources = list(lr_sources)
        self._initial_step: Optional[List[Dict[str, Any]]] = None  # see add_initial_step
        # A group may own no expert on this rank (now, or after re-sharding); a zero-size placeholder keeps it, on
        # the working device (a fused CUDA optimizer refuses a CPU tensor among its params).
        placeholder = [{**g, "params": list(g["params"]) or [nn.Parameter(torch.zeros(0, device=device))]}
                       for g in groups]
        try:
            self.optimizer = optimizer_cls(placeholder)
        except TypeError as exc:
            raise HecateUnsupportedError(
                f"cannot build the expert optimizer as {optimizer_cls.__name__}(param_groups): {exc}; "
                "use the DeepSpeed 'optimizer' section (Adam/AdamW) or a torch.optim optimizer") from None
        # Settings some optimizers keep outside their param groups: DeepSpeed's FusedAdam holds adam_w_mode
        # ("Adam" with adam_w_mode false is L2-regularized Adam), which the experts must follow too.
        for key in INSTANCE_SETTINGS:
            if like is not None and hasattr(like, key) and hasattr(self.optimizer, key):
                setattr(self.optimizer, key, getattr(like, key))

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def add_initial_step(self, hyperparameters: Optional[Sequence[Dict[str, Any]]]) -> None:
        """Take, right before the first applied step, the step with zero gradients that DeepSpeed's ZeRO stage-0
        wrappers (FP16_Optimizer, FP16_UnfusedOptimizer: fp16, and bf16 at stage 0) take on the dense parameters
        when built (``initialize_optimizer_states``): Adam's step counter then starts at 1 and decoupled weight
        decay is applied once to the masters. Without it the experts' first bias correction differs (their first
        update is 1/0.74 of DeepSpeed's with Adam's default betas). Deferred because DeepSpeed's model weights keep
        their undecayed values until its first applied step copies the masters back."""
        self._initial_step = None if hyperparameters is None else [dict(h) for h in hyperparameters]

    def replay_initial_step(self, hyperparameters: Sequence[Dict[str, Any]]) -> None:
        """One step with zero gradients under ``hyperparameters`` (per group); gradients and settings restored."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved_grads = [p.grad for p in params]
        saved_hyper = [{k: group[k] for k in hyper if k in group}
                       for group, hyper in zip(self.optimizer.param_groups, hyperparameters)]
        try:
            for group, hyper in zip(self.optimizer.param_groups, hyperparameters):
                group.update(hyper)
            for p in params:
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
        finally:
            for p, grad in zip(params, saved_grads):
                p.grad = grad
            for group, hyper in zip(self.optimizer.param_groups, saved_hyper):
                group.update(hyper)

    def follow_replaced_groups(self, before: Sequence[Dict[str, Any]], after: Sequence[Dict[str, Any]]) -> None:
        """Loading a checkpoint replaces the dense optimizer's param-group dicts (``torch.optim``'s
        ``load_state_dict`` builds new ones, which LR schedules drive from then on): each expert group follows the
        new dict at its source's position."""
        for source in self.lr_sources:
            index = next((i for i, g in enumerate(before) if g is source.group), None)
            if index is not None and index < len(after):
                source.group = after[index]

    def current_hyperparameters(self) -> List[Dict[str, Any]]:
        """What each expert group gets now (read before DeepSpeed's step advances the schedule)."""
        return [source.hyperparameters() for source in self.lr_sources]

    def step(self, grad_scale: float, hyperparameters: Sequence[Dict[str, Any]]) -> None:
        """Multiply accumulated gradients by ``grad_scale`` (averaging, unscale, clip), set the scheduled
        hyper-parameters, and step."""
        if self._initial_step is not None:
            initial, self._initial_step = self._initial_step, None
            self.replay_initial_step(initial)
        for group, hyper in zip(self.optimizer.param_groups, hyperparameters):
            group.update(hyper)
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        self._align_steps()
        self.optimizer.step()
        self._align_steps()

    def _align_steps(self) -> None:
        """One step count per group, as in DeepSpeed's flat groups. DeepSpeed's FusedAdam increments only the
        state of the last parameter of a group and uses that count for the whole group, so once re-sharding moved
        that parameter away the group fell back to a stale count; every parameter now carries the group's count."""
        for group in self.optimizer.param_groups:
            states = [self.optimizer.state[p] for p in group["params"] if "step" in self.optimizer.state.get(p, {})]
            if not states:
                continue
            count = max(float(state["step"]) for state in states)
            as_int = any(not torch.is_tensor(state["step"]) for state in states)
            for state in states:
                if as_int:
                    state["step"] = int(count)
                else:
                    state["step"].fill_(count)

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
