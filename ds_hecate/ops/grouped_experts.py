"""Every materialized expert of a layer call run at once, from one ``[E, numel]`` buffer of flat experts.

The buffer's rows are the experts (owned ones packed in, replicas received into the rest); the token rows arrive
grouped by expert in the buffer's row order. For an FFN expert (:class:`~ds_hecate.experts.FFNForm`) each projection
is one grouped GEMM over all experts (``torch.nn.functional.grouped_mm``): a fixed number of ops per layer call,
whatever the number of experts, where a per-expert loop launches about 5 kernels forward and 21 backward per
expert. The loop remains the path for generic ``nn.Module`` experts, for a torch release or device without
grouped GEMM, for operands grouped GEMM cannot take (16-byte alignment), for biased experts in fp16/bf16 (see
:func:`grouped_available`), and on the CPU for calls with few experts (:data:`CPU_GROUPED_MIN_EXPERTS`).
``DS_HECATE_GROUPED_MM=0`` forces the loop, ``=1`` grouped GEMM wherever it runs (benchmarks compare both).

Biases are added per row from the expert's bias row; their gradient is a segment sum (deterministic: no atomics).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..experts import ExpertKernel

#: "0": run experts in a per-expert loop even where grouped GEMM is available; "1": grouped GEMM wherever it runs,
#: whatever the number of experts; unset: the rule of :func:`grouped_available`.
GROUPED_MM_ENV = "DS_HECATE_GROUPED_MM"

#: On the CPU a launch costs nothing and the CPU's grouped GEMM is one GEMM per group plus its own bookkeeping, so
#: it pays only with many experts per call. Measured (``python -m benchmarks.layer_call``, 2-vCPU Xeon, fp32,
#: hidden 128): the experts' own fwd+bwd 19.5 ms grouped against 17.3 ms looped with 8 experts, 19.4 against 20.5
#: with 16, 30.9 against 32.4 with 64; the real 2-rank benchmark (8 experts, 4 to 6 per rank and call) ran 3-5%
#: slower end to end with grouped GEMM. On CUDA, where each of the loop's ~26 kernels per expert is a launch,
#: grouped GEMM is always taken.
CPU_GROUPED_MIN_EXPERTS = 16


def _plain_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.to(device)


@functools.lru_cache(maxsize=None)
def _no_offsets(device: torch.device) -> torch.Tensor:
    """The group ends of a part without experts (never written: grouped GEMM reads them)."""
    return torch.zeros(0, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class RowGroups:
    """How the grouped token rows split over the buffer's experts: ``sizes`` on the host, ``offs`` (int32 group
    ends, grouped GEMM's input) and ``lengths`` (int64) on the rows' device. Built from the plan's host tables, so
    nothing is read back from the device."""

    sizes: Tuple[int, ...]
    offs: torch.Tensor
    copy: Callable[[torch.Tensor, torch.device], torch.Tensor] = field(default=_plain_copy, repr=False,
                                                                       compare=False)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @functools.cached_property
    def lengths(self) -> torch.Tensor:
        """The sizes as int64 on the rows' device, copied when first asked for (only biased experts need them)."""
        return self.copy(torch.tensor(self.sizes, dtype=torch.int64), self.offs.device)

    @staticmethod
    def build(sizes: Sequence[int], device: torch.device,
              to_device: Callable[[torch.Tensor, torch.device], torch.Tensor] = _plain_copy) -> "RowGroups":
        """``to_device`` copies a small host tensor to the device (the runtime passes its pinned, non-blocking
        copy). No sizes (a part without experts): an empty table made once per device."""
        if not len(sizes):
            return RowGroups((), _no_offsets(device), to_device)
        host = np.asarray(sizes, dtype=np.int64)
        offs = to_device(torch.from_numpy(np.cumsum(host).astype(np.int32)), device)
        return RowGroups(tuple(int(s) for s in host), offs, to_device)

    def group_of_row(self) -> torch.Tensor:
        """The expert (buffer row) of every token row, on the device (no host read: the total is known)."""
        experts = torch.arange(len(self.sizes), device=self.offs.device)
        return torch.repeat_interleave(experts, self.lengths, output_size=self.total)

    def row_sums(self, grad: torch.Tensor) -> torch.Tensor:
        """Per expert, the sum of its rows of ``grad`` in fp32 (a bias gradient), deterministically: on the CPU an
        ``index_add_`` in row order (``segment_reduce`` is an order of magnitude slower there: 37 ms against 2.6 ms
        for 4,096 rows of 1,024 over 16 experts), elsewhere ``segment_reduce`` (no atomics)."""
        if grad.device.type != "cpu":
            return torch.segment_reduce(grad.float(), "sum", lengths=self.lengths, axis=0)
        sums = torch.zeros(len(self.sizes), grad.shape[1], dtype=torch.float32, device=grad.device)
        return sums.index_add_(0, self.group_of_row(), grad[:self.total].float())


@functools.lru_cache(maxsize=None)
def grouped_mm_supported(device_type: str, device_index: Optional[int], dtype: torch.dtype) -> bool:
    """Whether this torch release runs ``F.grouped_mm`` forward and backward on this device and dtype (one tiny
    trial per process and key; False rather than an error when it cannot)."""
    if not hasattr(F, "grouped_mm"):
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
        summed = ctx.groups.row_sums(grad)
        return grad, summed.to(ctx.bias_dtype), None, None


def grouped_available(kernel: ExpertKernel, buffer: torch.Tensor, experts: Optional[int] = None) -> bool:
    """Whether :func:`expert_outputs` can run ``kernel``'s experts as grouped GEMMs on ``buffer``'s device and dtype
    (the operands' alignment is checked per call).

    Biased experts in fp16/bf16 take the loop: ``F.linear`` rounds ``x W^T + b`` once, a grouped GEMM followed by
    the bias add would round twice (about half an ulp on every element: the oracle tests see it), except for
    experts whose own arithmetic adds the bias to the rounded product (``form.bias_apart``: Hugging Face's
    experts, e.g. GPT-OSS), which the grouped path computes exactly. On the CPU, unless ``DS_HECATE_GROUPED_MM`` says
    otherwise, only calls with at least :data:`CPU_GROUPED_MIN_EXPERTS` experts take grouped GEMM. ``experts``: the
    call's experts (default: ``buffer``'s rows; a call whose experts are in two parts passes their sum)."""
    form = kernel.form
    experts = buffer.shape[0] if experts is None else experts
    if form is None or experts == 0:
        return False
    if form.has_bias and not form.bias_apart and buffer.dtype != torch.float32:
        return False
    forced = os.environ.get(GROUPED_MM_ENV)   # read per call: the cached feature check below must not hold it
    if forced == "0" or (forced is None and buffer.device.type == "cpu" and experts < CPU_GROUPED_MIN_EXPERTS):
        return False
    return grouped_mm_supported(buffer.device.type, buffer.device.index, buffer.dtype)


def expert_outputs(kernel: ExpertKernel, buffer: torch.Tensor, rows: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """Outputs of expert ``j`` (row ``j`` of ``buffer``) on its ``groups.sizes[j]`` consecutive rows of ``rows``,
    concatenated in the same order. Differentiable in ``rows`` and ``buffer``."""
    weights = _grouped_weights(kernel, buffer, rows)
    if weights is not None:
        return kernel.form.run(_grouped_projection(weights, groups), rows, kernel.form.fusable(kernel.names))
    return _loop(kernel, buffer, rows, groups.sizes)


def _grouped_weights(kernel: ExpertKernel, buffer: torch.Tensor, rows: torch.Tensor) -> Optional[dict]:
    """The grouped GEMM's weight operands, or None where this call takes the loop."""
    if not grouped_available(kernel, buffer):
        return None
    weights = kernel.grouped_views(buffer, kernel.form.fusable(kernel.names))
    return weights if _aligned([rows, *weights.values()]) else None


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


def recomputed_expert_grads(kernel: ExpertKernel, buffer: torch.Tensor, rows: torch.Tensor, groups: RowGroups,
                            grad_out: torch.Tensor, want_rows: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gradients of :func:`expert_outputs` for ``buffer`` and (with ``want_rows``) ``rows``, recomputing the
    forward: re-materialization's backward, which runs inside the outer backward (no graph outlives the call).

    Grouped GEMM: one graph, one ``autograd.grad``. The loop: one expert's graph at a time, its gradient written
    into its row of one ``[E, numel]`` result, where autograd through ``unbind`` would keep every expert's gradient
    until ``unbind``'s backward stacks them: two copies of the layer's expert gradients at once, which the replica
    budget's bound (tests/test_memory_budget.py) does not allow. Same ops on the same operands as autograd through
    the loop, so the same numbers."""
    buffer, rows = buffer.detach(), rows.detach()
    with torch.enable_grad():
        if _grouped_weights(kernel, buffer, rows) is not None:
            leaf, x = buffer.requires_grad_(True), rows.requires_grad_(want_rows)
            got = torch.autograd.grad(expert_outputs(kernel, leaf, x, groups), [leaf] + ([x] if want_rows else []),
                                      grad_out, allow_unused=True)
            d_buffer = got[0] if got[0] is not None else torch.zeros_like(buffer)
            return d_buffer, ((got[1] if got[1] is not None else torch.zeros_like(rows)) if want_rows else None)
        d_buffer = torch.empty_like(buffer)
        d_rows = torch.empty_like(rows) if want_rows else None
        sizes = list(groups.sizes)
        row_grads = d_rows.split(sizes) if want_rows else [None] * len(sizes)
        for i, (flat, x, g) in enumerate(zip(buffer.unbind(0), rows.split(sizes), grad_out.split(sizes))):
            flat, x = flat.requires_grad_(True), x.requires_grad_(want_rows)
            got = torch.autograd.grad(kernel(flat, x), [flat] + ([x] if want_rows else []), g, allow_unused=True)
            d_buffer[i].copy_(got[0]) if got[0] is not None else d_buffer[i].zero_()
            if want_rows:
                row_grads[i].copy_(got[1]) if got[1] is not None else row_grads[i].zero_()
        return d_buffer, d_rows
