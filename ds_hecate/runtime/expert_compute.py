"""The expert compute of one layer call, and the per-token expansions of the plan's segment tables.

Two autograd functions own the expert weights' path through autograd: :class:`Materialize` hands out the gathered
experts (one ``[E, numel]`` buffer) and issues SparseReduceScatter in backward; :class:`RematerializedExperts`
(Hecate-RM) keeps no weights between forward and backward and gathers them again. Between them the experts run
grouped (:func:`ds_hecate.ops.grouped_experts.expert_outputs`). The segment expansions turn the planner's
per-(source, expert) tables into per-row indices on the compute device, with pinned non-blocking copies of the
small tables and the output sizes known on the host, so none of them reads the device back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..comm.collectives import GatheredExperts
from ..comm.device import to_device
from ..ops.grouped_experts import RowGroups, expert_outputs, recomputed_expert_grads
from ..planning.dispatch_plan import RankDispatch


@dataclass(frozen=True)
class ExpertRows:
    """How the received token rows (source-major, then expert) meet a gathered buffer: ``order`` takes them
    expert-major in the buffer's row order, ``groups`` cuts that into one group per buffer row (0 rows for a
    buffer row whose expert this call routes nothing to)."""

    order: torch.Tensor
    groups: RowGroups

    @staticmethod
    def of(dispatch: RankDispatch, experts: Sequence[int], device: torch.device) -> "ExpertRows":
        mine = {e: i for i, e in enumerate(dispatch.mine)}
        missing = set(mine) - set(experts)
        if missing:
            raise RuntimeError(f"the gathered experts {list(experts)} lack {sorted(missing)} of this rank's plan")
        sources = len(dispatch.order_lengths) // max(len(dispatch.mine), 1)
        starts = np.asarray(dispatch.order_starts, dtype=np.int64).reshape(len(dispatch.mine), sources)
        lengths = np.asarray(dispatch.order_lengths, dtype=np.int64).reshape(len(dispatch.mine), sources)
        held = [mine[e] for e in experts if e in mine]
        sizes = [int(dispatch.sizes[mine[e]]) if e in mine else 0 for e in experts]
        return ExpertRows(segment_order(starts[held].reshape(-1), lengths[held].reshape(-1), device),
                          RowGroups.build(sizes, device, to_device))


def run_expert_rows(kernel, buffer: torch.Tensor, recv: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """The experts of ``buffer`` on the received rows, outputs in the received order (one gather, the grouped
    compute, one scatter back: a fixed number of ops whatever the number of experts)."""
    grouped = recv.index_select(0, rows.order)
    out = expert_outputs(kernel, buffer, grouped, rows.groups)
    return out.new_empty(out.shape).index_copy(0, rows.order, out)


class Materialize(torch.autograd.Function):
    """Forward: hands out the gathered experts' buffer. Backward: SparseReduceScatter into the owners' accumulators.

    The received token rows pass through unchanged, so this node sits on every rank's backward path (even a rank
    that materializes nothing or receives no token), and its collective is issued on every rank. ``anchor`` always
    requires grad, so the node is recorded even when the tokens do not (an empty micro-batch).
    """

    @staticmethod
    def forward(ctx, tokens, anchor, binding, plan, gathered: GatheredExperts):
        ctx.binding, ctx.plan, ctx.experts = binding, plan, gathered.experts
        ctx.buffer_shape, ctx.buffer_dtype = gathered.buffer.shape, gathered.buffer.dtype
        return tokens.view_as(tokens), gathered.buffer.view_as(gathered.buffer)

    @staticmethod
    def backward(ctx, grad_tokens, grad_buffer):
        if grad_buffer is None:   # no expert row took part (nothing materialized)
            grad_buffer = grad_tokens.new_zeros(ctx.buffer_shape, dtype=ctx.buffer_dtype)
        ctx.binding.reduce_scatter(ctx.plan, ctx.experts, grad_buffer)
        return grad_tokens, None, None, None, None


class RematerializedExperts(torch.autograd.Function):
    """Re-materialization mode: expert compute that keeps no expert weights between forward and backward.

    Forward runs the experts without recording them and drops the gathered weights; backward gathers the same
    placement again (second SparseAllGather), recomputes the experts with autograd, and reduce-scatters their
    gradients. Only the received rows are saved.
    """

    @staticmethod
    def forward(ctx, recv, anchor, binding, plan, gathered: GatheredExperts, rows: ExpertRows):
        ctx.binding, ctx.plan = binding, plan
        ctx.save_for_backward(recv)
        with torch.no_grad():
            return run_expert_rows(binding.shard.kernel, gathered.buffer, recv, rows)

    @staticmethod
    def backward(ctx, grad_out):
        binding, plan = ctx.binding, ctx.plan
        (recv,) = ctx.saved_tensors
        with binding.timed("regather"):
            gathered = binding.gather(plan.placement, async_op=False).wait()
        rows = ExpertRows.of(plan.for_rank(binding.runtime.rank), gathered.experts, recv.device)
        # run_expert_rows backwards: its index_copy's backward selects the output gradient in expert-major order,
        # its index_select's backward adds the rows' gradients back into the received order (as autograd would)
        experts = gathered.experts
        grad_buffer, grad_grouped = recomputed_expert_grads(
            binding.shard.kernel, gathered.buffer, recv.index_select(0, rows.order), rows.groups,
            grad_out.index_select(0, rows.order), recv.requires_grad)
        del gathered   # the re-gathered weights go before the reduce-scatter allocates its send copy
        binding.reduce_scatter(plan, experts, grad_buffer)
        grad_rows = None
        if recv.requires_grad:
            grad_rows = torch.zeros_like(recv).index_add_(0, rows.order, grad_grouped)
        return grad_rows, None, None, None, None, None


def expand_segments(values: np.ndarray, lengths: np.ndarray, device: torch.device,
                    total: Optional[int] = None) -> torch.Tensor:
    """``values[i]`` repeated ``lengths[i]`` times, expanded on ``device`` (the tables are ranks x experts small;
    the expansion is per token, so it runs where the tokens are). ``total`` (``sum(lengths)``, computed on the host
    when not given) sizes the output, so the device is never read."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    total = int(lengths.sum()) if total is None else total
    return torch.repeat_interleave(to_device(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)), device),
                                   to_device(torch.from_numpy(lengths), device), output_size=total)


def segment_order(starts: np.ndarray, lengths: np.ndarray, device: torch.device) -> torch.Tensor:
    """The rows of consecutive segments (segment ``i``: ``lengths[i]`` rows from ``starts[i]``) as one index
    vector on ``device``: each row is its segment's start plus its offset in it."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    first_out = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    return (expand_segments(starts - first_out, lengths, device, total)
            + torch.arange(total, device=device))


def expert_major_order(dispatch: RankDispatch, device: torch.device) -> torch.Tensor:
    """Permutation from the received order (source-major, then expert) to expert-major order (in ``mine`` order),
    from the plan's segment table (one segment per source and expert held)."""
    return segment_order(dispatch.order_starts, dispatch.order_lengths, device)
