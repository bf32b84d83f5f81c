"""The ``"hecate"`` experts implementation for transformers' ``ExpertsInterface``, and the per-expert kernel.

HF's MoE block keeps its router and calls ``experts(hidden_states [T, H], top_k_index [T, K],
top_k_weights [T, K])``; the decorated experts class looks the compute up under
``config._experts_implementation``. Registering ``"hecate"`` there lets Hecate replace exactly the routed
experts' compute (and, having removed their parameters, their storage) and nothing else.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import HecateModelError
from ..experts import ExpertKernel, FFNForm
from ..runtime.tensor_parallel import run_layer

IMPLEMENTATION = "hecate"


class FusedExpertSlice(nn.Module):
    """Expert ``e`` of a fused HF experts module: ``gate_up_proj[e]`` ``[2F, H]`` and ``down_proj[e]`` ``[H, F]``.

    Only its layout is used (Hecate's flat per-expert vector is ``gate_up`` then ``down``, row-major); the
    parameters live on the meta device.
    """

    def __init__(self, gate_up_shape: torch.Size, down_shape: torch.Size, act_fn: Callable) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(gate_up_shape, device="meta"))
        self.down_proj = nn.Parameter(torch.empty(down_shape, device="meta"))
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj)


def hook_free(act_fn: Callable, where: str) -> Callable[[torch.Tensor], torch.Tensor]:
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
                               "runs parameter-free activations only (see docs/huggingface.md#adding-an-architecture)")
    return act_fn.forward


def fused_expert_kernel(gate_up_shape: torch.Size, down_shape: torch.Size, act_fn: Callable,
                        where: str = "experts module") -> ExpertKernel:
    """An :class:`ExpertKernel` for one fused HF expert, whose form does HF's eager arithmetic:
    ``gate, up = linear(x, gate_up).chunk(2)``, ``linear(act(gate) * up, down)`` (per expert or grouped). The
    activation runs hook-free (:func:`hook_free`)."""
    act = hook_free(act_fn, where)
    return ExpertKernel(FusedExpertSlice(gate_up_shape, down_shape, act),
                        form=FFNForm(act=act, gate_up="gate_up_proj", down="down_proj"))


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
    out = run_layer(binding, hidden_states, indices, weights, "hf")  # HF's arithmetic: weights in the output dtype
    return out.to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Register ``"hecate"`` in transformers' experts registry (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, hecate_experts_forward)
