"""The floors ``benchmarks/layer_versus.py`` measures every system against, written from torch ops.

- :class:`PlainGroupedMoE` (``plain``): the floor of a layer on one device, as a user would write it around
  ``F.grouped_mm``; its rows never leave the device.
- :class:`PlainAllToAllMoE` (``plain-all-to-all``): the floor of an all-to-all expert-parallel layer, the plain
  layer with the exchange every rank of an N-rank run makes.

The all-to-all floor. On N ranks an expert-parallel layer built on ``all_to_all_single`` (DeepSpeed's AutoEP,
Megatron-Core's and torchtitan's all-to-all token dispatchers, ds_hecate's per-rank path) does more, whatever it is
called, and this is the least of it:

- a **count exchange**: each rank sends each other rank its routes' counts for that rank's experts (one
  ``all_to_all_single`` of ``E`` counts) and reads the counts back to the host: the variable split sizes of the
  token exchange are host integers;
- the **token exchange** each way (rows to the experts' ranks, outputs back; and both again for the gradients in
  backward);
- a **permutation** each way on the receiving rank: the exchange delivers the rows source-major (each source's
  rows in one chunk, by expert inside it), the grouped GEMM needs them expert-major; and back. Built on the host
  from the received counts (the host has them), one gather each way, forward and backward (the backward of a
  permutation is the gather by its inverse, not autograd's ``index_add_`` scatter: ds_hecate's ``Permute`` and
  ``segment_permutation``, which any careful layer would write alike).

Everything else is the plain layer's, op for op: the router, the sort by expert (which is the send order: experts
live on ranks in blocks), the gather of the token rows, the two grouped GEMMs, the ``index_copy`` back to route order
and the gate-weighted sum. On a world of one rank each exchange moves a rank's rows to itself and each permutation
is the identity, so it computes the plain layer's bits; it still runs all of them, as each rank of N does (nothing
skipped because the group has one rank). Its time over the plain layer's is what the all-to-all design costs on the
shape before any framework's own overhead: the floor for the no-shortcut rows.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_hecate.ops.permute import Permute
from ds_hecate.planning.segments import segment_permutation


class PlainGroupedMoE(nn.Module):
    """The floor: a SwiGLU MoE layer from torch ops, as a user would write it around ``F.grouped_mm``.

    Router (fp32 logits, softmax, top-k, renormalized gates); sort the routes by expert (one stable argsort) and
    gather their token rows; ``[w1; w3]`` as one grouped GEMM, SiLU-gate, ``w2`` as a second; put the rows back in
    route order (``index_copy``) and sum each token's k rows weighted by its gates in fp32 (DeepSpeed's combine
    arithmetic). Autograd does the backward: grouped GEMM's own, deterministic on the CPU."""

    def __init__(self, router: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                 top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Parameter(router.clone())
        self.gate_up = nn.Parameter(torch.cat([w1, w3], dim=1).contiguous())   # [E, 2F, H]
        self.down = nn.Parameter(w2.clone().contiguous())                    # [E, H, F]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates, order, counts = self.route(x)
        rows = x.index_select(0, order // self.top_k)
        return self.combine(self.experts(rows, counts.cumsum(0).to(torch.int32)), order, gates, x)

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gates ``[S, k]``, the routes sorted by expert, routes per expert ``[E]``)."""
        probs = F.linear(x.float(), self.router.float()).softmax(dim=-1)
        top, expert = probs.topk(self.top_k, dim=-1)                          # [S, k]
        gates = top / top.sum(dim=-1, keepdim=True)
        flat = expert.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.router.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        return gates, order, counts

    def experts(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """The SwiGLU experts on their rows (grouped by expert, ``offs`` their ends)."""
        gate_up = F.grouped_mm(rows, self.gate_up.transpose(1, 2), offs=offs)
        g, u = gate_up.chunk(2, dim=-1)
        return F.grouped_mm(F.silu(g) * u, self.down.transpose(1, 2), offs=offs)

    def combine(self, y: torch.Tensor, order: torch.Tensor, gates: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The routes' outputs (in ``order``) back in route order, each token's summed weighted by its gates."""
        y_routes = torch.index_copy(torch.empty_like(y), 0, order, y)
        return (y_routes.view(x.shape[0], self.top_k, -1) * gates.unsqueeze(-1)).sum(dim=1).to(x.dtype)


class Exchange(torch.autograd.Function):
    """``all_to_all_single`` of rows (``send_splits`` to each rank, ``recv_splits`` from each); backward the reverse
    exchange of the gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_splits: List[int], recv_splits: List[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = rows.new_empty((sum(recv_splits),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def expert_major(received: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(perm, inverse) from ``received`` ``[sources, local experts]`` (rows received per source and expert, in the
    exchange's source-major order): ``perm`` takes the received rows expert-major (by expert, then source),
    ``inverse`` puts them back (:func:`~ds_hecate.planning.segments.segment_permutation`)."""
    lengths = received.reshape(-1)
    starts = (np.cumsum(lengths) - lengths).reshape(received.shape)
    return segment_permutation(starts.T.reshape(-1), received.T.reshape(-1))   # the segments taken expert-major


class PlainAllToAllMoE(PlainGroupedMoE):
    """:class:`PlainGroupedMoE` with the exchange of an N-rank expert-parallel layer (see the module docstring):
    expert ``e`` lives on rank ``e // (E / N)`` of the default process group (initialized before the layer is
    built); this rank holds and computes its ``E / N`` experts (parameters of their own: a slice of all experts'
    would cost autograd a zero-filled gradient of all of them)."""

    def __init__(self, router: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                 top_k: int) -> None:
        ranks, rank = dist.get_world_size(), dist.get_rank()
        local = router.shape[0] // ranks
        mine = slice(rank * local, (rank + 1) * local)
        super().__init__(router, w1[mine], w3[mine], w2[mine], top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ranks = dist.get_world_size()
        gates, order, counts = self.route(x)                                 # by expert: by destination too
        received = torch.empty_like(counts)                                  # [sources * local]
        dist.all_to_all_single(received, counts)
        sent_host, received_host = (np.asarray(c, dtype=np.int64) for c in torch.stack((counts, received)).tolist())
        send_splits = sent_host.reshape(ranks, -1).sum(axis=1).tolist()
        by_source = received_host.reshape(ranks, -1)
        perm, inverse = (torch.from_numpy(a).to(x.device) for a in expert_major(by_source))
        offs = torch.from_numpy(np.cumsum(by_source.sum(axis=0)).astype(np.int32)).to(x.device)
        recv_splits = by_source.sum(axis=1).tolist()
        rows = Exchange.apply(x.index_select(0, order // self.top_k), send_splits, recv_splits, None)
        y = self.experts(Permute.apply(rows, perm, inverse), offs)
        y = Exchange.apply(Permute.apply(y, inverse, perm), recv_splits, send_splits, None)
        return self.combine(y, order, gates, x)
