"""The weighted un-permute that ends a layer call: ``out[t] = sum_j w[j, t] * y[pos[j, t]]``.

``y`` holds the expert outputs returned to this rank (one row per routed slot that was not dropped, in send order)
followed by one zero row; ``pos[j, t]`` is the row of slot ``(j, t)`` (route ``j`` of token ``t``), the zero row for
a dropped slot. One op replaces the slot-order buffer (``[kS, H]`` zeros and an ``index_copy``) and the ``[k, S,
H]`` weighted product of the former combine; it loops over the ``k`` routes, never over experts.

Two arithmetics, the ones the callers' own code uses, so training is the same function:

- ``"deepspeed"`` (``deepspeed.moe``'s ``_sparse_decode``, :func:`ds_hecate.moe_layer.combine_routes`): fp32
  weights, fp32 products and sum, cast to ``y.dtype``;
- ``"hf"`` (transformers' eager experts): the weights cast to ``y.dtype``, products in ``y.dtype``, summed.

Backward follows the same formulas (the gradient of the weights is the router's gradient). On CUDA with the CuPy
transport the ``"deepspeed"`` forward runs the ``unpermute_combine`` kernel (``kernel``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

ARITHMETIC = ("deepspeed", "hf")


class WeightedUnpermute(torch.autograd.Function):
    """See the module docstring; ``pos`` is ``[k, S]`` int64 on ``y``'s device."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, arithmetic: str,
                kernel: Optional[Callable] = None) -> torch.Tensor:
        if arithmetic not in ARITHMETIC:
            raise ValueError(f"combine arithmetic must be one of {ARITHMETIC}, got {arithmetic!r}")
        ctx.arithmetic = arithmetic
        ctx.save_for_backward(y, weights, pos)
        k = pos.shape[0]
        if kernel is not None and arithmetic == "deepspeed":
            dump = y.shape[0] - 1
            return kernel(y, torch.where(pos == dump, -1, pos).reshape(-1), weights.float())
        out = None
        for j in range(k):
            rows = y.index_select(0, pos[j])
            if arithmetic == "deepspeed":
                w = weights[j].float().unsqueeze(-1)
                term = rows.float() * w   # rounded product, then the sum: DeepSpeed's (no fused multiply-add)
                out = term if out is None else out.add_(term)
            else:
                term = rows * weights[j].to(y.dtype).unsqueeze(-1)
                out = term.float() if out is None else out.add_(term)
        if out is None:   # k = 0
            return y.new_zeros(pos.shape[1], y.shape[1])
        return out.to(y.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, weights, pos = ctx.saved_tensors
        grad_y = y.new_empty(y.shape)   # every row is one slot's, but the zero row, which dropped slots all hit
        grad_w = torch.empty_like(weights)
        hf = ctx.arithmetic == "hf"
        g = grad if hf else grad.float()
        for j in range(pos.shape[0]):
            w = weights[j].to(y.dtype if hf else torch.float32).unsqueeze(-1)
            grad_y.index_copy_(0, pos[j], (g * w).to(y.dtype))
            rows = y.index_select(0, pos[j])
            grad_w[j] = (g * rows).sum(-1).to(weights.dtype) if hf else (g * rows.float()).sum(-1)
        grad_y[-1].zero_()   # the zero row carries no gradient (the token exchange drops it anyway)
        return grad_y, grad_w, None, None, None


def weighted_unpermute(y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, arithmetic: str = "deepspeed",
                       kernel: Optional[Callable] = None) -> torch.Tensor:
    """``[S, H]`` combined outputs (see the module docstring); ``weights`` ``[k, S]``, ``pos`` ``[k, S]``."""
    return WeightedUnpermute.apply(y, weights, pos, arithmetic, kernel)
