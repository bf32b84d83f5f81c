"""The experts of one layer call as one autograd node: received rows in, expert outputs out, and in backward the
rows' gradient out and the experts' weight gradients handed to the SparseReduceScatter queue.

A call's materialized experts come in two parts (:class:`~ds_hecate.comm.buffers.GatheredExperts`): the rank's own,
computed from the shard's resident compute-dtype weights as they are, and the replicas SparseAllGather received.
The received token rows (source-major, then expert) are taken expert-major, own experts first
(:class:`ExpertRows`), each part runs on its rows, and the outputs go back to the received order. How the parts run
is chosen per layer when it is built (:class:`ExpertCompute`):

- ``grouped``: FFN experts with a written-out activation, on grouped GEMMs with their backward written out
  (:class:`~ds_hecate.ops.grouped_ffn.GroupedFFN`); the owned experts' weight gradients land in the owner's fp32
  accumulator, the replicas' in the rows SparseReduceScatter sends;
- ``graph``: other FFN forms, their own arithmetic on a small graph whose projections are grouped GEMMs delivering
  their weight gradients likewise (:class:`~ds_hecate.ops.grouped_ffn.FormGraph`);
- ``loop``: generic ``nn.Module`` experts and biased experts in half precision, one expert at a time through
  autograd, whose gradients for the two parts' weights SparseReduceScatter adds where they belong.

With re-materialization (Hecate-RM) forward keeps only the received rows; backward gathers the replicas again and
recomputes before differentiating. Either way the node is on every rank's backward path (``anchor`` always
requires grad, so a rank with no token, or whose tokens need no gradient, records it too) and its backward issues
the layer's SparseReduceScatter on every rank (:class:`~ds_hecate.runtime.reductions.ReductionQueue`): the
compute never calls back into the layer or the runtime.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from ..comm.buffers import GatheredExperts
from ..comm.device import host_index, to_device
from ..comm.requests import GatherRequest, ReduceScatterRequest
from ..experts import ExpertKernel
from ..ops.grouped_experts import grouped_path, loop
from ..ops.grouped_ffn import FormGraph, GradPart, GroupedFFN, SendRows, no_rows, written_out
from ..ops.group_gemm import RowGroups, aligned, native_grouped_mm
from ..ops.permute import Permute, permute_rows
from ..planning.dispatch_plan import RankDispatch
from ..planning.segments import segment_permutation
from .call_monitor import LayerPhases
from .reductions import ReductionQueue
from .shard_store import ShardAccumulator


@dataclass(frozen=True)
class ExpertRows:
    """How the received token rows (source-major, then expert) meet a call's experts: ``order`` takes them
    expert-major in the gathered experts' order (own experts first), ``inverse`` puts expert-major rows back in the
    received order (both built from the plan's host tables: gathers both ways, never a scatter; None when no
    permutation runs); ``own`` and ``replicas`` cut the expert-major rows into one group per expert of each part
    (0 rows for an expert this call routes nothing to). ``pad_rows`` zero rows follow the outputs
    (:attr:`~ds_hecate.runtime.dispatcher.Routes.pad_rows`). ``in_order``: the rank is alone in its group with the
    one-rank shortcuts on, so its rows come from itself, expert-major already, and both permutations are skipped
    (on N ranks they run even when they happen to be the identity, so a 1-rank measurement without the shortcuts
    times the N-rank path)."""

    order: Optional[torch.Tensor]
    inverse: Optional[torch.Tensor]
    own: RowGroups
    replicas: RowGroups
    pad_rows: int = 1
    in_order: bool = False

    @property
    def own_rows(self) -> int:
        return self.own.total

    @property
    def rows(self) -> int:
        return self.own.total + self.replicas.total

    @property
    def sizes(self) -> Tuple[int, ...]:
        return self.own.sizes + self.replicas.sizes

    @staticmethod
    def of(dispatch: RankDispatch, experts: Sequence[int], owned: int, device: torch.device, pad_rows: int = 1,
           alone: bool = False) -> "ExpertRows":
        held: Optional[List[int]] = None   # the plan's experts in the held order (None: the plan's order)
        if tuple(experts) == dispatch.mine:   # every expert held is in the plan, in its order (a rank alone)
            sizes = dispatch.sizes
        else:
            mine = {e: i for i, e in enumerate(dispatch.mine)}
            missing = set(mine).difference(experts)
            if missing:
                raise RuntimeError(f"the gathered experts {list(experts)} lack {sorted(missing)} of this rank's "
                                   "plan")
            sizes = [int(dispatch.sizes[mine[e]]) if e in mine else 0 for e in experts]
            held = [mine[e] for e in experts if e in mine]
        sources = len(dispatch.order_lengths) // max(len(dispatch.mine), 1)
        # a rank alone receives from itself only, its segments expert-major in its experts' order
        in_order = alone and sources == 1 and (held is None or held == sorted(held))
        order = inverse = None
        if not in_order or pad_rows:   # (the zero row is appended by the permutation back)
            starts = np.asarray(dispatch.order_starts, dtype=np.int64).reshape(len(dispatch.mine), sources)
            lengths = np.asarray(dispatch.order_lengths, dtype=np.int64).reshape(len(dispatch.mine), sources)
            if held is not None:
                starts, lengths = starts[held], lengths[held]
            order, inverse = (host_index(rows, device) for rows in
                              segment_permutation(starts.reshape(-1), lengths.reshape(-1)))
        return ExpertRows(order, inverse, RowGroups.build(sizes[:owned], device, to_device),
                          RowGroups.build(sizes[owned:], device, to_device), pad_rows, in_order)

    def to_experts(self, recv: torch.Tensor) -> torch.Tensor:
        """The received rows expert-major (no autograd: the node's backward undoes it)."""
        if self.in_order:
            return recv
        assert self.order is not None   # built unless the rows are in order
        return permute_rows(recv, self.order)

    def to_received(self, outputs: torch.Tensor) -> torch.Tensor:
        """Expert-major outputs back in the received order, :attr:`pad_rows` zero rows after them."""
        if self.in_order and not self.pad_rows:
            return outputs
        assert self.inverse is not None   # built unless the rows are in order with no pad rows
        return permute_rows(outputs, self.inverse, self.pad_rows)

    def grad_to_experts(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of :meth:`to_received`'s output, expert-major (the pad rows' dropped)."""
        if self.in_order:
            return grad[:self.rows] if self.pad_rows else grad
        assert self.order is not None   # built unless the rows are in order
        return grad[:self.rows].index_select(0, self.order)

    def grad_to_received(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of :meth:`to_experts`' input: expert-major gradients back in the received order."""
        if self.in_order:
            return grad
        assert self.inverse is not None   # built unless the rows are in order
        return grad.index_select(0, self.inverse)

    # on a graph of their own (the loop): the same permutations, differentiable
    def graph_to_experts(self, recv: torch.Tensor) -> torch.Tensor:
        return recv if self.in_order else Permute.apply(recv, self.order, self.inverse)

    def graph_to_received(self, outputs: torch.Tensor) -> torch.Tensor:
        if self.in_order and not self.pad_rows:
            return outputs
        return Permute.apply(outputs, self.inverse, self.order, self.pad_rows)


class ExpertCompute:
    """How a layer's experts run (see the module docstring), chosen once per layer from its kernel and the compute
    dtype: ``kind`` is ``"grouped"``, ``"graph"`` or ``"loop"`` (``DS_HECATE_GROUPED_MM=0`` when the layer is built:
    the loop). A SwiGLU's adjacent, bias-free gate and up weights run as one GEMM."""

    def __init__(self, kernel: ExpertKernel, dtype: torch.dtype) -> None:
        self.kernel = kernel
        self.ffn: Optional[GroupedFFN] = None
        self.graph: Optional[FormGraph] = None
        self.kind = "loop"
        if grouped_path(kernel, dtype) and kernel.form is not None:
            if written_out(kernel.form):
                self.kind, self.ffn = "grouped", GroupedFFN(kernel)
            else:
                self.kind, self.graph = "graph", FormGraph(kernel)
        self.fuse = self.ffn.fuse if self.ffn is not None else (self.graph is not None and self.graph.fuse)
        self._kept: Optional[Tuple[torch.Tensor, Dict[str, torch.Tensor], bool]] = None

    def views(self, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``weights``' ``[experts, *shape]`` views; those of the owned experts' resident rows, the same tensor call
        after call until a step or re-shard replaces it, are made once (:meth:`keep_views`)."""
        kept = self._kept
        if kept is not None and kept[0] is weights:
            return kept[1]
        return self.kernel.grouped_views(weights, self.fuse)

    def keep_views(self, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
        """:meth:`views` of the resident rows, kept for the next calls (with their alignment)."""
        views = self.views(weights)
        if self._kept is None or self._kept[1] is not views:
            self._kept = (weights, views, aligned(list(views.values())))
        return views

    def native(self, x: torch.Tensor, views: Sequence[Dict[str, torch.Tensor]]) -> bool:
        """Whether this call's grouped GEMMs run natively (:func:`~ds_hecate.ops.group_gemm.native_grouped_mm` and
        the operands' alignment), the kept views' alignment checked once."""
        if not native_grouped_mm(x.device, x.dtype) or not aligned([x]):
            return False
        kept = self._kept
        return all(kept[2] if kept is not None and part is kept[1] else aligned(list(part.values()))
                   for part in views)


#: the slots a part fills in the saved tensors: rows, gate, up, activation, hidden (GroupedFFN's saved tuple)
PART_SLOTS = 5


def _input_grad(grad_y: torch.Tensor, d_parts: List[Optional[torch.Tensor]]) -> torch.Tensor:
    """The expert-major rows' gradient from the parts' (each part gives its rows' where the input needs one), or
    ``grad_y`` itself with no part."""
    parts = cast(List[torch.Tensor], d_parts)
    return grad_y if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class ExpertCall:
    """One call's experts and where their gradients go, made by the layer in forward: the gathered experts (None
    once forward is done: backward reads the weights from the node's saved tensors, or gathers them again), the
    rows' layout, this rank's dispatch (for a re-gather's layout), the owner's accumulator, the SparseReduceScatter
    to issue and the queue it goes to (``owner`` names the layer there), the re-gather (re-materialization), the
    layer's phases.

    What forward keeps for backward: on the grouped path the weights and the activations (:class:`GroupedFFN`'s
    backward is written out); on the graph and loop paths the received rows and the weights, from which backward
    runs the forward again on a graph of its own and differentiates it (a graph built in forward would be freed and
    recomputed by activation checkpointing in a second backward pass: its saved tensors belong to the checkpointed
    region); with re-materialization only the received rows."""

    compute: ExpertCompute
    gathered: Optional[GatheredExperts]
    rows: ExpertRows
    mine: RankDispatch
    accumulator: ShardAccumulator
    reduce: ReduceScatterRequest
    queue: ReductionQueue
    owner: Any
    phases: LayerPhases
    regather: Optional[GatherRequest] = None
    alone: bool = False
    native: bool = False

    @property
    def kernel(self) -> ExpertKernel:
        return self.compute.kernel

    # -- forward ---------------------------------------------------------------------------------------------------
    def forward(self, recv: torch.Tensor) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
        """The outputs in the received order (pad rows after them) and the tensors backward needs."""
        g = self.gathered
        assert g is not None
        self.gathered = None   # (nothing of forward outlives it but what the node saves)
        if self.compute.kind == "grouped" and self.regather is None:
            return self._grouped(recv, g, keep=True)
        y, _ = self._grouped(recv, g, keep=False) if self.compute.kind != "loop" else (self._loop(recv, g), [])
        if self.regather is not None:   # re-materialization: the replicas go now, backward gathers them again
            return y, [recv]
        # a block without replica rows (only rows reserved for calibration, unused) is not kept past forward
        return y, [recv, g.owned_rows, g.buffer if g.buffer.shape[0] else None]

    def _parts(self, x: torch.Tensor, g: GatheredExperts) -> List[Tuple[torch.Tensor, torch.Tensor, RowGroups]]:
        """(weights, rows, groups) of each part that has experts, own first."""
        rows = self.rows
        has_own, has_replicas = g.owned > 0, g.buffer.shape[0] > 0
        if has_own and has_replicas:
            own_in, replica_in = x.split([rows.own_rows, x.shape[0] - rows.own_rows])
        else:
            own_in = replica_in = x
        return ([(g.owned_rows, own_in, rows.own)] if has_own else []) + (
            [(g.buffer, replica_in, rows.replicas)] if has_replicas else [])

    def _views(self, parts, g: GatheredExperts) -> List[Dict[str, torch.Tensor]]:
        compute = self.compute
        return [compute.keep_views(w) if w is g.owned_rows else compute.views(w) for w, _, _ in parts]

    def _grouped(self, recv: torch.Tensor, g: GatheredExperts,
                 keep: bool) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
        """The grouped and graph paths' forward, without a graph; ``keep``: the grouped path's saved tensors."""
        compute = self.compute
        x = self.rows.to_experts(recv)
        parts = self._parts(x, g)
        views = self._views(parts, g)
        self.native = compute.native(x, views)
        saved: List[Optional[torch.Tensor]] = [g.owned_rows, g.buffer if g.buffer.shape[0] else None]
        outs = []
        for (_, rows, groups), part_views in zip(parts, views):
            if compute.ffn is not None:
                out, acts = compute.ffn.forward(part_views, rows, groups, self.native)
                saved.extend(acts if keep else ())
            else:
                assert compute.graph is not None
                out = compute.graph.forward(part_views, rows, groups, self.native)
            outs.append(out)
        # no expert at all (a rank owning none, with no replica): the empty rows themselves
        y = x if not outs else outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.rows.to_received(y), saved

    def _loop(self, recv: torch.Tensor, g: GatheredExperts) -> torch.Tensor:
        rows = self.rows
        out = loop(self.kernel, torch.cat([g.owned_rows, g.buffer]), rows.to_experts(recv), rows.sizes)
        return rows.to_received(out)

    # -- backward --------------------------------------------------------------------------------------------------
    def backward(self, grad: torch.Tensor, saved: Sequence[Optional[torch.Tensor]],
                 need_input: bool) -> Optional[torch.Tensor]:
        """The received rows' gradient (None unless ``need_input``); the SparseReduceScatter issued."""
        if self.regather is not None:
            recv = saved[0]
            assert recv is not None
            with self.phases("regather"):
                held = [self.regather.start().wait()]
            # the extras of a calibrated call arrive in the whole placement's order now: rows laid out anew
            experts, owned = held[0].experts, held[0].owned
            self.rows = ExpertRows.of(self.mine, experts, owned, recv.device, self.rows.pad_rows, self.alone)
            self.reduce = dataclasses.replace(self.reduce, experts=experts)
            return self._recomputed(grad, recv, held, need_input)
        if self.compute.kind == "grouped":
            return self._grouped_backward(grad, list(saved), need_input)
        recv, owned_rows, buffer = saved
        assert recv is not None and owned_rows is not None
        empty = owned_rows.new_empty(0, owned_rows.shape[1]) if buffer is None else buffer
        return self._recomputed(grad, recv, [GatheredExperts((), owned_rows, empty)], need_input)

    def _recomputed(self, grad: torch.Tensor, recv: torch.Tensor, held: List[GatheredExperts],
                    need_input: bool) -> Optional[torch.Tensor]:
        """Backward from the rows and the weights (``held``: the experts, emptied once they are no longer needed,
        so that re-gathered replicas go before the reduce-scatter sends): the forward run again, kept for backward
        (the grouped path) or on a graph of its own (the graph and loop paths), then differentiated."""
        if self.compute.kind == "grouped":
            saved = self._grouped(recv, held.pop(), keep=True)[1]
            return self._grouped_backward(grad, saved, need_input)
        if self.compute.kind == "graph":
            return self._graph_backward(grad, recv, held, need_input)
        return self._loop_backward(grad, recv, held, need_input)

    def _grad_part(self, own: bool, replicas: int, device: torch.device) -> GradPart:
        """Where a part's weight gradients go: the owner's accumulator, or the ``replicas`` rows to send (new rows
        each backward: what one backward sends is its own gradients)."""
        if own:
            return GradPart(self.accumulator, self.kernel)
        return GradPart(SendRows(replicas, self.kernel, self.reduce.wire_dtype, device), self.kernel)

    def _send_rows(self, part: Optional[GradPart], device: torch.device) -> torch.Tensor:
        """The replica rows' gradients SparseReduceScatter sends: the replica part's rows, or none."""
        if part is None:
            return no_rows(self.kernel.numel, self.reduce.wire_dtype, device)
        return part.target.rows()

    def _part_grads(self, grad_y: torch.Tensor, parts: Sequence) -> List[torch.Tensor]:
        if len(parts) == 2:
            return list(grad_y.split([self.rows.own_rows, grad_y.shape[0] - self.rows.own_rows]))
        return [grad_y] * len(parts)

    def _grouped_backward(self, grad: torch.Tensor, saved: List[Optional[torch.Tensor]],
                          need_input: bool) -> Optional[torch.Tensor]:
        compute, rows = self.compute, self.rows
        ffn = compute.ffn
        assert ffn is not None
        owned_rows, buffer = saved[0], saved[1]
        assert owned_rows is not None
        replicas = buffer.shape[0] if buffer is not None else 0
        grad_y = rows.grad_to_experts(grad)
        parts = ([(owned_rows, rows.own)] if owned_rows.shape[0] else []) + (
            [(buffer, rows.replicas)] if buffer is not None and replicas else [])
        d_parts = []
        send_part: Optional[GradPart] = None
        for i, ((weights, groups), part_grad) in enumerate(zip(parts, self._part_grads(grad_y, parts))):
            part = self._grad_part(weights is owned_rows, replicas, grad.device)
            send_part = send_part if weights is owned_rows else part
            acts = tuple(saved[2 + i * PART_SLOTS:2 + (i + 1) * PART_SLOTS])
            d_parts.append(ffn.backward(compute.views(weights), acts, part_grad, groups, part, self.native,
                                        need_input))
            part.finish(len(groups.sizes))
        sends = self._send_rows(send_part, grad.device)
        saved.clear()   # (re-materialization: the re-gathered replicas go before the reduce-scatter sends)
        del parts, owned_rows, buffer
        self._issue(None, sends)
        if not need_input:
            return None
        return rows.grad_to_received(_input_grad(grad_y, d_parts))

    def _graph_backward(self, grad: torch.Tensor, recv: torch.Tensor, held: List[GatheredExperts],
                        need_input: bool) -> Optional[torch.Tensor]:
        """FFN forms with an activation not written out: each part's own arithmetic on a graph from its rows, each
        projection delivering its weight gradients (:class:`~ds_hecate.ops.grouped_ffn.FormGraph`)."""
        compute, rows = self.compute, self.rows
        graph = compute.graph
        assert graph is not None
        g = held.pop()
        x = rows.to_experts(recv)
        parts = self._parts(x, g)
        views = self._views(parts, g)
        replicas = g.buffer.shape[0]
        grad_y = rows.grad_to_experts(grad)
        d_parts = []
        send_part: Optional[GradPart] = None
        for (weights, part_rows, groups), part_views, part_grad in zip(parts, views,
                                                                      self._part_grads(grad_y, parts)):
            part = self._grad_part(weights is g.owned_rows, replicas, grad.device)
            send_part = send_part if weights is g.owned_rows else part
            d_parts.append(graph.backward(part_views, part_rows, groups, self.native, part, part_grad, need_input))
            part.finish(len(groups.sizes))
        sends = self._send_rows(send_part, grad.device)
        del g, parts, views
        self._issue(None, sends)
        if not need_input:
            return None
        return rows.grad_to_received(_input_grad(grad_y, d_parts))

    def _loop_backward(self, grad: torch.Tensor, recv: torch.Tensor, held: List[GatheredExperts],
                       need_input: bool) -> Optional[torch.Tensor]:
        """Generic experts: one expert at a time through autograd, on a graph built here, the weights' gradients
        handed to SparseReduceScatter whole (it adds the owned ones into the accumulator)."""
        rows, kernel = self.rows, self.kernel
        g = held.pop()
        with torch.enable_grad():
            own = g.owned_rows.detach().requires_grad_(True)
            replicas = g.buffer.detach().requires_grad_(True)
            x = recv.detach().requires_grad_(need_input)
            grouped = rows.graph_to_experts(x)
            flats = list(own.unbind(0)) + list(replicas.unbind(0))
            outs = [kernel(flat, part) for flat, part in zip(flats, grouped.split(list(rows.sizes)))]
            y = rows.graph_to_received(torch.cat(outs) if outs else grouped)
        inputs = [own, replicas] + ([x] if need_input else [])
        got: Tuple[Optional[torch.Tensor], ...]
        if y.requires_grad:
            got = torch.autograd.grad(y, inputs, grad, allow_unused=True)
        else:   # no expert and rows that need no gradient: nothing was computed
            got = (None,) * len(inputs)
        d_own = got[0] if got[0] is not None else torch.zeros_like(own)
        d_replicas = got[1] if got[1] is not None else torch.zeros_like(replicas)
        del y, own, replicas, g
        self._issue(d_own, d_replicas)
        if not need_input:
            return None
        return got[2] if got[2] is not None else torch.zeros_like(x)

    def _issue(self, own_grads: Optional[torch.Tensor], replica_grads: torch.Tensor) -> None:
        with self.phases("reduce_scatter"):
            finish = self.reduce.start(own_grads, replica_grads)
        self.queue.issue(self.owner, finish)


class ShardedExperts(torch.autograd.Function):
    """The node of one call's experts (see the module docstring): ``recv`` the received rows, ``anchor`` a tensor
    that always requires grad, ``call`` the :class:`ExpertCall`."""

    @staticmethod
    def forward(ctx, recv: torch.Tensor, anchor: torch.Tensor, call: ExpertCall) -> torch.Tensor:
        ctx.call = call
        out, saved = call.forward(recv)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        call: ExpertCall = ctx.call
        return call.backward(grad, ctx.saved_tensors, ctx.needs_input_grad[0]), None, None


@functools.lru_cache(maxsize=None)
def autograd_anchor(device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` that requires grad, so every call records its experts' node (see the module
    docstring)."""
    return torch.empty(0, requires_grad=True, device=device)


def sharded_experts(recv: torch.Tensor, call: ExpertCall) -> torch.Tensor:
    """The call's expert outputs in the received order, ``call.rows.pad_rows`` zero rows after them."""
    return ShardedExperts.apply(recv, autograd_anchor(recv.device), call)


__all__ = ["ExpertCall", "ExpertCompute", "ExpertRows", "ShardedExperts", "autograd_anchor", "sharded_experts"]
