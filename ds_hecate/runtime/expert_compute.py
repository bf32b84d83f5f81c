"""The expert compute of one layer call, and the per-token expansions of the plan's segment tables.

Two autograd functions own the expert weights' path through autograd: :class:`Materialize` hands out the gathered
experts and issues SparseReduceScatter in backward; :class:`RematerializedExperts` (Hecate-RM) keeps no weights
between forward and backward and gathers them again. The segment expansions turn the planner's per-(source,
expert) tables into per-row indices on the compute device, with pinned non-blocking copies of the small tables.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..planning.dispatch_plan import RankDispatch
from ..comm.device import to_device


def run_experts(kernel, recv: torch.Tensor, weights: Sequence[torch.Tensor], order: torch.Tensor,
                 sizes: Sequence[int]) -> torch.Tensor:
    """Regroup received rows expert-major, run each materialized expert on its rows, restore the received order."""
    grouped = recv.index_select(0, order)
    outs, offset = [], 0
    for weight, size in zip(weights, sizes):
        outs.append(kernel(weight, grouped.narrow(0, offset, size)))
        offset += size
    y_grouped = torch.cat(outs) if outs else grouped
    return y_grouped.index_select(0, torch.argsort(order))


class Materialize(torch.autograd.Function):
    """Forward: hands out the gathered experts. Backward: SparseReduceScatter into the owners' accumulators.

    The received token rows pass through unchanged, so this node sits on every rank's backward path (even a rank
    that materializes nothing or receives no token), and its collective is issued on every rank. ``anchor`` always
    requires grad, so the node is recorded even when the tokens do not (an empty micro-batch).
    """

    @staticmethod
    def forward(ctx, tokens, anchor, binding, plan, flats):
        ctx.binding, ctx.plan = binding, plan
        mine = plan.materialized[binding.runtime.rank]
        return (tokens.view_as(tokens),) + tuple(flats[e] for e in mine)

    @staticmethod
    def backward(ctx, grad_tokens, *grad_weights):
        binding, plan = ctx.binding, ctx.plan
        mine = plan.materialized[binding.runtime.rank]
        binding.reduce_scatter(plan, dict(zip(mine, grad_weights)))
        return grad_tokens, None, None, None, None


class RematerializedExperts(torch.autograd.Function):
    """Re-materialization mode: expert compute that keeps no expert weights between forward and backward.

    Forward runs the experts without recording them and drops the gathered weights; backward gathers the same
    placement again (second SparseAllGather), recomputes the experts with autograd, and reduce-scatters their
    gradients. Only the received rows are saved.
    """

    @staticmethod
    def forward(ctx, recv, anchor, binding, plan, flats, order, sizes):
        ctx.binding, ctx.plan, ctx.sizes = binding, plan, sizes
        ctx.save_for_backward(recv, order)
        mine = plan.materialized[binding.runtime.rank]
        with torch.no_grad():
            return run_experts(binding.shard.kernel, recv, [flats[e] for e in mine], order, sizes)

    @staticmethod
    def backward(ctx, grad_out):
        binding, plan = ctx.binding, ctx.plan
        recv, order = ctx.saved_tensors
        mine = plan.materialized[binding.runtime.rank]
        with binding.timed("regather"):
            flats = binding.gather(plan.placement, async_op=False).wait()[0]
        leaves = [flats[e].detach().requires_grad_(True) for e in mine]
        rows = recv.detach().requires_grad_(recv.requires_grad)
        with torch.enable_grad():
            y = run_experts(binding.shard.kernel, rows, leaves, order, ctx.sizes)
            inputs = leaves + ([rows] if rows.requires_grad else [])
            grads = torch.autograd.grad(y, inputs, grad_out, allow_unused=True) if inputs else []
        weight_grads = {e: (g if g is not None else torch.zeros_like(w)) for e, g, w in zip(mine, grads, leaves)}
        binding.reduce_scatter(plan, weight_grads)
        grad_rows = grads[len(leaves)] if rows.requires_grad else None
        return grad_rows, None, None, None, None, None, None


def expand_segments(values: np.ndarray, lengths: np.ndarray, device: torch.device) -> torch.Tensor:
    """``values[i]`` repeated ``lengths[i]`` times, expanded on ``device`` (the tables are ranks x experts small;
    the expansion is per token, so it runs where the tokens are)."""
    return torch.repeat_interleave(to_device(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)), device),
                                   to_device(torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int64)), device))


def expert_major_order(dispatch: RankDispatch, device: torch.device) -> torch.Tensor:
    """Permutation from the received order (source-major, then expert) to expert-major order, from the plan's
    segment table (one segment per source and expert held): each row is its segment's start plus its offset in it."""
    starts = to_device(torch.from_numpy(np.ascontiguousarray(dispatch.order_starts, dtype=np.int64)), device)
    lengths = to_device(torch.from_numpy(np.ascontiguousarray(dispatch.order_lengths, dtype=np.int64)), device)
    first_out = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - first_out, lengths) + torch.arange(int(sum(dispatch.sizes)),
                                                                              device=device)
