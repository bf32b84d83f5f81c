"""Every materialized expert of a layer call run at once, from one ``[E, numel]`` buffer of flat experts.

The buffer's rows are the experts (owned ones packed in, replicas received into the rest); the token rows arrive
grouped by expert in the buffer's row order. For an FFN expert (:class:`~ds_hecate.experts.FFNForm`) each projection
is one grouped GEMM over all experts (``torch.nn.functional.grouped_mm``): a fixed number of ops per layer call,
whatever the number of experts, where a per-expert loop launches about 5 kernels forward and 21 backward per
expert. The loop remains the path for generic ``nn.Module`` experts, for a torch release or device without
grouped GEMM, for operands grouped GEMM cannot take (16-byte alignment), for biased experts in fp16/bf16 (see
:func:`grouped_available`), and can be forced with ``DS_HECATE_GROUPED_MM=0`` (benchmarks compare both).

Biases are added per row from the expert's bias row; their gradient is a segment sum (deterministic: no atomics).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..experts import ExpertKernel

#: Set to "0" to run experts in a per-expert loop even where grouped GEMM is available.
GROUPED_MM_ENV = "DS_HECATE_GROUPED_MM"


@dataclass(frozen=True)
class RowGroups:
    """How the grouped token rows split over the buffer's experts: ``sizes`` on the host, ``offs`` (int32 group
    ends, grouped GEMM's input) and ``lengths`` (int64) on the rows' device. Built from the plan's host tables, so
    nothing is read back from the device."""

    sizes: Tuple[int, ...]
    offs: torch.Tensor
    lengths: torch.Tensor

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @staticmethod
    def build(sizes: Sequence[int], device: torch.device,
              to_device=lambda t, device: t.to(device)) -> "RowGroups":
        """``to_device`` copies a small host tensor to the device (the runtime passes its pinned, non-blocking
        copy)."""
        host = np.asarray(sizes, dtype=np.int64)
        lengths = to_device(torch.from_numpy(host.copy()), device)
        offs = to_device(torch.from_numpy(np.cumsum(host).astype(np.int32)), device)
        return RowGroups(tuple(int(s) for s in host), offs, lengths)

    def group_of_row(self) -> torch.Tensor:
        """The expert (buffer row) of every token row, on the device (no host read: the total is known)."""
        experts = torch.arange(len(self.sizes), device=self.lengths.device)
        return torch.repeat_interleave(experts, self.lengths, output_size=self.total)


@functools.lru_cache(maxsize=None)
def grouped_mm_supported(device_type: str, device_index: Optional[int], dtype: torch.dtype) -> bool:
    """Whether this torch release runs ``F.grouped_mm`` forward and backward on this device and dtype (one tiny
    trial per process and key; False rather than an error when it cannot)."""
    if os.environ.get(GROUPED_MM_ENV, "1") == "0" or not hasattr(F, "grouped_mm"):
        return False
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        # Own saved-tensor hooks: a trial that runs inside a checkpointed region must not add to its saved tensors
        # (the recompute, which finds the answer cached, would then save fewer and fail checkpoint's check).
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), torch.enable_grad():
            a = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            b = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
            out = F.grouped_mm(a, b.transpose(1, 2), offs=offs)
            torch.autograd.grad(out, (a, b), torch.ones_like(out))
        return True
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def _aligned(tensors: Sequence[torch.Tensor]) -> bool:
    """Grouped GEMM needs 16-byte aligned operands and strides (except unit strides), on the CPU too."""
    for t in tensors:
        item = t.element_size()
        if t.data_ptr() % 16 or any(s != 1 and (s * item) % 16 for s in t.stride()):
            return False
    return True


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped GEMM's backward needs one; a ``sum()``
    upstream gives an expanded, zero-stride gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _RowBias(torch.autograd.Function):
    """``h + bias[group of row]``; the bias gradient is the per-expert sum of the rows' gradients, summed in fp32
    segment by segment (deterministic, unlike an atomic ``index_add``)."""

    @staticmethod
    def forward(ctx, h, bias, groups: RowGroups, group_of_row):
        ctx.groups, ctx.bias_dtype = groups, bias.dtype
        return h + bias.index_select(0, group_of_row)

    @staticmethod
    def backward(ctx, grad):
        summed = torch.segment_reduce(grad.float(), "sum", lengths=ctx.groups.lengths, axis=0)
        return grad, summed.to(ctx.bias_dtype), None, None


def grouped_available(kernel: ExpertKernel, buffer: torch.Tensor) -> bool:
    """Whether :func:`expert_outputs` can run ``kernel``'s experts as grouped GEMMs on ``buffer``'s device and dtype
    (the operands' alignment is checked per call).

    Biased experts in fp16/bf16 take the loop: ``F.linear`` rounds ``x W^T + b`` once, a grouped GEMM followed by
    the bias add would round twice (about half an ulp on every element: the oracle tests see it). The FFN experts
    of the MoE models that matter on GPUs have no biases."""
    form = kernel.form
    if form is None or buffer.shape[0] == 0:
        return False
    biased = any(b is not None for b in (form.up_bias, form.gate_bias, form.down_bias))
    if biased and buffer.dtype != torch.float32:
        return False
    return grouped_mm_supported(buffer.device.type, buffer.device.index, buffer.dtype)


def expert_outputs(kernel: ExpertKernel, buffer: torch.Tensor, rows: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """Outputs of expert ``j`` (row ``j`` of ``buffer``) on its ``groups.sizes[j]`` consecutive rows of ``rows``,
    concatenated in the same order. Differentiable in ``rows`` and ``buffer``."""
    if grouped_available(kernel, buffer):
        form = kernel.form
        fuse = form.fusable(kernel.names)
        weights = kernel.grouped_views(buffer, fuse)
        if _aligned([rows, *weights.values()]):
            return form.run(_grouped_projection(weights, groups), rows, fuse)
    return _loop(kernel, buffer, rows, groups.sizes)


def _grouped_projection(weights, groups: RowGroups):
    group_of_row = []   # computed once, on the first biased projection

    def proj(h: torch.Tensor, name: str, bias: Optional[str]) -> torch.Tensor:
        out = _ContiguousGrad.apply(F.grouped_mm(h.contiguous(), weights[name].transpose(1, 2), offs=groups.offs))
        if bias is None:
            return out
        if not group_of_row:
            group_of_row.append(groups.group_of_row())
        return _RowBias.apply(out, weights[bias], groups, group_of_row[0])
    return proj


def _loop(kernel: ExpertKernel, buffer: torch.Tensor, rows: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """One expert at a time (``unbind``/``split`` views: no zero-filling backward)."""
    outs = [kernel(flat, x) for flat, x in zip(buffer.unbind(0), rows.split(list(sizes)))]
    return torch.cat(outs) if outs else rows
