"""The expert compute of one layer call, and the per-token expansions of the plan's segment tables.

A call's materialized experts come in two parts (:class:`~ds_hecate.comm.buffers.GatheredExperts`): the rank's own,
computed from the shard's resident compute-dtype weights as they are, and the replicas SparseAllGather received.
The received token rows are taken expert-major (own experts first), each part runs on its rows, and the outputs go
back to the received order.

- **FFN experts on grouped GEMM** (:func:`~ds_hecate.ops.grouped_experts.grouped_available`): each projection is a
  :class:`~ds_hecate.ops.grouped_ffn.SinkProjection`, whose backward writes the owned experts' weight gradients
  into the owner's fp32 accumulator and the replicas' into the rows SparseReduceScatter sends
  (:class:`CallGrads`). :class:`Materialize` puts one node on every rank's backward path (a rank with no token, or
  whose tokens need no gradient, included) that runs after both parts' backward and issues the SparseReduceScatter.
- **The per-expert loop** (generic ``nn.Module`` experts, few experts on the CPU, biased experts in half
  precision): autograd through the two parts' weights, whose gradients :class:`MaterializeWeights` hands to
  SparseReduceScatter.
- **Re-materialization** (:class:`RematerializedExperts`, Hecate-RM): no weights kept between forward and backward;
  backward gathers the replicas again and recomputes.

The segment expansions turn the planner's per-(source, expert) tables into per-row indices: built on the host (the
tables and every size are there), copied to the compute device once each (pinned, non-blocking), so none of them
reads the device back and none costs the device more than the copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..comm.buffers import GatheredExperts
from ..comm.device import to_device
from ..ops.grouped_experts import RowGroups, _aligned, grouped_available
from ..ops.grouped_ffn import GradPart, SendRows, grouped_ffn
from ..planning.dispatch_plan import RankDispatch
from .shard_store import ShardAccumulator


@dataclass(frozen=True)
class ExpertRows:
    """How the received token rows (source-major, then expert) meet a call's experts: ``order`` takes them
    expert-major in the gathered experts' order (own experts first), ``inverse`` puts expert-major rows back in the
    received order (both permutations, built from the plan's host tables: gathers both ways, never a scatter; None
    when no permutation runs); ``own`` and ``replicas`` cut the expert-major rows into one group per expert of each
    part (0 rows for an expert this call routes nothing to); the first ``own_rows`` rows are the own experts'.
    ``pad_rows`` zero rows follow the outputs (:attr:`~ds_hecate.runtime.dispatcher.Routes.pad_rows`). ``in_order``:
    the received rows are expert-major already and the rank is alone in its group (one-rank shortcuts on: its rows
    come from itself), so both permutations are skipped (on N ranks they run even when they happen to be the
    identity, so a 1-rank measurement without the shortcuts times the N-rank path)."""

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
    def sizes(self) -> Tuple[int, ...]:
        return self.own.sizes + self.replicas.sizes

    @staticmethod
    def of(dispatch: RankDispatch, experts: Sequence[int], owned: int, device: torch.device, pad_rows: int = 1,
           alone: bool = False) -> "ExpertRows":
        mine = {e: i for i, e in enumerate(dispatch.mine)}
        missing = set(mine) - set(experts)
        if missing:
            raise RuntimeError(f"the gathered experts {list(experts)} lack {sorted(missing)} of this rank's plan")
        sources = len(dispatch.order_lengths) // max(len(dispatch.mine), 1)
        starts = np.asarray(dispatch.order_starts, dtype=np.int64).reshape(len(dispatch.mine), sources)
        lengths = np.asarray(dispatch.order_lengths, dtype=np.int64).reshape(len(dispatch.mine), sources)
        held = [mine[e] for e in experts if e in mine]
        sizes = [int(dispatch.sizes[mine[e]]) if e in mine else 0 for e in experts]
        held_starts, held_lengths = starts[held].reshape(-1), lengths[held].reshape(-1)
        positions = np.cumsum(held_lengths) - held_lengths   # where each segment lands in expert-major order
        nonempty = held_lengths > 0
        in_order = alone and bool(np.array_equal(held_starts[nonempty], positions[nonempty]))
        permutes = not in_order or pad_rows > 0   # (the zero row is appended by the permutation back)
        order, inverse = ((host_index(rows, device) for rows in segment_permutation(held_starts, held_lengths))
                          if permutes else (None, None))
        return ExpertRows(order, inverse,
                          RowGroups.build(sizes[:owned], device, to_device),
                          RowGroups.build(sizes[owned:], device, to_device), pad_rows, in_order)

    def to_experts(self, recv: torch.Tensor) -> torch.Tensor:
        """The received rows expert-major."""
        return recv if self.in_order else Permute.apply(recv, self.order, self.inverse)

    def to_received(self, outputs: torch.Tensor) -> torch.Tensor:
        """Expert-major outputs back in the received order, :attr:`pad_rows` zero rows after them."""
        if self.in_order and not self.pad_rows:
            return outputs
        return Permute.apply(outputs, self.inverse, self.order, self.pad_rows)


class Permute(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm`` whose inverse ``inverse`` is known: the backward is a gather with the
    inverse (autograd's ``index_select`` backward scatters with ``index_add_``, several times slower on the CPU and
    atomic on CUDA). ``pad_rows`` zero rows follow the output (the combine's dropped slots point at them)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor, pad_rows: int = 0) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.pad_rows = pad_rows
        if not pad_rows:
            return x.index_select(0, perm)
        out = x.new_empty((perm.shape[0] + pad_rows,) + tuple(x.shape[1:]))
        out[perm.shape[0]:].zero_()
        torch.index_select(x, 0, perm, out=out[:perm.shape[0]])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        rows = grad[:grad.shape[0] - ctx.pad_rows] if ctx.pad_rows else grad
        return rows.index_select(0, inverse), None, None, None


#: the two parts' named ``[experts, *shape]`` weight views (own, replicas; empty for a part without experts)
GroupedOperands = Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]


def grouped_operands(kernel, gathered: GatheredExperts, recv: torch.Tensor) -> Optional[GroupedOperands]:
    """The two parts' grouped-GEMM operands when this call runs grouped GEMM (the device rule over all its experts;
    every operand aligned), else None. Made once per call: the check and the GEMMs use the same views."""
    weights = gathered.owned_rows if gathered.owned else gathered.buffer
    if not grouped_available(kernel, weights, len(gathered.experts)):
        return None
    fuse = kernel.form.fusable(kernel.names)
    own, replicas = (kernel.grouped_views(part, fuse) if part.shape[0] else {}
                     for part in (gathered.owned_rows, gathered.buffer))
    return (own, replicas) if _aligned([recv, *own.values(), *replicas.values()]) else None


class CallGrads:
    """Where one call's expert weight gradients go (grouped path): the owned experts' into the owner's
    accumulator, the replicas' into :class:`~ds_hecate.ops.grouped_ffn.SendRows` in the wire dtype."""

    def __init__(self, binding, gathered: GatheredExperts) -> None:
        rt = binding.runtime
        kernel = binding.shard.kernel
        self.own = GradPart(ShardAccumulator(binding.shard, rt.device), kernel)
        self.sends = SendRows(gathered.buffer.shape[0], kernel, rt.reduce_dtype, rt.device)
        self.replicas = GradPart(self.sends, kernel)
        self.counts = (gathered.owned, gathered.buffer.shape[0])

    def finish(self) -> torch.Tensor:
        """After the call's backward: what no projection delivered is zero; the replica rows to send."""
        self.own.finish(self.counts[0])
        self.replicas.finish(self.counts[1])
        return self.sends.rows()


def run_parts(kernel, gathered: GatheredExperts, recv: torch.Tensor, rows: ExpertRows, grads: CallGrads,
              operands: GroupedOperands) -> torch.Tensor:
    """Grouped path: both parts on their rows (one grouped GEMM per projection and part), outputs in the received
    order followed by ``rows.pad_rows`` zero rows (a gather each way: a fixed number of ops whatever the number of
    experts; none when :attr:`ExpertRows.in_order`)."""
    grouped = rows.to_experts(recv)
    has_own, has_replicas = gathered.owned > 0, gathered.buffer.shape[0] > 0
    # the parts' rows: one split (its backward is one concatenation), or the rows whole when one part runs (a slice
    # would cost a zero-filled full-size gradient in backward)
    if has_own and has_replicas:
        own_in, replica_in = grouped.split([rows.own_rows, grouped.shape[0] - rows.own_rows])
    else:
        own_in = replica_in = grouped
    parts = []
    if has_own:
        parts.append(grouped_ffn(kernel, operands[0], own_in, rows.own, grads.own))
    if has_replicas:
        parts.append(grouped_ffn(kernel, operands[1], replica_in, rows.replicas, grads.replicas))
    # no expert at all (a rank owning none, with no replica): the empty rows themselves, so that the output stays
    # on the graph through Materialize, whose backward issues this rank's SparseReduceScatter
    outputs = grouped if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
    return rows.to_received(outputs)


def run_loop(kernel, own_weights: torch.Tensor, replica_weights: torch.Tensor, recv: torch.Tensor,
             rows: ExpertRows) -> torch.Tensor:
    """The per-expert loop over both parts (autograd through the weights), outputs in the received order followed by
    ``rows.pad_rows`` zero rows."""
    grouped = rows.to_experts(recv)
    flats = list(own_weights.unbind(0)) + list(replica_weights.unbind(0))
    outs = [kernel(flat, x) for flat, x in zip(flats, grouped.split(list(rows.sizes)))]
    out = torch.cat(outs) if outs else grouped
    return rows.to_received(out)


class Materialize(torch.autograd.Function):
    """Grouped path. Forward: the received rows, unchanged. Backward (after both parts' projections delivered
    their weight gradients): SparseReduceScatter of the replicas' gradients into the owners' accumulators.

    The rows pass through, so this node sits on every rank's backward path (even a rank that materializes nothing
    or receives no token), and its collective is issued on every rank. ``anchor`` always requires grad, so the node
    is recorded even when the tokens do not (an empty micro-batch)."""

    @staticmethod
    def forward(ctx, tokens, anchor, binding, plan, experts: Tuple[int, ...], grads: CallGrads):
        ctx.binding, ctx.plan, ctx.experts, ctx.grads = binding, plan, experts, grads
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx, grad_tokens):
        ctx.binding.reduce_scatter(ctx.plan, ctx.experts, None, ctx.grads.finish())
        return grad_tokens, None, None, None, None, None


class MaterializeWeights(torch.autograd.Function):
    """Loop path. Forward: hands out the received rows and both parts' weights. Backward: SparseReduceScatter of
    their gradients (zeros for a part no expert of which took part)."""

    @staticmethod
    def forward(ctx, tokens, anchor, binding, plan, gathered: GatheredExperts):
        ctx.binding, ctx.plan, ctx.experts = binding, plan, gathered.experts
        ctx.shapes = (gathered.owned_rows.shape, gathered.buffer.shape, gathered.buffer.dtype)
        return (tokens.view_as(tokens), gathered.owned_rows.view_as(gathered.owned_rows),
                gathered.buffer.view_as(gathered.buffer))

    @staticmethod
    def backward(ctx, grad_tokens, grad_own, grad_replicas):
        own_shape, replica_shape, dtype = ctx.shapes
        if grad_own is None:
            grad_own = grad_tokens.new_zeros(own_shape, dtype=dtype)
        if grad_replicas is None:
            grad_replicas = grad_tokens.new_zeros(replica_shape, dtype=dtype)
        ctx.binding.reduce_scatter(ctx.plan, ctx.experts, grad_own, grad_replicas)
        return grad_tokens, None, None, None, None


class RematerializedExperts(torch.autograd.Function):
    """Re-materialization mode: expert compute that keeps no replica between forward and backward.

    Forward runs the experts without recording them and drops the gathered replicas; backward gathers the same
    placement again (second SparseAllGather), recomputes the experts with autograd, and reduce-scatters their
    gradients. Only the received rows are saved (the owned experts' weights are resident anyway)."""

    @staticmethod
    def forward(ctx, recv, anchor, binding, plan, gathered: GatheredExperts, rows: ExpertRows):
        ctx.binding, ctx.plan, ctx.layout = binding, plan, (rows.pad_rows, rows.in_order)
        ctx.save_for_backward(recv)
        kernel = binding.shard.kernel
        with torch.no_grad():
            operands = grouped_operands(kernel, gathered, recv)
            if operands is not None:
                return run_parts(kernel, gathered, recv, rows, CallGrads(binding, gathered), operands)
            return run_loop(kernel, gathered.owned_rows, gathered.buffer, recv, rows)

    @staticmethod
    def backward(ctx, grad_out):
        binding, plan = ctx.binding, ctx.plan
        (recv,) = ctx.saved_tensors
        with binding.timed("regather"):
            gathered = binding.gather(plan.placement, async_op=False).wait()
        pad_rows, in_order = ctx.layout   # (in order only when alone: the same rows skip the same permutations)
        rows = ExpertRows.of(plan.for_rank(binding.runtime.rank), gathered.experts, gathered.owned, recv.device,
                             pad_rows, alone=in_order)
        kernel, experts = binding.shard.kernel, gathered.experts
        x = recv.detach().requires_grad_(True)
        with torch.enable_grad():
            operands = grouped_operands(kernel, gathered, recv)
            if operands is not None:
                grads = CallGrads(binding, gathered)
                y = run_parts(kernel, gathered, x, rows, grads, operands)
                (grad_rows,) = torch.autograd.grad(y, (x,), grad_out)
                del gathered   # the re-gathered replicas go before the reduce-scatter sends
                binding.reduce_scatter(plan, experts, None, grads.finish())
            else:
                own = gathered.owned_rows.detach().requires_grad_(True)
                replicas = gathered.buffer.detach().requires_grad_(True)
                y = run_loop(kernel, own, replicas, x, rows)
                grad_rows, grad_own, grad_replicas = torch.autograd.grad(y, (x, own, replicas), grad_out,
                                                                         allow_unused=True)
                del gathered
                binding.reduce_scatter(plan, experts, _or_zeros(grad_own, own), _or_zeros(grad_replicas, replicas))
        return (grad_rows if recv.requires_grad else None), None, None, None, None, None


def _or_zeros(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return grad if grad is not None else torch.zeros_like(like)


def segment_rows(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The rows of consecutive segments (segment ``i``: ``lengths[i]`` rows from ``starts[i]``) as one host index
    vector: each row is its segment's start plus its offset in it. Built on the host from the plan's tables (one
    ``repeat`` and one ``arange``), so the device gets the finished index in one copy, not the expansion's ops."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    first_out = np.cumsum(lengths) - lengths
    return np.repeat(starts - first_out, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def segment_permutation(starts: np.ndarray, lengths: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(order, inverse) on the host for a buffer cut into segments (segment ``i``: ``lengths[i]`` rows from
    ``starts[i]``; together they cover the buffer): ``order`` takes the segments' rows one segment after another in
    the given order (:func:`segment_rows`), ``inverse`` puts them back. The received rows of an all-to-all
    (source-major) to expert-major and back: both are built from the segment table, not by scattering one index
    per row."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    positions = np.cumsum(lengths) - lengths    # where each segment lands in ``order``
    by_start = np.argsort(starts, kind="stable")   # the segments in the buffer's order
    return segment_rows(starts, lengths), segment_rows(positions[by_start], lengths[by_start])


def host_index(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host-built int64 index on ``device``: pinned and non-blocking on CUDA, the array itself on the CPU."""
    return to_device(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)), device)


def segment_order(starts: np.ndarray, lengths: np.ndarray, device: torch.device) -> torch.Tensor:
    """:func:`segment_rows` on ``device``."""
    return host_index(segment_rows(starts, lengths), device)


def expert_major_order(dispatch: RankDispatch, device: torch.device) -> torch.Tensor:
    """Permutation from the received order (source-major, then expert) to expert-major order (in ``mine`` order),
    from the plan's segment table (one segment per source and expert held)."""
    return segment_order(dispatch.order_starts, dispatch.order_lengths, device)


__all__: List[str] = ["ExpertRows", "Permute", "CallGrads", "Materialize", "MaterializeWeights", "RematerializedExperts",
                      "run_parts", "run_loop", "grouped_operands", "GroupedOperands", "segment_rows",
                      "segment_permutation",
                      "segment_order", "host_index", "expert_major_order"]
