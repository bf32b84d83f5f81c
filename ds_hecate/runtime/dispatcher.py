"""The token side of a layer call: permute, all-to-all, (the experts), reverse all-to-all, weighted un-permute.

:class:`TokenDispatcher` holds what moves tokens (the group's communicator, the traffic counters, the device's
combine kernel) and nothing of the runtime; a call's routing is frozen in :class:`Routes`, made from the plan's
host tables for this rank (:class:`~ds_hecate.planning.dispatch_plan.RankDispatch`) and the slots' expert ids. The
layer (:meth:`~ds_hecate.runtime.layer.LayerBinding.run`) hands the dispatcher explicit inputs and gets tokens
back, so another transport (a DeepEP-style one, say) replaces this class without touching the layer.

Send order: by destination, then expert, then slot; the receiver gets (source, expert) segments. The expert
outputs come back with one zero row after them when a slot of the rank is dropped (every dropped slot's position
points at it), with none when every slot is routed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy as np
import torch

from ..comm.buffers import CommCounters
from ..comm.collectives import AllToAllTokens, Communicator
from ..ops.combine import weighted_unpermute
from ..planning.dispatch_plan import RankDispatch
from ..comm.device import host_index
from ..planning.segments import segment_rows


@functools.lru_cache(maxsize=8)
def _ones(length: int, device: torch.device) -> torch.Tensor:
    return torch.ones(length, dtype=torch.int64, device=device)


def slot_histogram(flat: torch.Tensor, gates: torch.Tensor, num_experts: int) -> torch.Tensor:
    """This rank's row of the count exchange, built on the device without reading it: token-expert pairs per
    expert, then the health flags: routes to an expert id outside ``[0, E)``, any non-finite gate value. The slots
    counted into ``E + 2`` bins (the experts, out of range, and the dropped slots, whose bin the non-finite flag
    then overwrites): on CUDA one scatter, since ``bincount`` reads the maximum on the host; on the CPU, where that
    read costs nothing, ``bincount``."""
    bins = flat.clamp(min=-1, max=num_experts).remainder(num_experts + 2)   # < 0 (dropped) -> E + 1, >= E -> E
    if flat.device.type == "cpu":
        hist = torch.bincount(bins, minlength=num_experts + 2)
    else:
        ones = _ones(1 << max(10, (bins.numel() - 1).bit_length()), flat.device)[:bins.numel()]
        hist = torch.zeros(num_experts + 2, dtype=torch.int64, device=flat.device).scatter_add_(0, bins, ones)
    # x - x is +0 for every finite x and NaN for inf or NaN, so the sum is NaN exactly when a value is not finite
    # (three ops; isfinite().all() decomposes into more); on the values alone, recording nothing for autograd
    values = gates.detach()
    hist[num_experts + 1] = torch.isnan((values - values).sum())
    return hist


class SlotRows(torch.autograd.Function):
    """``x``'s token rows for the routed slots (``x[slots % S]``): a token appears once per route, so the input
    gradient sums up to ``k`` rows per token. autograd's ``index_select`` backward does it with ``index_add_``,
    which on CUDA adds a token's rows atomically in no fixed order (``x.grad`` differed between two runs of the same
    call on a GPU); here on CUDA the rows' gradients go back to slot order (one scatter, no duplicate) and each
    token's routes are summed by one reduction over that layout, so ``x.grad`` is the same bits every run. On the
    CPU ``index_add_`` is sequential, and kept (bit-equal to autograd's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
        num_tokens = x.shape[0]
        tokens = slots % max(num_tokens, 1)
        ctx.save_for_backward(slots, tokens)
        ctx.shape, ctx.top_k = x.shape, top_k
        return x.index_select(0, tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slots, tokens = ctx.saved_tensors
        num_tokens = ctx.shape[0]
        if not (grad.device.type == "cuda" or DETERMINISTIC_SLOT_SUM):
            return grad.new_zeros(ctx.shape).index_add_(0, tokens, grad), None, None
        per_slot = grad.new_zeros((ctx.top_k * num_tokens,) + tuple(ctx.shape[1:]))
        per_slot.index_copy_(0, slots, grad)
        # one reduction over the routes of the slot-ordered rows: its order is fixed by the layout, not the send order
        return per_slot.view((ctx.top_k,) + tuple(ctx.shape)).sum(0), None, None


#: run :class:`SlotRows`' CUDA backward (one reduction over the slot-ordered rows) on any device: tests check it on the CPU
DETERMINISTIC_SLOT_SUM = False


def slot_rows(x: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """``x[slots % S]``: :class:`SlotRows` on CUDA; on the CPU autograd's own ``index_select``, whose sequential
    ``index_add_`` backward is what SlotRows would run there (one autograd node of Python less)."""
    if x.device.type == "cuda" or DETERMINISTIC_SLOT_SUM:
        return SlotRows.apply(x, slots, top_k)
    return x.index_select(0, slots % max(x.shape[0], 1))


@dataclass(frozen=True)
class Routes:
    """One call's routing on this rank: its routed slots in send order (``send_slots``: slot ``j * S + t`` is
    route ``j`` of token ``t``), how many go to / come from each rank, and the call's shape."""

    send_slots: torch.Tensor
    send_splits: List[int]
    recv_splits: List[int]
    routed: int
    num_tokens: int
    top_k: int

    @property
    def pad_rows(self) -> int:
        """Zero rows after the expert outputs: one when a slot of this rank is dropped (its position points at it),
        none otherwise (every position is a routed row's)."""
        return int(self.routed < self.top_k * self.num_tokens)

    @staticmethod
    def of(flat: torch.Tensor, routed: int, num_tokens: int, top_k: int, num_experts: int,
           dispatch: RankDispatch, alone: bool = False) -> "Routes":
        """From the slots' expert ids (``flat``, ``[k * S]``, -1 dropped) and the plan's tables: slots expert-major
        (dropped and out-of-range last, cut off at ``routed``, known on the host), then by destination
        (:func:`send_order`: a gather whose index the host builds from the plan; ``alone``: a rank alone in its
        group with the one-rank shortcuts on has one destination, itself, so the expert-major order is the send
        order)."""
        if routed == flat.shape[0]:   # no slot dropped or out of range (the counts say so): every id sorts as is
            by_expert = torch.argsort(flat, stable=True)
        else:
            by_expert = torch.argsort(torch.where(flat >= 0, flat, num_experts), stable=True)[:routed]
        if alone:
            return Routes(by_expert, list(dispatch.send_splits), list(dispatch.recv_splits), routed, num_tokens,
                          top_k)
        send_slots = by_expert.index_select(0, host_index(send_order(dispatch), flat.device))
        return Routes(send_slots, list(dispatch.send_splits), list(dispatch.recv_splits), routed, num_tokens, top_k)


def send_order(dispatch: RankDispatch) -> np.ndarray:
    """Where each send position takes its row of the expert-major routed slots: the plan's route segments
    (expert-major, each to one destination) grouped by destination, stably, i.e. the stable sort of the rows by
    destination, computed on the host from the segments instead of sorting every row on the device."""
    lengths = np.asarray(dispatch.send_rows, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    by_destination = np.argsort(np.asarray(dispatch.send_dst), kind="stable")
    return segment_rows(starts[by_destination], lengths[by_destination])


class TokenDispatcher:
    """Moves one layer's tokens to the ranks that hold their experts and the outputs back (see the module
    docstring). ``where`` names the layer in collective errors."""

    def __init__(self, comm: Communicator, counters: CommCounters, where: str,
                 combine_kernel: Optional[Callable] = None) -> None:
        self.comm, self.counters, self.where = comm, counters, where
        self.combine_kernel = combine_kernel

    def dispatch(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        """The rows this rank computes, (source, expert) segments in the plan's order."""
        send_rows = slot_rows(x, routes.send_slots, routes.top_k)   # on the graph even when empty
        if self.comm.alone:   # a rank alone keeps its rows: no exchange to issue or to differentiate
            return send_rows
        return AllToAllTokens.apply(send_rows, self.comm, routes.send_splits, routes.recv_splits, self.counters,
                                    self.where)

    def combine(self, y_recv: torch.Tensor, gates: torch.Tensor, routes: Routes, arithmetic: str) -> torch.Tensor:
        """``[S, H]``: each token's routes' outputs (``y_recv``: the received rows' outputs and
        ``routes.pad_rows`` zero rows) sent back and summed weighted by ``gates`` ``[k, S]`` with the caller's
        arithmetic."""
        y_back = y_recv if self.comm.alone else AllToAllTokens.apply(
            y_recv, self.comm, routes.recv_splits, routes.send_splits, self.counters, self.where, routes.pad_rows)
        return weighted_unpermute(y_back, gates, None, arithmetic, self.combine_kernel, routes.send_slots)
