"""FFN experts as grouped GEMMs whose weight gradients go straight where they belong, never into a buffer-sized
gradient.

A layer call computes its materialized experts in two parts (:class:`~ds_hecate.comm.buffers.GatheredExperts`): the
rank's own experts from its resident compute-dtype weights, and the replicas from the rows SparseAllGather received.
Autograd through views of those weights would hand back one ``[experts, numel]`` gradient per part (every
projection's gradient concatenated: a full-size intermediate), which SparseReduceScatter then added into the
owner's fp32 accumulator (which had been zero-filled first). Here each projection is a :class:`SinkProjection`:
forward ``grouped_mm`` as before; backward the input gradient as autograd computes it, and the weight gradient of
every expert handed to a :class:`GradPart`, which writes it into its destination:

- the owned part into the owner's fp32 accumulator rows (the first contribution of the accumulation window
  written, later ones added: the values of zeros-then-add, without the zero fill);
- the replica part into the rows SparseReduceScatter sends, in the wire dtype.

The gradient is rounded exactly as autograd's: each expert's ``grad^T @ rows`` in the compute dtype, then converted
(fp32 accumulation, or the wire dtype). Where it is computed depends on the device (:func:`per_expert_products`):
on the CPU, with experts of at least :data:`CPU_DIRECT_MIN_BYTES` per projection, one ``mm`` per expert straight
into the destination rows (``out=``), so the weight gradient is written once, as a plain layer's is; otherwise one
``grouped_mm`` for every expert and one strided copy (or add) into the destination.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..experts import ExpertKernel
from .grouped_experts import RowGroups

#: On the CPU an expert projection's weight gradient of at least this many bytes is computed into its destination
#: with one ``mm`` per expert (no gradient-sized intermediate, no second pass); smaller ones take one grouped GEMM
#: and a copy, where the per-expert loop's Python cost (about 10 us an expert and projection) would exceed the
#: copy it saves. Measured (``python -m benchmarks.layer_versus``, 2-vCPU EPYC, fp32): 256x256 (256 KiB) experts
#: gain from the direct path, 64x64 (16 KiB) ones lose.
CPU_DIRECT_MIN_BYTES = 64 * 1024


def per_expert_products(device: torch.device, out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether a projection's weight gradients are computed one ``mm`` per expert into their destination (see the
    module docstring): on the CPU, for experts of at least :data:`CPU_DIRECT_MIN_BYTES`."""
    return device.type == "cpu" and out_features * in_features * dtype.itemsize >= CPU_DIRECT_MIN_BYTES


@torch.library.custom_op("ds_hecate::expert_weight_grads", mutates_args=("dest",))
def expert_weight_grads(grad: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor, sizes: List[int],
                        dest: torch.Tensor, accumulate: bool) -> None:
    """``dest[e] (+)= grad_e^T @ rows_e`` for every expert ``e`` (``sizes``: its rows, on the host; ``offs``: their
    ends on the device; ``dest``: ``[experts, out, in]``, any dtype, rows may be strided): each product rounded in
    ``grad``'s dtype, then written (``accumulate`` False) or added. One op at the dispatcher, as a grouped GEMM is:
    on the CPU with large experts (:func:`per_expert_products`) one ``mm`` per expert straight into ``dest`` (a
    loop of BLAS calls, as the CPU's grouped GEMM is inside); otherwise one grouped GEMM and one strided copy or
    add."""
    shape = tuple(dest.shape[1:])
    if per_expert_products(grad.device, shape[0], shape[1], grad.dtype):
        # the experts' rows and destinations cut once each (not two slices and a select per expert)
        total = sum(sizes)
        if grad.shape[0] != total:   # (rows past the experts' carry no weight gradient)
            grad, rows = grad[:total], rows[:total]
        for g, h, d in zip(grad.split(sizes), rows.split(sizes), dest.unbind(0)):
            if not accumulate and dest.dtype == grad.dtype:
                torch.mm(g.t(), h, out=d)
            elif not accumulate:
                d.copy_(torch.mm(g.t(), h))
            else:
                d.add_(torch.mm(g.t(), h))
        return
    products = F.grouped_mm(grad.t(), rows, offs=offs)   # [experts, out, in]
    if accumulate:
        dest.add_(products)
    else:
        dest.copy_(products)


class GradTarget(Protocol):
    """Rows a part's weight gradients go into (``[experts, numel]``) and, per parameter, whether its columns hold
    nothing of the accumulation yet (``is_fresh``: the first contribution is written, not added)."""

    def rows(self) -> torch.Tensor: ...

    def columns_view(self, lo: int, hi: int, shape: Tuple[int, ...]) -> torch.Tensor:
        """``rows()[:, lo:hi]`` as ``[experts, *shape]``."""
        ...

    def is_fresh(self, name: str) -> bool: ...

    def written(self, names: Optional[Sequence[str]] = None) -> None: ...


class SendRows:
    """A :class:`GradTarget` of one call's own: the replica rows' gradients SparseReduceScatter sends, ``[replicas,
    numel]`` in the wire dtype, allocated at the first delivery, every column fresh until written."""

    def __init__(self, replicas: int, kernel: ExpertKernel, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (replicas, kernel.numel)
        self.dtype, self.device = dtype, device
        self.fresh = set(kernel.names)
        self.tensor: Optional[torch.Tensor] = None

    def rows(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.tensor

    def columns_view(self, lo: int, hi: int, shape: Tuple[int, ...]) -> torch.Tensor:
        rows = self.rows()
        return rows[:, lo:hi].view(rows.shape[0], *shape)

    def is_fresh(self, name: str) -> bool:
        return name in self.fresh

    def written(self, names: Optional[Sequence[str]] = None) -> None:
        self.fresh.difference_update(self.fresh if names is None else names)


class GradPart:
    """One part's weight gradients into a :class:`GradTarget` (the owner's accumulator, or a call's
    :class:`SendRows`), a parameter's columns written where fresh and added otherwise, asked at delivery (another
    call of the same layer may have written them in the meantime). A fused name ``"a+b"`` spans ``a`` and ``b``."""

    def __init__(self, target: GradTarget, kernel: ExpertKernel) -> None:
        self.target = target
        self.kernel = kernel
        self.delivered: set = set()

    def columns(self, name: str) -> Tuple[int, int]:
        names = name.split("+")
        i, j = self.kernel.names.index(names[0]), self.kernel.names.index(names[-1])
        return sum(self.kernel.numels[:i]), sum(self.kernel.numels[:j + 1])

    def _write(self, name: str) -> bool:
        names = name.split("+")
        fresh = [self.target.is_fresh(n) for n in names]
        if any(fresh) and not all(fresh):
            raise RuntimeError(f"gradient columns of '{name}' partly written: a fused projection's parameters "
                               "were delivered apart")
        return all(fresh)

    def weight_grad(self, name: str, rows: torch.Tensor, grad: torch.Tensor, groups: RowGroups,
                    shape: Tuple[int, int]) -> None:
        """The weight gradient ``grad_e^T @ rows_e`` (``shape`` = (out, in)) of every expert ``e`` of the part."""
        experts = len(groups.sizes)
        if experts == 0:
            return
        lo, hi = self.columns(name)
        dest = self.target.columns_view(lo, hi, tuple(shape))
        expert_weight_grads(grad, rows, groups.offs, list(groups.sizes), dest, not self._write(name))
        self._done(name)

    def bias_grad(self, name: str, grad: torch.Tensor, groups: RowGroups, dtype: torch.dtype) -> None:
        """The bias gradient of every expert: its rows' gradients summed in fp32, segment by segment (as autograd
        through the row bias computes it), in ``dtype``."""
        if not groups.sizes:
            return
        lo, hi = self.columns(name)
        summed = groups.row_sums(grad).to(dtype)
        target = self.target.rows()[:, lo:hi]
        if self._write(name):
            target.copy_(summed)
        else:
            target.add_(summed)
        self._done(name)

    def _done(self, name: str) -> None:
        names = name.split("+")
        self.delivered.update(names)
        self.target.written(names)

    def finish(self, experts: int) -> None:
        """After the part's backward: the parameters no projection delivered (no backward ran through the part)
        get zero gradients, written where fresh (nothing to add where they are not)."""
        if experts == 0:
            return
        for name in self.kernel.names:
            if name not in self.delivered and self.target.is_fresh(name):
                lo, hi = self.columns(name)
                self.target.rows()[:, lo:hi].zero_()
                self.target.written([name])


class SinkProjection(torch.autograd.Function):
    """``rows @ weight_e^T (+ bias_e)`` for each expert ``e``'s rows (``weight``: ``[experts, out, in]``, ``bias``:
    ``[experts, out]`` or None, views of the part's weights, not differentiated); backward hands the weight (and
    bias) gradient to ``part`` and returns the rows' gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: RowGroups,
                part: GradPart, weight_name: str, bias_name: Optional[str]) -> torch.Tensor:
        rows = rows.contiguous()
        ctx.save_for_backward(rows, weight)
        ctx.groups, ctx.part, ctx.names = groups, part, (weight_name, bias_name)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        out = F.grouped_mm(rows, weight.transpose(1, 2), offs=groups.offs)
        if bias is not None:
            out = out + bias.index_select(0, groups.group_of_row())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        grad = grad.contiguous()
        weight_name, bias_name = ctx.names
        grad_rows = F.grouped_mm(grad, weight, offs=ctx.groups.offs) if ctx.needs_input_grad[0] else None
        ctx.part.weight_grad(weight_name, rows, grad, ctx.groups, tuple(weight.shape[1:]))
        if bias_name is not None:
            ctx.part.bias_grad(bias_name, grad, ctx.groups, ctx.bias_dtype)
        return grad_rows, None, None, None, None, None, None


def grouped_ffn(kernel: ExpertKernel, views: Dict[str, torch.Tensor], rows: torch.Tensor, groups: RowGroups,
                part: GradPart) -> torch.Tensor:
    """The FFN experts whose weights are ``views`` (``kernel.grouped_views`` of an ``[experts, numel]`` buffer, with
    the kernel's gate/up fusion) on their rows (grouped by expert, ``groups``), one grouped GEMM per projection;
    the weight gradients go to ``part`` in backward."""
    form = kernel.form
    fuse = form.fusable(kernel.names)

    def proj(h: torch.Tensor, name: str, bias: Optional[str]) -> torch.Tensor:
        return SinkProjection.apply(h, views[name], views[bias] if bias is not None else None, groups, part, name,
                                    bias)
    return form.run(proj, rows, fuse)
