"""How a layer call's experts run, and every expert of one ``[E, numel]`` buffer run at once as a differentiable op.

The buffer's rows are the experts, the token rows arrive grouped by expert in the buffer's row order. An FFN expert
(:class:`~ds_hecate.experts.FFNForm`) runs on grouped GEMMs (:mod:`.grouped_ffn`): a fixed number of ops per call,
whatever the number of experts, where a per-expert loop through autograd launches about 5 kernels forward and 21
backward per expert. The per-expert loop remains the path for generic ``nn.Module`` experts, for biased experts in
fp16/bf16 (see :func:`grouped_path`) and where ``DS_HECATE_GROUPED_MM=0`` asks for it.

:func:`expert_outputs` is the same computation as a differentiable function of the rows and the buffer (the cost
probe and tests use it); the layer call itself runs it inside one autograd node (``runtime/sharded_experts.py``).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import torch

from ..experts import ExpertKernel
from .group_gemm import RowGroups, aligned, native_grouped_mm
from .grouped_ffn import FormGraph, GradPart, GroupedFFN, written_out

#: "0" when a layer is built: its experts run in the per-expert loop even where the grouped path runs; otherwise
#: the rule of :func:`grouped_path`.
GROUPED_MM_ENV = "DS_HECATE_GROUPED_MM"


def grouped_path(kernel: ExpertKernel, dtype: torch.dtype) -> bool:
    """Whether ``kernel``'s experts run on the grouped path in ``dtype`` (else the per-expert loop).

    Biased experts in fp16/bf16 take the loop: ``F.linear`` rounds ``x W^T + b`` once, a GEMM followed by the bias
    add rounds twice (about half an ulp on every element: the oracle tests see it), except experts whose own
    arithmetic adds the bias to the rounded product (``form.bias_apart``: Hugging Face's experts, e.g. GPT-OSS),
    which the grouped path computes exactly."""
    form = kernel.form
    if form is None or os.environ.get(GROUPED_MM_ENV) == "0":
        return False
    return not (form.has_bias and not form.bias_apart and dtype != torch.float32)


def native_for(operands: Sequence[torch.Tensor]) -> bool:
    """Whether grouped GEMMs run natively on these operands (device, dtype and 16-byte alignment): else the GEMMs
    loop over the host sizes (:mod:`.group_gemm`)."""
    first = operands[0]
    return native_grouped_mm(first.device, first.dtype) and aligned(operands)


class _BufferTarget:
    """A :class:`~.grouped_ffn.GradTarget` over a whole buffer's gradient, zero-filled, every column added."""

    def __init__(self, like: torch.Tensor) -> None:
        self.tensor = torch.zeros_like(like)

    def rows(self) -> torch.Tensor:
        return self.tensor

    def columns_view(self, lo: int, hi: int, shape):
        return self.tensor[:, lo:hi].view(self.tensor.shape[0], *shape)

    def is_fresh(self, name: str) -> bool:
        return False

    def written(self, names=None) -> None:
        pass


class _GroupedExperts(torch.autograd.Function):
    """The grouped path as one differentiable op of the rows and the buffer."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, buffer: torch.Tensor, kernel: ExpertKernel,
                groups: RowGroups) -> torch.Tensor:
        form = kernel.form
        assert form is not None, "the grouped path runs FFN experts only"
        fuse = form.fusable(kernel.names)
        views = kernel.grouped_views(buffer, fuse)
        native = native_for([rows, *views.values()])
        target = _BufferTarget(buffer)
        part = GradPart(target, kernel)
        compute: Union[GroupedFFN, FormGraph]
        out: torch.Tensor
        saved: Union[tuple, torch.Tensor]
        if written_out(form):
            compute = GroupedFFN(kernel)
            out, saved = compute.forward(views, rows, groups, native)
        else:
            compute = FormGraph(kernel)
            out, saved = compute.forward(views, rows, groups, native), rows
        ctx.state = (compute, views, saved, groups, part, target, native)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        compute, views, saved, groups, part, target, native = ctx.state
        need = ctx.needs_input_grad[0]
        if isinstance(compute, GroupedFFN):
            d_rows = compute.backward(views, saved, grad, groups, part, native, need)
        else:
            d_rows = compute.backward(views, saved, groups, native, part, grad, need)
        return d_rows, target.tensor, None, None


def expert_outputs(kernel: ExpertKernel, buffer: torch.Tensor, rows: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """Outputs of expert ``j`` (row ``j`` of ``buffer``) on its ``groups.sizes[j]`` consecutive rows of ``rows``,
    concatenated in the same order. Differentiable in ``rows`` and ``buffer``."""
    if buffer.shape[0] and grouped_path(kernel, buffer.dtype):
        return _GroupedExperts.apply(rows, buffer, kernel, groups)
    return loop(kernel, buffer, rows, groups.sizes)


def loop(kernel: ExpertKernel, buffer: torch.Tensor, rows: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """One expert at a time through autograd (``unbind``/``split`` views: no zero-filling backward)."""
    outs = [kernel(flat, x) for flat, x in zip(buffer.unbind(0), rows.split(list(sizes)))]
    return torch.cat(outs) if outs else rows


__all__ = ["GROUPED_MM_ENV", "RowGroups", "expert_outputs", "grouped_path", "loop", "native_for"]
