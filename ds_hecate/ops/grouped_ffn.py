"""FFN experts over grouped GEMMs, forward and backward written out, weight gradients straight to where they belong.

A layer call computes its materialized experts in two parts (the rank's own experts from its resident weights, the
replicas from the rows SparseAllGather received). :class:`GroupedFFN` runs one part: forward the projections of the
expert's :class:`~ds_hecate.experts.FFNForm` as grouped GEMMs (:mod:`.group_gemm`) and its elementwise activation;
backward the same formulas autograd would apply, op for op (so the same bits), with every projection's weight (and
bias) gradient handed to a :class:`GradPart`, which writes it into its destination:

- the owned part into the owner's fp32 accumulator rows (the first contribution of the accumulation window
  written, later ones added: the values of zeros-then-add, without the zero fill);
- the replica part into the rows SparseReduceScatter sends, in the wire dtype (:class:`SendRows`).

No autograd graph is recorded inside: the caller (``runtime/sharded_experts.py``) wraps a whole call in one autograd
node. The activations written out are SiLU, exact GELU, ReLU and tanh (:data:`ACTIVATIONS`); a form with another
activation, or with fields this module does not know, runs its own arithmetic on a small graph of its own
(:class:`FormGraph`), its projections still grouped GEMMs whose weight gradients go to the same destinations.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..experts import ExpertKernel, FFNForm
from . import group_gemm
from .group_gemm import RowGroups

#: The fields of :class:`~ds_hecate.experts.FFNForm` whose arithmetic :class:`GroupedFFN` writes out; a form with
#: any other field set runs through :class:`FormGraph`.
KNOWN_FIELDS = frozenset({"act", "down", "down_bias", "up", "up_bias", "gate", "gate_bias", "gate_up"})


def _gelu_backward(grad: torch.Tensor, pre: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad, pre, approximate="none")


#: activation -> its gradient as autograd computes it, from (gradient, input, output)
ACTIVATIONS: Dict[Callable, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    F.silu: lambda grad, pre, post: torch.ops.aten.silu_backward(grad, pre),
    F.gelu: _gelu_backward,
    F.relu: lambda grad, pre, post: torch.ops.aten.threshold_backward(grad, post, 0),
    torch.tanh: lambda grad, pre, post: torch.ops.aten.tanh_backward(grad, post),
}


class GradTarget(Protocol):
    """Rows a part's weight gradients go into (``[experts, numel]``) and, per parameter, whether its columns hold
    nothing of the accumulation yet (``is_fresh``: the first contribution is written, not added)."""

    def rows(self) -> torch.Tensor: ...

    def columns_view(self, lo: int, hi: int, shape: Tuple[int, ...]) -> torch.Tensor:
        """``rows()[:, lo:hi]`` as ``[experts, *shape]``."""
        ...

    def is_fresh(self, name: str) -> bool: ...

    def written(self, names: Optional[Sequence[str]] = None) -> None: ...


@functools.lru_cache(maxsize=64)
def no_rows(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty ``[0, numel]`` block (never written): a call without replicas sends these rows."""
    return torch.empty(0, numel, dtype=dtype, device=device)


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
            self.tensor = (torch.empty(self.shape, dtype=self.dtype, device=self.device) if self.shape[0] else
                           no_rows(self.shape[1], self.dtype, self.device))
        return self.tensor

    def columns_view(self, lo: int, hi: int, shape: Tuple[int, ...]) -> torch.Tensor:
        rows = self.rows()
        return rows[:, lo:hi].view(rows.shape[0], *shape)

    def is_fresh(self, name: str) -> bool:
        return name in self.fresh

    def written(self, names: Optional[Sequence[str]] = None) -> None:
        self.fresh.difference_update(self.fresh if names is None else names)


@functools.lru_cache(maxsize=None)
def _columns(names: Tuple[str, ...], numels: Tuple[int, ...]) -> Dict[str, Tuple[int, int]]:
    """Each parameter's flat columns, and each adjacent pair's (a fused ``"a+b"`` operand)."""
    starts = [sum(numels[:i]) for i in range(len(names))]
    out = {n: (lo, lo + size) for n, lo, size in zip(names, starts, numels)}
    for i in range(len(names) - 1):
        out[f"{names[i]}+{names[i + 1]}"] = (starts[i], starts[i + 1] + numels[i + 1])
    return out


@functools.lru_cache(maxsize=None)
def _components(name: str) -> Tuple[str, ...]:
    """The parameters a delivered name spans: ``"a+b"`` (a fused operand) -> ``("a", "b")``."""
    return tuple(name.split("+"))


class GradPart:
    """One part's weight gradients into a :class:`GradTarget` (the owner's accumulator, or a call's
    :class:`SendRows`), a parameter's columns written where fresh and added otherwise. Which are fresh is asked at
    the part's first delivery (another call of the same layer may have written them since the part was made; a
    part's deliveries all come in one backward node). A fused name ``"a+b"`` spans ``a`` and ``b``."""

    def __init__(self, target: GradTarget, kernel: ExpertKernel) -> None:
        self.target = target
        self.kernel = kernel
        self.delivered: set = set()
        self._columns = _columns(tuple(kernel.names), tuple(kernel.numels))
        self._fresh: Optional[set] = None

    def columns(self, name: str) -> Tuple[int, int]:
        """The flat columns ``[lo, hi)`` of parameter ``name`` (``"a+b"``: from ``a``'s first to ``b``'s last)."""
        return self._columns[name]

    def _write(self, name: str) -> bool:
        """Whether ``name``'s columns are written (fresh) rather than added to."""
        if self._fresh is None:
            self._fresh = {n for n in self.kernel.names if self.target.is_fresh(n)}
        names = _components(name)
        if len(names) == 1:
            return name in self._fresh
        fresh = [n in self._fresh for n in names]
        if any(fresh) and not all(fresh):
            raise RuntimeError(f"gradient columns of '{name}' partly written: a fused projection's parameters "
                               "were delivered apart")
        return all(fresh)

    def weight_grad(self, name: str, rows: torch.Tensor, grad: torch.Tensor, groups: RowGroups,
                    shape: Tuple[int, ...], native: bool) -> None:
        """The weight gradient ``grad_e^T @ rows_e`` (``shape`` = (out, in)) of every expert ``e`` of the part."""
        if not groups.sizes:
            return
        lo, hi = self._columns[name]
        dest = self.target.columns_view(lo, hi, tuple(shape))
        group_gemm.weight_grads(grad, rows, groups, dest, not self._write(name), native)
        self._done(name)

    def bias_grad(self, name: str, grad: torch.Tensor, groups: RowGroups, dtype: torch.dtype) -> None:
        """The bias gradient of every expert of the part, in ``dtype``."""
        if not groups.sizes:
            return
        lo, hi = self._columns[name]
        summed = group_gemm.bias_grads(grad, groups, dtype)
        target = self.target.rows()[:, lo:hi]
        if self._write(name):
            target.copy_(summed)
        else:
            target.add_(summed)
        self._done(name)

    def _done(self, name: str) -> None:
        names = _components(name)
        self.delivered.update(names)
        if self._fresh is not None:
            self._fresh.difference_update(names)
        self.target.written(names)

    def finish(self, experts: int) -> None:
        """After the part's backward: the parameters no projection delivered (no backward ran through the part)
        get zero gradients, written where fresh (nothing to add where they are not)."""
        if experts == 0:
            return
        for name in self.kernel.names:
            if name not in self.delivered and self.target.is_fresh(name):
                lo, hi = self._columns[name]
                self.target.rows()[:, lo:hi].zero_()
                self.target.written([name])


def written_out(form: FFNForm) -> bool:
    """Whether :class:`GroupedFFN` writes ``form``'s arithmetic out (else :class:`FormGraph` runs it)."""
    extra = {f.name for f in dataclasses.fields(form)} - KNOWN_FIELDS
    if any(getattr(form, name) not in (None, False) for name in extra):
        return False
    return form.act in ACTIVATIONS


class GroupedFFN:
    """One part of a call's FFN experts: ``forward`` on the part's rows (grouped by expert) gives the outputs and
    what ``backward`` needs; ``backward`` gives the rows' gradient and hands every weight and bias gradient to a
    :class:`GradPart`. Built once per layer (``kernel``); ``native`` (per call, device and dtype) picks grouped
    GEMMs or the loop over the host sizes (:func:`~.group_gemm.native_grouped_mm`)."""

    def __init__(self, kernel: ExpertKernel, fuse: bool = True) -> None:
        form = kernel.form
        assert form is not None and written_out(form), "GroupedFFN runs FFN forms with a written-out activation"
        self.form: FFNForm = form
        self.grad_of_act = ACTIVATIONS[form.act]
        #: whether separate gate and up weights (adjacent, bias-free) run as one ``[2F, H]`` operand
        self.fuse = fuse and form.gate_up is None and form.fusable(kernel.names)
        #: the one operand computing gate and up together (HF's fused experts, or the fused pair)
        self.gate_up = form.gate_up if form.gate_up is not None else (f"{form.gate}+{form.up}" if self.fuse else None)

    def _project(self, x: torch.Tensor, views: Dict[str, torch.Tensor], name: str, bias: Optional[str],
                 groups: RowGroups, native: bool, rows_of: List[torch.Tensor]) -> torch.Tensor:
        out = group_gemm.linear(x, views[name], groups, native)
        return out if bias is None else group_gemm.add_row_bias(out, views[bias], groups, rows_of)

    def forward(self, views: Dict[str, torch.Tensor], x: torch.Tensor, groups: RowGroups,
                native: bool) -> Tuple[torch.Tensor, tuple]:
        """The part's outputs ``[rows, hidden]`` and what :meth:`backward` reads."""
        form = self.form
        rows_of: List[torch.Tensor] = []
        x = x.contiguous()
        if self.gate_up is not None:
            gate, up = self._project(x, views, self.gate_up, None, groups, native, rows_of).chunk(2, dim=-1)
        elif form.gate is not None:
            assert form.up is not None   # a form without gate_up names up
            gate = self._project(x, views, form.gate, form.gate_bias, groups, native, rows_of)
            up = self._project(x, views, form.up, form.up_bias, groups, native, rows_of)
        else:
            assert form.up is not None   # a form without gate_up names up
            gate, up = None, self._project(x, views, form.up, form.up_bias, groups, native, rows_of)
        if gate is not None:
            act = form.act(gate)
            hidden = act * up
        else:
            act = hidden = form.act(up)
        out = self._project(hidden, views, form.down, form.down_bias, groups, native, rows_of)
        return out, (x, gate, up, act, hidden)

    def backward(self, views: Dict[str, torch.Tensor], saved: tuple, grad: torch.Tensor, groups: RowGroups,
                 part: GradPart, native: bool, need_input: bool) -> Optional[torch.Tensor]:
        """The rows' gradient (None unless ``need_input``); every projection's weight and bias gradient to
        ``part``. The formulas are autograd's for the forward above (``mul``, the activation, ``chunk``'s ``cat``,
        the GEMMs), in the same dtypes."""
        form = self.form
        x, gate, up, act, hidden = saved
        grad = grad.contiguous()
        down = views[form.down]
        d_hidden = group_gemm.input_grad(grad, down, groups, native)
        part.weight_grad(form.down, hidden, grad, groups, tuple(down.shape[1:]), native)
        if form.down_bias is not None:
            part.bias_grad(form.down_bias, grad, groups, views[form.down_bias].dtype)
        if gate is None:
            d_up = self.grad_of_act(d_hidden, up, act)
            return self._first_backward(views, x, None, d_up, groups, part, native, need_input)
        d_gate = self.grad_of_act(d_hidden * up, gate, act)
        d_up = d_hidden * act
        return self._first_backward(views, x, d_gate, d_up, groups, part, native, need_input)

    def _first_backward(self, views: Dict[str, torch.Tensor], x: torch.Tensor, d_gate: Optional[torch.Tensor],
                        d_up: torch.Tensor, groups: RowGroups, part: GradPart, native: bool,
                        need_input: bool) -> Optional[torch.Tensor]:
        """The projections that read the rows: the fused gate/up operand, or gate and up apart, or up alone."""
        form = self.form
        if self.gate_up is not None:
            assert d_gate is not None
            d_both = torch.cat([d_gate, d_up], dim=-1)
            weight = views[self.gate_up]
            part.weight_grad(self.gate_up, x, d_both, groups, tuple(weight.shape[1:]), native)
            return group_gemm.input_grad(d_both, weight, groups, native) if need_input else None
        out: Optional[torch.Tensor] = None
        for name, bias, d in ((form.gate, form.gate_bias, d_gate), (form.up, form.up_bias, d_up)):
            if name is None or d is None:
                continue
            weight = views[name]
            part.weight_grad(name, x, d, groups, tuple(weight.shape[1:]), native)
            if bias is not None:
                part.bias_grad(bias, d, groups, views[bias].dtype)
            if need_input:
                d_x = group_gemm.input_grad(d, weight, groups, native)
                out = d_x if out is None else out + d_x
        return out


class SinkProjection(torch.autograd.Function):
    """``rows @ weight_e^T (+ bias_e)`` for each expert ``e``'s rows, on :class:`FormGraph`'s own graph; backward
    hands the weight (and bias) gradient to ``part`` and returns the rows' gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: RowGroups,
                part: GradPart, names: Tuple[str, Optional[str]], native: bool) -> torch.Tensor:
        rows = rows.contiguous()
        ctx.save_for_backward(rows, weight)
        ctx.groups, ctx.part, ctx.names, ctx.native = groups, part, names, native
        ctx.bias_dtype = bias.dtype if bias is not None else None
        out = group_gemm.linear(rows, weight, groups, native)
        if bias is not None:
            out = group_gemm.add_row_bias(out, bias, groups, [])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        grad = grad.contiguous()
        weight_name, bias_name = ctx.names
        grad_rows = group_gemm.input_grad(grad, weight, ctx.groups, ctx.native) if ctx.needs_input_grad[0] else None
        ctx.part.weight_grad(weight_name, rows, grad, ctx.groups, tuple(weight.shape[1:]), ctx.native)
        if bias_name is not None:
            ctx.part.bias_grad(bias_name, grad, ctx.groups, ctx.bias_dtype)
        return grad_rows, None, None, None, None, None, None


class FormGraph:
    """A part of FFN experts whose activation :class:`GroupedFFN` does not write out: the form's own arithmetic
    (:meth:`~ds_hecate.experts.FFNForm.run`) on grouped GEMMs. Forward without a graph; backward runs it again on a
    graph of its own from the rows (a leaf), each projection a :class:`SinkProjection` that delivers its weight
    gradients, and differentiates it."""

    def __init__(self, kernel: ExpertKernel) -> None:
        assert kernel.form is not None, "FormGraph runs FFN forms"
        self.form = kernel.form
        self.fuse = kernel.form.fusable(kernel.names)

    def forward(self, views: Dict[str, torch.Tensor], x: torch.Tensor, groups: RowGroups,
                native: bool) -> torch.Tensor:
        rows_of: List[torch.Tensor] = []

        def proj(h: torch.Tensor, name: str, bias: Optional[str]) -> torch.Tensor:
            out = group_gemm.linear(h.contiguous(), views[name], groups, native)
            return out if bias is None else group_gemm.add_row_bias(out, views[bias], groups, rows_of)
        with torch.no_grad():
            return self.form.run(proj, x, self.fuse)

    def backward(self, views: Dict[str, torch.Tensor], x: torch.Tensor, groups: RowGroups, native: bool,
                 part: GradPart, grad: torch.Tensor, need_input: bool) -> Optional[torch.Tensor]:
        """The rows' gradient (None unless ``need_input``); the weight gradients to ``part``."""
        leaf = x.detach().requires_grad_(True)

        def proj(h: torch.Tensor, name: str, bias: Optional[str]) -> torch.Tensor:
            return SinkProjection.apply(h, views[name], views[bias] if bias is not None else None, groups, part,
                                        (name, bias), native)
        with torch.enable_grad():
            out = self.form.run(proj, leaf, self.fuse)
        (d_x,) = torch.autograd.grad(out, (leaf,), grad, allow_unused=True)
        if not need_input:
            return None
        return d_x if d_x is not None else torch.zeros_like(leaf)


__all__ = ["ACTIVATIONS", "FormGraph", "GradPart", "GradTarget", "GroupedFFN", "SendRows", "SinkProjection",
           "no_rows", "written_out"]
