"""A permutation of token rows whose inverse is known, so that its backward is a gather too.

autograd's ``index_select`` backward scatters with ``index_add_``: several times slower than a gather on the CPU
and atomic on CUDA. The layer call permutes its received rows to expert-major order and back (both index vectors
built on the host from the plan's segment table: :mod:`ds_hecate.planning.segments`), so both directions are
gathers, forward and backward.
"""
from __future__ import annotations

import torch


def permute_rows(x: torch.Tensor, perm: torch.Tensor, pad_rows: int = 0) -> torch.Tensor:
    """``x[perm]`` followed by ``pad_rows`` zero rows (the combine's dropped slots point at them)."""
    if not pad_rows:
        return x.index_select(0, perm)
    out = x.new_empty((perm.shape[0] + pad_rows,) + tuple(x.shape[1:]))
    out[perm.shape[0]:].zero_()
    torch.index_select(x, 0, perm, out=out[:perm.shape[0]])
    return out


class Permute(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm`` whose inverse ``inverse`` is known (``pad_rows`` zero rows after it);
    the backward is the gather by the inverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor, pad_rows: int = 0) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.pad_rows = pad_rows
        return permute_rows(x, perm, pad_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        rows = grad[:grad.shape[0] - ctx.pad_rows] if ctx.pad_rows else grad
        return rows.index_select(0, inverse), None, None, None


__all__ = ["Permute", "permute_rows"]
