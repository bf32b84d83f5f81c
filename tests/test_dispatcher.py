"""The token dispatcher's gather of the routed slots (runtime/dispatcher.SlotRows): the input gradient sums each
token's routes in route order where atomics would not (CUDA), and equals autograd's index_add on the CPU."""
from __future__ import annotations

import torch

from ds_hecate.runtime import dispatcher
from ds_hecate.runtime.dispatcher import SlotRows


def _slots(top_k: int, tokens: int, dropped: int, seed: int) -> torch.Tensor:
    """Routed slots in a send order (a permutation of all slots, the last ``dropped`` left out)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(top_k * tokens, generator=gen)[:top_k * tokens - dropped]


def _grad(x: torch.Tensor, slots: torch.Tensor, top_k: int, grad: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_(True)
    SlotRows.apply(leaf, slots, top_k).backward(grad)
    return leaf.grad


def test_cpu_backward_is_autogradss_index_select(monkeypatch):
    torch.manual_seed(0)
    x, slots = torch.randn(50, 16), _slots(4, 50, 7, 1)
    grad = torch.randn(slots.numel(), 16)
    leaf = x.detach().requires_grad_(True)
    leaf.index_select(0, slots % 50).backward(grad)
    assert torch.equal(_grad(x, slots, 4, grad), leaf.grad)


def test_route_order_sum_is_the_same_whatever_the_send_order(monkeypatch):
    """The CUDA rule (forced here on the CPU): a token's routes are summed in route order, so two send orders of
    the same slots give the same bits (index_add's order follows the send order), and the values are the sum."""
    monkeypatch.setattr(dispatcher, "DETERMINISTIC_SLOT_SUM", True)
    torch.manual_seed(0)
    top_k, tokens = 8, 64
    x = torch.randn(tokens, 32)
    slots = _slots(top_k, tokens, 5, 2)
    per_slot = torch.randn(top_k * tokens, 32)   # the gradient of each slot, wherever it is sent
    first = _grad(x, slots, top_k, per_slot[slots])
    shuffled = slots[torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(3))]
    second = _grad(x, shuffled, top_k, per_slot[shuffled])
    assert torch.equal(first, second)
    dropped = torch.ones(top_k * tokens, dtype=torch.bool)
    dropped[slots] = False
    expected = per_slot.masked_fill(dropped.unsqueeze(1), 0).view(top_k, tokens, 32).sum(0)
    torch.testing.assert_close(first, expected)
    monkeypatch.setattr(dispatcher, "DETERMINISTIC_SLOT_SUM", False)
    native_first = _grad(x, slots, top_k, per_slot[slots])
    native_second = _grad(x, shuffled, top_k, per_slot[shuffled])
    assert not torch.equal(native_first, native_second), "the send order should move index_add's rounding"
