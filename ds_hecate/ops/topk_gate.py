"""DeepSpeed's top-k gate (``TopKGate`` with ``k >= 2``, sparse routes) computed without the work Hecate discards.

``deepspeed.moe.sharded_moe.topkgating`` builds, besides the routes, each route's slot in a capacity buffer (a
cumulative sum over the tokens of a dense ``[S, E]`` int64 mask, gathered and cast per route) and normalizes the
gates as a dense ``[S, E]`` division whose routes it then gathers; autograd runs that dense graph backward. Hecate
reads the routes, their weights, ``l_aux`` and the per-expert counts, never the slots, so :func:`sparse_topk_gate`
computes those and nothing else, **bit for bit** as DeepSpeed does, forward and backward:

- routes: ``softmax`` then ``topk`` of the same fp32 logits, the mask and (with ``drop_tokens``) DeepSpeed's
  capacity selection, the same ops in the same order;
- weights: ``top_gate / clamp(sum(gates * mask))``: DeepSpeed's ``(gates * mask / denom).gather(top_idx)`` is
  ``gates * 1.0 / denom`` at the routes, the same rounding; the denominator is DeepSpeed's dense row sum (its
  reduction order is the kernel's over the ``E`` columns, so it is not replaced by a sum over ``k``);
- backward (:class:`_NormalizedRoutes`): DeepSpeed's gradient of the gates, ``((D / denom) + d_denom) * mask``
  with ``D`` the routes' gradients scattered into ``[S, E]`` (what gather's backward does) and ``d_denom`` the row
  sum of ``-D * (w / denom)``: that sum over the dense row as DeepSpeed's autograd takes it (its order decides the
  rounding), the rest per route and placed into zeros (off the routes DeepSpeed's product is a zero too; only its
  sign may differ, which no later sum sees);
- ``l_aux`` and the counts: DeepSpeed's expressions (autograd adds their gradient to the gates' as it does there).

``k == 2`` is DeepSpeed's ``top2gating`` (:func:`sparse_top2_gate`): the first expert by ``argmax``, the second by
the same Gumbel draw, the two routes' weights gathered where DeepSpeed takes one-hot dot products, no cumulative sums
over the tokens unless capacity drops routes. The tests hold both to DeepSpeed's functions on random logits (forward
and the input and router gradients, fp32 and bf16 inputs, with and without token dropping, the same random draws).
Configurations they do not cover (``k == 1``, whose gate has its own noise and capacity rules; an expert-parallel
group, whose gate all-reduces the capacity; DeepSpeed's wall-clock timers) run DeepSpeed's own gate:
:func:`gate_routes` chooses.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from deepspeed.moe.sharded_moe import TopKGate, _capacity, multiplicative_jitter
from torch import nn

from .casts import cast

#: (l_aux, route expert ids ``[k, S]`` (-1 dropped; int64 from this module, the dispatcher's index type, int32 from
#: DeepSpeed's gate), route weights ``[k, S]``, tokens per expert ``[E]``)
GateRoutes = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class _NormalizedRoutes(torch.autograd.Function):
    """``top_gate / denom`` per route, ``[S, k]``, and ``l_aux``'s ``me = mean(gates, 0)``, with DeepSpeed's
    gradient of ``gates`` (see the module docstring). ``denom`` is ``clamp(sum(gates * mask, -1), eps)``;
    ``gates_sum`` is the sum before the clamp. ``me``'s gradient (``grad_me / S`` in every row, what ``mean``'s
    backward gives) is added in the same pass: autograd would divide an expanded ``[S, E]`` and then add the two
    ``[S, E]`` gradients (an addition of two terms either way, so the same bits)."""

    @staticmethod
    def forward(ctx, gates: torch.Tensor, top_idx: torch.Tensor, mask: torch.Tensor,
                dropped: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        gates_sum = torch.sum(gates * mask, dim=-1, keepdim=True)
        denom = torch.clamp(gates_sum, min=torch.finfo(gates.dtype).eps)
        routes = gates.gather(1, top_idx) / denom
        ctx.save_for_backward(top_idx, mask, gates_sum, denom, routes)
        ctx.dropped = dropped
        return routes, torch.mean(gates, dim=0)

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor], grad_me: Optional[torch.Tensor]):
        top_idx, mask, gates_sum, denom, routes = ctx.saved_tensors
        if grad is None:   # (only l_aux reached the gates)
            grad = routes.new_zeros(routes.shape)
        shape = mask.shape
        # division's gradient for the denominator: -grad * ((gates_masked / denom) / denom), summed over the row;
        # non-zero only at the routes, where gates_masked / denom is the route's weight. The row sum is the dense
        # one DeepSpeed's autograd takes (its order over the E columns decides the rounding).
        terms = grad.new_zeros(shape).scatter_add_(1, top_idx, -grad * (routes / denom))
        d_denom = torch.where(gates_sum >= torch.finfo(denom.dtype).eps, terms.sum(dim=1, keepdim=True), 0.0)
        # gates_masked's gradient at the routes: the gathered gradient (gather's backward adds it to a zero: 0 + g)
        # over denom, plus the row sum's, times the mask there; every other column is the mask's zero. Computed
        # per route and placed, where DeepSpeed's autograd runs the same arithmetic over the whole [S, E]. Without
        # capacity drops the mask is one at every route (the product by it is the identity, and skipped).
        at_routes = (grad + 0.0).div_(denom).add_(d_denom)
        if ctx.dropped:
            at_routes.mul_(mask.gather(1, top_idx))
        # the gradient is zero off the routes, as ``terms`` is: the routes' entries overwritten, no second [S, E]
        grad_gates = terms.scatter_(1, top_idx, at_routes)
        if grad_me is not None:
            grad_gates.add_(grad_me.div(shape[0]))
        return grad_gates, None, None, None


def supports(gate: nn.Module) -> bool:
    """Whether :func:`sparse_topk_gate` (``k >= 3``) or :func:`sparse_top2_gate` (``k == 2``) computes ``gate``'s
    routes (otherwise the gate's own forward runs): a DeepSpeed ``TopKGate`` whose forward is DeepSpeed's (a
    subclass that overrides it, a biased or a forced-routing gate say, keeps its own)."""
    return (isinstance(gate, TopKGate) and type(gate).forward is TopKGate.forward and gate.k >= 2
            and gate.ep_group is None and not gate.wall_clock_breakdown)


@functools.lru_cache(maxsize=None)
def _uniform_bounds(device: torch.device, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """The lower bound of the Gumbel draw's uniform samples and the width of their range, as ``torch.distributions``'
    ``Gumbel`` sets them (``tiny`` and ``1 - eps``; the width, ``high - low``, the same bits whichever call makes
    it)."""
    finfo = torch.finfo(dtype)
    low = torch.full((), finfo.tiny, dtype=dtype, device=device)
    return low, torch.full((), 1 - finfo.eps, dtype=dtype, device=device) - low


def gumbel_noise(shape: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """DeepSpeed's ``gumbel_rsample(shape, device)``, the same draw of the global generator and the same bits, without
    the Python of ``torch.distributions`` (half the time of the draw on a small layer): ``u = low + rand * (high -
    low)``, then its transforms ``0 + -1 * log(u)`` and ``0 + -1 * log(that)``. Here in place: ``u``'s sum in the
    other order (commutative), ``log(u) < 0`` so its negation is exact, and the last negation adds ``0.0`` so that a
    zero comes out ``+0`` as ``0 + -1 * 0`` does. The dtype is the default one, as DeepSpeed's ``torch.tensor(1.0)``
    has it."""
    dtype = torch.get_default_dtype()
    low, width = _uniform_bounds(torch.device(device), dtype)
    noise = torch.rand(shape, dtype=dtype, device=device).mul_(width).add_(low)
    return noise.log_().neg_().log_().neg_().add_(0.0)


def _logits(gate: TopKGate, x: torch.Tensor) -> torch.Tensor:
    """``TopKGate.forward``'s fp32 logits (with its input jitter when asked)."""
    x_fp32 = cast(x, torch.float32)
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        x_fp32 = multiplicative_jitter(x_fp32, device=x.device)
    return F.linear(x_fp32, weight=cast(gate.wg.weight, torch.float32), bias=None)


def sparse_top2_gate(gate: TopKGate, x: torch.Tensor) -> GateRoutes:
    """``top2gating`` with sparse routes for a ``TopKGate`` with ``k == 2``, bit for bit (module docstring): the
    second expert by the same Gumbel draw, the two routes' weights as gathers of the gates where DeepSpeed takes
    one-hot dot products (``einsum("se,se->s")``: one non-zero term, the same value; backward, the route's gradient
    at its expert), the same division and clamp, no capacity slots."""
    logits = _logits(gate, x)
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if gate.top2_2nd_expert_sampling:
        logits = logits + gumbel_noise(tuple(logits.shape), logits.device)
    # (DeepSpeed's ``masked_fill(mask1.bool(), -inf)``: the same values, without the boolean copy of the mask)
    second = torch.argmax(logits.scatter(1, first.unsqueeze(1), float("-inf")), dim=1)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = mask1.sum(dim=0).scatter_add_(0, second, torch.ones_like(second))   # (integers: no gradient)
    routes = torch.stack([first, second])                                 # [2, S]
    weights = gates.gather(1, routes.t()).t()                             # [2, S]
    if gate.drop_tokens:   # DeepSpeed's capacity: the first routes fill each expert's slots, then the second
        mask2 = F.one_hot(second, num_classes=num_experts)
        factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
        capacity = _capacity(gates, torch.tensor(factor * 2), torch.tensor(gate.min_capacity))
        locations1 = torch.cumsum(mask1, dim=0) - 1
        locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
        kept = torch.stack([(torch.lt(locations1, capacity) * mask1).any(dim=1),
                            (torch.lt(locations2, capacity) * mask2).any(dim=1)])
        weights = weights * kept
        routes = torch.where(kept, routes, torch.full_like(routes, -1))
    first_w, second_w = weights.unbind(0)
    denom = torch.clamp(first_w + second_w, min=torch.finfo(weights.dtype).eps)
    return l_aux, routes, weights / denom, exp_counts   # (each route's weight over its token's denominator)


def sparse_topk_gate(gate: TopKGate, x: torch.Tensor) -> GateRoutes:
    """``gate`` (a ``TopKGate`` that :func:`supports`) on the tokens ``x`` ``[S, H]``: what its forward returns with
    ``sparse_routes=True``, less the capacity and the slots."""
    logits = _logits(gate, x)
    k = gate.k
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    if not gate.drop_tokens:   # the mask as the products and means see it, in the gates' dtype: no [S, E] conversion
        mask = torch.zeros_like(gates).scatter_(1, top_idx, 1.0)
        exp_counts = torch.sum(mask, dim=0).long()   # (0/1 summed exactly: DeepSpeed's int64 counts)
        ce = torch.mean(mask, dim=0)
    else:   # DeepSpeed's boolean mask, which its capacity selection then narrows in place
        mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
        exp_counts = torch.sum(mask, dim=0)
        ce = torch.mean(mask.float(), dim=0)
        capacity_factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
        capacity = _capacity(gates, torch.tensor(capacity_factor * k), torch.tensor(gate.min_capacity))
        topk_masked_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        selection_capacity = min(capacity, torch.tensor(gates.size(0)).to(capacity.device))
        _, capacity_indices = torch.topk(topk_masked_gates, k=selection_capacity, dim=0, sorted=False)
        mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, capacity_indices, True)
    weights, me = _NormalizedRoutes.apply(gates, top_idx, mask, bool(gate.drop_tokens))
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k
    if gate.drop_tokens:
        kept = mask.gather(1, top_idx)
        top_idx = torch.where(kept, top_idx, torch.full_like(top_idx, -1))
        weights = weights * kept   # DeepSpeed gathers the masked (zero) weight of a dropped route
    return l_aux, top_idx.t().contiguous(), weights.t().contiguous(), exp_counts


def gate_routes(gate: nn.Module, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> GateRoutes:
    """The routes of DeepSpeed's ``gate`` for ``x``: :func:`sparse_top2_gate` or :func:`sparse_topk_gate` where they
    apply, else the gate's own forward with sparse routes (``used_token`` goes there: only DeepSpeed's top-1 gate
    reads it)."""
    if supports(gate):
        return sparse_top2_gate(gate, x) if gate.k == 2 else sparse_topk_gate(gate, x)
    l_aux, _capacity, _num_experts, indices, _locations, weights, exp_counts = gate(x, used_token, True, False)
    return l_aux, indices, weights, exp_counts
