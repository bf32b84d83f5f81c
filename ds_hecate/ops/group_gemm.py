"""The GEMMs of a layer call's experts over their groups of token rows, without a host read of the device.

The token rows arrive grouped by expert (``RowGroups``: the sizes on the host, where the plan made them, and their
ends on the device). Three products run over those groups: the projection ``x_e @ W_e^T``, its input gradient
``g_e @ W_e`` and its weight gradient ``g_e^T @ x_e``. Where ``F.grouped_mm`` has a kernel that reads its offsets
on the device (the CPU, where it loops over ``mm`` in C++; bf16 on sm90 and sm100 GPUs), each is one grouped GEMM.
Elsewhere (fp32 and fp16 on CUDA, pre-Hopper GPUs) ``grouped_mm`` falls back to a loop that copies the offsets to
the host, a synchronisation per GEMM; there the loop runs here over the host sizes instead, with no read of the
device (:func:`native_grouped_mm`).

Every product is rounded as autograd rounds it through ``F.linear``: each expert's ``mm`` in the operands' dtype.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

#: On the CPU an expert's weight gradient of at least this many bytes is computed into its destination with one
#: ``mm`` per expert (``out=``: no gradient-sized intermediate, no second pass over it); smaller ones take one
#: grouped GEMM and one strided copy, where the loop's per-expert host cost would exceed the copy it saves.
CPU_DIRECT_MIN_BYTES = 64 * 1024


def _plain_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.to(device)


@functools.lru_cache(maxsize=None)
def _no_offsets(device: torch.device) -> torch.Tensor:
    """The group ends of a part without experts (never written: grouped GEMM reads them)."""
    return torch.zeros(0, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class RowGroups:
    """How grouped token rows split over a part's experts: ``sizes`` on the host, ``offs`` (int32 group ends,
    grouped GEMM's input) on the rows' device. Built from the plan's host tables, so nothing is read back from the
    device."""

    sizes: Tuple[int, ...]
    offs: torch.Tensor
    copy: Callable[[torch.Tensor, torch.device], torch.Tensor] = field(default=_plain_copy, repr=False,
                                                                       compare=False)
    #: the rows of every group together (``sum(sizes)``, counted once: every GEMM of the call asks for it)
    total: int = field(default=-1, compare=False)

    def __post_init__(self) -> None:
        if self.total < 0:
            object.__setattr__(self, "total", sum(self.sizes))

    @functools.cached_property
    def lengths(self) -> torch.Tensor:
        """The sizes as int64 on the rows' device, copied when first asked for (only biased experts need them)."""
        return self.copy(torch.tensor(self.sizes, dtype=torch.int64), self.offs.device)

    @functools.cached_property
    def empty(self) -> Optional[torch.Tensor]:
        """The experts without rows, on the device (None when every expert has rows)."""
        if 0 not in self.sizes:
            return None
        idle = [i for i, s in enumerate(self.sizes) if s == 0]
        return self.copy(torch.tensor(idle, dtype=torch.int64), self.offs.device)

    @staticmethod
    def build(sizes: Sequence[int], device: torch.device,
              to_device: Callable[[torch.Tensor, torch.device], torch.Tensor] = _plain_copy) -> "RowGroups":
        """``to_device`` copies a small host tensor to the device (the runtime passes its pinned, non-blocking
        copy). No sizes (a part without experts): an empty table made once per device."""
        if not len(sizes):
            return RowGroups((), _no_offsets(device), to_device)
        # (the running sum of a few host ints: one pass, no intermediate arrays; group ends below 2**31 rows)
        ends = np.fromiter(itertools.accumulate(sizes), dtype=np.int32, count=len(sizes))
        return RowGroups(tuple(map(int, sizes)), to_device(torch.from_numpy(ends), device), to_device, int(ends[-1]))

    def group_of_row(self) -> torch.Tensor:
        """The expert of every token row, on the device (no host read: the total is known)."""
        experts = torch.arange(len(self.sizes), device=self.offs.device)
        return torch.repeat_interleave(experts, self.lengths, output_size=self.total)


@functools.lru_cache(maxsize=None)
def grouped_mm_runs(device_type: str, device_index: Optional[int], dtype: torch.dtype) -> bool:
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


def native_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` runs here without reading its offsets on the host: on the CPU (a C++ loop over
    ``mm``, nothing to synchronise), and on CUDA only in bf16 on sm90 (Hopper) and sm100 (Blackwell), where its
    kernel takes the offsets on the device; every other CUDA case falls back to a loop that copies them to the
    host. Where False, :func:`linear` and its gradients loop over the host sizes instead."""
    if device.type == "cuda":
        if dtype != torch.bfloat16 or torch.cuda.get_device_capability(device.index)[0] not in (9, 10):
            return False
    return grouped_mm_runs(device.type, device.index, dtype)


def aligned(tensors: Sequence[torch.Tensor]) -> bool:
    """Grouped GEMM needs 16-byte aligned operands and strides (except unit strides), on the CPU too."""
    for t in tensors:
        item = t.element_size()
        if t.data_ptr() % 16 or any(s != 1 and (s * item) % 16 for s in t.stride()):
            return False
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, groups: RowGroups, native: bool) -> torch.Tensor:
    """``x_e @ weight[e]^T`` for every expert's rows (``weight``: ``[experts, out, in]``), ``[rows, out]``."""
    if native:
        return F.grouped_mm(x, weight.transpose(1, 2), offs=groups.offs)
    outs = [F.linear(rows, w) for rows, w in zip(x.split(list(groups.sizes)), weight.unbind(0))]
    return torch.cat(outs) if outs else x.new_empty(0, weight.shape[1])


def input_grad(grad: torch.Tensor, weight: torch.Tensor, groups: RowGroups, native: bool) -> torch.Tensor:
    """``grad_e @ weight[e]``: the gradient of :func:`linear`'s input, ``[rows, in]``."""
    if native:
        return F.grouped_mm(grad, weight, offs=groups.offs)
    outs = [torch.mm(g, w) for g, w in zip(grad.split(list(groups.sizes)), weight.unbind(0))]
    return torch.cat(outs) if outs else grad.new_empty(0, weight.shape[2])


def weight_grads(grad: torch.Tensor, rows: torch.Tensor, groups: RowGroups, dest: torch.Tensor, accumulate: bool,
                 native: bool) -> None:
    """``dest[e] (+)= grad_e^T @ rows_e`` for every expert ``e`` (``dest``: ``[experts, out, in]``, any dtype, its
    rows may be strided): each product rounded in ``grad``'s dtype, then written (``accumulate`` False) or added.

    On the CPU with large experts, one ``mm`` per expert straight into ``dest`` (the weight gradient written once,
    as a plain layer's is); elsewhere one grouped GEMM and one copy or add, with the products of experts that have
    no rows set to zero first (a grouped GEMM leaves them undefined on some GPUs); without a native grouped GEMM
    one ``mm`` per expert over the host sizes."""
    total = groups.total
    if grad.shape[0] != total:   # (rows past the experts' carry no weight gradient)
        grad, rows = grad[:total], rows[:total]
    direct = (dest.shape[1] * dest.shape[2] * grad.element_size() >= CPU_DIRECT_MIN_BYTES
              and grad.device.type == "cpu")
    if direct or not native:
        sizes = list(groups.sizes)
        for g, h, d in zip(grad.split(sizes), rows.split(sizes), dest.unbind(0)):
            if not accumulate and d.dtype == g.dtype and direct:
                torch.mm(g.t(), h, out=d)
            elif not accumulate:
                d.copy_(torch.mm(g.t(), h))
            else:
                d.add_(torch.mm(g.t(), h))
        return
    products = F.grouped_mm(grad.t(), rows, offs=groups.offs)   # [experts, out, in]
    if groups.empty is not None:
        products.index_fill_(0, groups.empty, 0)
    if accumulate:
        dest.add_(products)
    else:
        dest.copy_(products)


def add_row_bias(out: torch.Tensor, bias: torch.Tensor, groups: RowGroups, rows_of: List[torch.Tensor]) -> torch.Tensor:
    """``out + bias[expert of row]``; ``rows_of`` caches the expert of every row for the part's projections."""
    if not rows_of:
        rows_of.append(groups.group_of_row())
    return out + bias.index_select(0, rows_of[0])


def bias_grads(grad: torch.Tensor, groups: RowGroups, dtype: torch.dtype) -> torch.Tensor:
    """Every expert's bias gradient: its rows' gradients summed in fp32 in row order (deterministic, as autograd
    through the row bias computes it), in ``dtype``. On the CPU one ``index_add_`` over the rows' experts
    (``segment_reduce`` is an order of magnitude slower there: 37 ms against 2.6 ms for 4,096 rows of 1,024 over 16
    experts; the same sums, each from zero in row order); elsewhere ``segment_reduce`` (no atomics) with
    ``unsafe``: the lengths come from the plan and sum to the rows, so the op's own check, a host read of the
    lengths on CUDA, is skipped."""
    total = groups.total
    rows = grad if grad.shape[0] == total else grad[:total]
    if rows.device.type == "cpu":
        sums = torch.zeros(len(groups.sizes), rows.shape[1], dtype=torch.float32, device=rows.device)
        return sums.index_add_(0, groups.group_of_row(), rows.float()).to(dtype)
    return torch.segment_reduce(rows.float(), "sum", lengths=groups.lengths, axis=0, unsafe=True).to(dtype)


__all__ = ["CPU_DIRECT_MIN_BYTES", "RowGroups", "add_row_bias", "aligned", "bias_grads", "grouped_mm_runs",
           "input_grad", "linear", "native_grouped_mm", "weight_grads"]
