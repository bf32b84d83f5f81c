"""Tokens replicated over tensor-parallel ranks, handled as DeepSpeed's MoE handles them.

With a model-parallel unit of tensor-parallel size ``T`` the MoE layer's input is the same on the ``T`` ranks of a
data-parallel slice. DeepSpeed's MoE dispatches each token once: every TP rank keeps ``1/T`` of the routed slots
(``drop_tokens``; its backward all-gathers the gradient), and the expert outputs are all-gathered back
(``gather_tokens``; its backward keeps the rank's share). :func:`run_layer` does the same around Hecate's layer call:
TP rank ``t`` runs tokens ``[t*c, (t+1)*c)`` (``c = ceil(S / T)``, the last share shorter) through its Hecate group
and the combined outputs are all-gathered over the TP peers. Each token is processed once per slice, the output and
the gradients of the input and of the gate values are whole on every TP rank, and the expert gradients, summed over
the groups of every TP rank and data-parallel rank, are the data-parallel sum, as in DeepSpeed.

Every TP rank issues the same collectives: both exchanges run on every call, in forward and in backward, whatever
the tokens. Non-finite gate values or out-of-range expert ids anywhere in the slice are carried into every TP rank's
share, so the health check of every group that holds a rank of the slice stops at the same count exchange.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..comm.collectives import Communicator


def share(num_tokens: int, peers: int, rank: int) -> Tuple[int, int, int]:
    """(start, length, padded length) of TP rank ``rank``'s tokens out of ``num_tokens``."""
    chunk = -(-num_tokens // peers) if num_tokens else 0
    start = min(rank * chunk, num_tokens)
    return start, min(chunk, num_tokens - start), chunk


def _all_gather(comm: Communicator, part: torch.Tensor, dim: int, total: int, collective: str) -> torch.Tensor:
    """Every TP rank's ``part`` (along ``dim``, each padded to the common share) concatenated, cut to ``total``."""
    moved = part.movedim(dim, 0)
    _, _, chunk = share(total, comm.world_size, comm.rank)
    if chunk == 0:   # an empty slice: empty on every TP peer alike (they hold the same tokens)
        return part.clone()
    padded = moved.new_zeros((chunk,) + tuple(moved.shape[1:]))
    padded[:moved.shape[0]] = moved
    out = moved.new_empty((comm.world_size * chunk,) + tuple(moved.shape[1:]))
    comm.all_gather_into(out.view(comm.world_size, -1), padded.reshape(1, -1), collective=collective)
    return out[:total].movedim(0, dim).contiguous()


class DropTokens(torch.autograd.Function):
    """This TP rank's share along ``dim``; backward all-gathers the shares' gradients (DeepSpeed's _DropTokens)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.total = comm, dim, x.shape[dim]
        start, length, _ = share(x.shape[dim], comm.world_size, comm.rank)
        return x.narrow(dim, start, length).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with ctx.comm.during("the backward of the tensor-parallel token share of a MoE layer"):
            whole = _all_gather(ctx.comm, grad.contiguous(), ctx.dim, ctx.total, "tensor-parallel gradient all-gather")
        return whole, None, None


class GatherTokens(torch.autograd.Function):
    """Every TP rank's share along dim 0, whole; backward keeps this rank's share (DeepSpeed's _GatherTokens)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, comm: Communicator, total: int) -> torch.Tensor:
        ctx.comm, ctx.total = comm, total
        with comm.during("the tensor-parallel output all-gather of a MoE layer"):
            return _all_gather(comm, part, 0, total, "tensor-parallel output all-gather")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, length, _ = share(ctx.total, ctx.comm.world_size, ctx.comm.rank)
        return grad.narrow(0, start, length).contiguous(), None, None


def _flag_slice(indices: torch.Tensor, gates: torch.Tensor, part_indices: torch.Tensor, part_gates: torch.Tensor,
                num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The share, with any non-finite gate value or out-of-range expert id of the whole slice carried into it (on
    the device, no host read): every TP rank's group then sees it at the count exchange."""
    nonfinite = (~torch.isfinite(gates)).any()
    out_of_range = ((indices < -1) | (indices >= num_experts)).any()
    part_gates = torch.where(nonfinite, torch.full_like(part_gates, float("nan")), part_gates)
    part_indices = torch.where(out_of_range, torch.full_like(part_indices, num_experts), part_indices)
    return part_indices, part_gates


def run_layer(run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor],
              comm: Optional[Communicator], num_experts: int, x: torch.Tensor, indices: torch.Tensor,
              gates: torch.Tensor, arithmetic: str) -> torch.Tensor:
    """A layer call (``run``) over a whole data-parallel slice's tokens: directly without tensor parallelism
    (``comm`` None or alone), else on this TP rank's share, the combined outputs all-gathered over the TP peers
    (see the module docstring)."""
    if comm is None or comm.world_size == 1:
        return run(x, indices, gates, arithmetic)
    num_tokens = x.shape[0]
    start, length, _ = share(num_tokens, comm.world_size, comm.rank)
    part_x = DropTokens.apply(x, comm, 0)
    part_gates = DropTokens.apply(gates, comm, 1)
    part_indices, part_gates = _flag_slice(indices, gates, indices.narrow(1, start, length), part_gates, num_experts)
    out = run(part_x, part_indices, part_gates, arithmetic)
    return GatherTokens.apply(out, comm, num_tokens)
