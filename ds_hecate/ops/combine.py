"""The weighted un-permute that ends a layer call: ``out[t] = sum_j w[j, t] * y[pos[j, t]]``.

``y`` holds the expert outputs returned to this rank (one row per routed slot that was not dropped, in send order)
followed by one zero row (which the caller may leave out when no slot is dropped: with ``slots``, the rows after the
routed ones are the zero rows). The rows are placed by slot either way: ``slots[r]`` is the slot (``j * S + t``,
route ``j`` of token ``t``) of row ``r`` (the layer call's form: one copy of each row to its slot, a dropped slot's
row zero), or ``pos[j, t]`` is the row of slot ``(j, t)``, the zero row for a dropped slot (a gather; the CUDA
kernel's form). Then one product with the weights and the sum over routes: a fixed handful of ops whatever ``k``
and the number of experts.

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

from .casts import cast

ARITHMETIC = ("deepspeed", "hf")


class WeightedUnpermute(torch.autograd.Function):
    """See the module docstring; ``pos`` (``[k, S]``) or ``slots`` int64 on ``y``'s device.

    No loop over ops per route: every slot's row in one op (``[k, S, H]``), one product with the weights, and
    the sum over ``j`` as ``k - 1`` in-place adds in ``j`` order (the order the CUDA kernel and the reference add in:
    a ``sum`` over the route dimension may pair them otherwise). Backward: one product and one scatter for the
    rows' gradient, one product and one reduction over ``H`` for the weights'."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, pos: Optional[torch.Tensor], arithmetic: str,
                kernel: Optional[Callable] = None, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        if arithmetic not in ARITHMETIC:
            raise ValueError(f"combine arithmetic must be one of {ARITHMETIC}, got {arithmetic!r}")
        ctx.arithmetic, ctx.slots = arithmetic, slots
        k, num_tokens = weights.shape
        weights = weights.contiguous()   # [k, S] from a [S, k] router output: a strided product is slow
        ctx.y_shape = y.shape
        if kernel is not None and arithmetic == "deepspeed":
            if pos is None:
                assert slots is not None   # the caller gives pos or slots
                pos = slot_positions(slots, k * num_tokens)
            ctx.save_for_backward(y.index_select(0, pos.reshape(-1)).view(k, num_tokens, y.shape[1]), weights, pos)
            dump = slots.shape[0] if slots is not None else y.shape[0] - 1   # the zero row, if any
            return kernel(y, torch.where(pos == dump, -1, pos).reshape(-1), weights.float())
        if k == 0:
            ctx.save_for_backward(y.new_empty(0, num_tokens, y.shape[1]), weights, pos)
            return y.new_zeros(num_tokens, y.shape[1])
        if slots is not None:   # each routed row to its slot (a dropped slot's row stays zero): no positions built
            routed = slots.shape[0]
            rows = (y.new_zeros if routed < k * num_tokens else y.new_empty)(k * num_tokens, y.shape[1])
            rows = rows.index_copy_(0, slots, y if y.shape[0] == routed else y[:routed])
            rows = rows.view(k, num_tokens, y.shape[1])
        else:
            assert pos is not None
            rows = y.index_select(0, pos.reshape(-1)).view(k, num_tokens, y.shape[1])
        ctx.save_for_backward(rows, weights, pos)   # the gathered rows, for the weights' gradient
        if arithmetic == "deepspeed":   # rounded fp32 products, then the sum (no fused multiply-add): DeepSpeed's
            terms = _times(rows, cast(weights, torch.float32).unsqueeze(-1))
        else:
            terms = cast(rows * cast(weights, y.dtype).unsqueeze(-1), torch.float32)
        first, *rest = terms.unbind(0)
        for term in rest:
            first.add_(term)
        return cast(first, y.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weights, pos = ctx.saved_tensors
        k, num_tokens = weights.shape
        hf = ctx.arithmetic == "hf"
        g = (grad if hf else cast(grad, torch.float32)).unsqueeze(0)
        w = cast(weights, rows.dtype if hf else torch.float32).unsqueeze(-1)
        per_slot = cast(g * w, rows.dtype).reshape(k * num_tokens, rows.shape[-1])
        grad_y = rows.new_empty(ctx.y_shape)   # every row is one slot's, but a zero row, which dropped slots hit
        if ctx.slots is not None:   # row r is slot slots[r]: a gather (a scatter is several times slower)
            routed = ctx.slots.shape[0]
            padded = routed < grad_y.shape[0]
            torch.index_select(per_slot, 0, ctx.slots, out=grad_y[:routed] if padded else grad_y)
            if padded:
                grad_y[routed:].zero_()   # the zero row carries no gradient (the token exchange drops it)
        else:
            grad_y.index_copy_(0, pos.reshape(-1), per_slot)
            grad_y[-1].zero_()
        grad_w = cast(((g * rows) if hf else _times(rows, g)).sum(-1), weights.dtype)
        return grad_y, grad_w, None, None, None, None


def _times(rows: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``rows.float() * factor`` (``factor`` fp32, broadcast to ``rows``' shape) in a new tensor: half-precision rows
    are converted once and multiplied in place (a mixed-dtype product converts inside the loop, about twice as slow
    on the CPU; the same values either way)."""
    if rows.dtype == torch.float32:
        return rows * factor
    return rows.float().mul_(factor)


def slot_positions(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``pos`` from ``slots``: the row of every slot, ``slots.shape[0]`` (the zero row) for a slot no row is."""
    pos = torch.full((num_slots,), slots.shape[0], dtype=torch.int64, device=slots.device)
    return pos.scatter_(0, slots, torch.arange(slots.shape[0], device=slots.device))


def weighted_unpermute(y: torch.Tensor, weights: torch.Tensor, pos: Optional[torch.Tensor],
                       arithmetic: str = "deepspeed", kernel: Optional[Callable] = None,
                       slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[S, H]`` combined outputs (see the module docstring); ``weights`` ``[k, S]``; ``pos`` ``[k, S]``, or
    ``slots``: row ``r`` of ``y`` is slot ``slots[r]`` (the rows after them zero rows), which makes forward a copy of
    each row to its slot and backward a gather (``pos`` is then built only for a kernel that takes it)."""
    return WeightedUnpermute.apply(y, weights, pos, arithmetic, kernel, slots)
