"""The ``"hecate"`` experts implementation for transformers' ``ExpertsInterface``, and the expert kernel of an
experts module.

HF's MoE block keeps its router and calls ``experts(hidden_states [T, H], top_k_index [T, K],
top_k_weights [T, K])``; the decorated experts class looks the compute up under
``config._experts_implementation``. Registering ``"hecate"`` there lets Hecate replace exactly the routed
experts' compute (and, having removed their parameters, their storage) and nothing else.

The kernel (:func:`experts_kernel`) does what transformers' own experts kernels do, per expert or grouped:
``down(gated(gate_up x + b) ) + b`` with the class's gate (its ``_apply_gate``, or ``act_fn(gate) * up`` on
concatenated or interleaved rows), ``down(act(up x))`` without a gate, then the post-expert norm if the class has a
parameter-free one. Every module the kernel calls runs without its hooks (:func:`hook_free`).
"""
from __future__ import annotations

import inspect
import types
from typing import Any, Callable

import torch
from torch import nn

from ..errors import HecateModelError
from ..experts import ExpertKernel, FFNForm
from .layouts import ExpertsSpec

IMPLEMENTATION = "hecate"


class ExpertTemplate(nn.Module):
    """One expert's parameters in Hecate's orientation (weights ``[out, in]``, then biases), on the meta device:
    only the layout is used (the flat vector's order, names and shapes)."""

    def __init__(self, spec: ExpertsSpec) -> None:
        super().__init__()
        for param in spec.params:
            self.register_parameter(param.name, nn.Parameter(torch.empty(param.shape, device="meta")))


def hook_free(act_fn: Callable, where: str) -> Callable[..., torch.Tensor]:
    """``act_fn`` as a plain function: a module's own ``forward``, which runs none of the module's hooks.

    Why: the experts module's ``act_fn`` is a submodule of the model, and under ZeRO-3 every submodule outside a
    leaf carries DeepSpeed's forward/backward hooks, which record each call into a per-rank module trace that the
    ranks must agree on. Hecate runs the activation once per materialized expert (the loop) or once per call
    (grouped), a number that depends on the rank's placement and tokens; called through the module it made the
    traces differ (OLMoE, DeepSeek-V3 or any model with ``leaf_module.classes: []``: a list-length disagreement
    or a hang). An activation with parameters would need ZeRO-3 to gather them, so it is refused by name."""
    if not isinstance(act_fn, nn.Module):
        return act_fn
    if any(True for _ in act_fn.parameters()) or any(True for _ in act_fn.buffers()):
        raise HecateModelError(f"{where}: the activation {type(act_fn).__name__} has parameters or buffers; Hecate "
                               "runs parameter-free activations only (see docs/huggingface.md#supported-models)")
    return act_fn.forward


class HookFreeView:
    """The experts module as its own ``_apply_gate`` reads it: the module's attributes, with every submodule
    replaced by its hook-free forward (:func:`hook_free`), so that ``self.act_fn(gate)`` inside the class's gate
    runs no ZeRO-3 hook either (the rule above, for the class's code)."""

    def __init__(self, module: nn.Module, where: str) -> None:
        self._module = module
        self._where = where

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if isinstance(value, nn.Module):
            value = hook_free(value, self._where)
            self.__dict__[name] = value   # resolved once
        return value


def own_gate(module: nn.Module, where: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The class's ``_apply_gate`` bound to a :class:`HookFreeView` of ``module``."""
    gate = inspect.getattr_static(type(module), "_apply_gate")
    if isinstance(gate, staticmethod):
        return gate.__func__
    if not inspect.isfunction(gate):
        raise HecateModelError(f"{where}: its _apply_gate is a {type(gate).__name__}, not a method Hecate can call")
    return types.MethodType(gate, HookFreeView(module, where))


def experts_form(spec: ExpertsSpec, module: nn.Module, where: str) -> FFNForm:
    """The :class:`FFNForm` of an experts module of layout ``spec.layout`` (transformers' arithmetic: the bias
    added to the product, :attr:`FFNForm.bias_apart`)."""
    layout = spec.layout
    act_fn = getattr(module, "act_fn", None)
    if act_fn is None and not layout.own_gate:
        raise HecateModelError(f"{where}: it has no act_fn (and no _apply_gate of its own); Hecate needs the "
                               "activation the experts interface calls")
    act = hook_free(act_fn, where) if act_fn is not None else torch.nn.functional.silu
    post = hook_free(getattr(module, "post_expert_norm"), where) if layout.post_expert_norm else None
    first, down = spec.first, spec.down
    if not layout.gate:
        return FFNForm(act=act, up=first, up_bias=spec.bias_of(first), down=down, down_bias=spec.bias_of(down),
                       post=post, bias_apart=True)
    return FFNForm(act=act, gate_up=first, gate_up_bias=spec.bias_of(first), down=down, down_bias=spec.bias_of(down),
                   interleaved=not layout.concatenated, glu=own_gate(module, where) if layout.own_gate else None,
                   post=post, bias_apart=True)


def experts_kernel(spec: ExpertsSpec, module: nn.Module, where: str = "experts module") -> ExpertKernel:
    """The :class:`ExpertKernel` of one expert of ``module`` (its flat layout from ``spec``, its form from the
    module's layout), carrying the layout a checkpoint records for ``consolidate``."""
    kernel = ExpertKernel(ExpertTemplate(spec), form=experts_form(spec, module, where))
    kernel.source_layout = spec.source_layout(type(module).__name__)
    return kernel


def hecate_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """Routed-experts output ``[T, H]``: Hecate runs every (token, expert) pair, the weighted top-k sum is
    taken here exactly as HF's eager path weights it (output times routing weight, summed over k)."""
    binding = module.__dict__.get("_hecate_binding")
    if binding is None:
        raise HecateModelError(
            f"{type(module).__name__} runs with experts_implementation='{IMPLEMENTATION}' but Hecate has not taken "
            "it over (Hecate sets this itself in deepspeed.initialize with hecate.enabled; do not select it by hand)")
    num_tokens = hidden_states.shape[0]
    k = top_k_index.shape[-1]
    indices = top_k_index.reshape(num_tokens, k).t()
    weights = top_k_weights.reshape(num_tokens, k).t()
    out = binding.run(hidden_states, indices, weights, "hf")  # HF's arithmetic: weights in the output dtype
    return out.to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Register ``"hecate"`` in transformers' experts registry (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, hecate_experts_forward)
