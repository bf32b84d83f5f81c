"""The token dispatcher's gather of the routed slots (runtime/dispatcher.SlotRows): the input gradient sums each
token's routes in route order where atomics would not (CUDA), and equals autograd's index_add on the CPU; and the
layout of a call's rows: the permutations a rank alone skips, the zero row only when a slot is dropped."""
from __future__ import annotations

import torch

from ds_hecate.runtime import dispatcher
from ds_hecate.runtime.dispatcher import SlotRows
from ds_hecate.planning.dispatch_plan import RankDispatch


def _slots(top_k: int, tokens: int, dropped: int, seed: int) -> torch.Tensor:
    """Routed slots in a send order (a permutation of all slots, the last ``dropped`` left out)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(top_k * tokens, generator=gen)[:top_k * tokens - dropped]


def _grad(x: torch.Tensor, slots: torch.Tensor, top_k: int, grad: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_(True)
    SlotRows.apply(leaf, slots, top_k).backward(grad)
    assert leaf.grad is not None
    return leaf.grad


def test_cpu_backward_is_autogradss_index_select(monkeypatch):
    torch.manual_seed(0)
    x, slots = torch.randn(50, 16), _slots(4, 50, 7, 1)
    grad = torch.randn(slots.numel(), 16)
    leaf = x.detach().requires_grad_(True)
    leaf.index_select(0, slots % 50).backward(grad)
    assert leaf.grad is not None
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


def _dispatch(received: "list[list[int]]") -> RankDispatch:
    """Rank 0's dispatch of a call that receives ``received[source][expert]`` rows of experts 0..K-1."""
    import numpy as np
    got = np.asarray(received, dtype=np.int64)
    by_expert = got.T
    starts = got.cumsum().reshape(got.shape).T - by_expert
    sizes = by_expert.sum(axis=1).tolist()
    return RankDispatch(rank=0, mine=tuple(range(got.shape[1])), send_dst=np.zeros(got.shape[1], dtype=np.int64),
                        send_rows=np.asarray(sizes), send_splits=[int(got.sum())], recv_splits=got.sum(axis=1).tolist(),
                        order_starts=starts.reshape(-1), order_lengths=by_expert.reshape(-1), sizes=sizes)


def test_the_permutations_are_skipped_only_by_a_rank_alone_whose_rows_arrive_expert_major():
    """``ExpertRows.in_order`` (no gather either way) needs both: rows from one source (expert-major already) and a
    rank alone with its shortcuts; a rank of N keeps both gathers even when they are the identity, and rows from
    two sources are permuted whatever the flag (the outputs go back in the received order)."""
    from ds_hecate.runtime.sharded_experts import ExpertRows
    one_source = _dispatch([[3, 0, 2]])
    assert ExpertRows.of(one_source, [0, 1, 2], 3, torch.device("cpu"), 0, alone=True).in_order
    assert not ExpertRows.of(one_source, [0, 1, 2], 3, torch.device("cpu"), 0, alone=False).in_order
    two_sources = _dispatch([[3, 0, 2], [1, 2, 0]])
    rows = ExpertRows.of(two_sources, [0, 1, 2], 3, torch.device("cpu"), 1, alone=True)
    assert not rows.in_order
    recv = torch.arange(8.0).unsqueeze(1)
    grouped = rows.to_experts(recv)
    assert grouped.flatten().tolist() == [0, 1, 2, 5, 6, 7, 3, 4]   # expert 0: 3 + 1 rows, expert 1: 2, expert 2: 2
    back = rows.to_received(grouped)
    assert torch.equal(back[:8], recv) and back.shape[0] == 9 and back[8].abs().sum() == 0   # and its zero row


def test_a_zero_row_follows_the_outputs_only_when_a_slot_is_dropped():
    from ds_hecate.runtime.dispatcher import Routes
    full = Routes(torch.arange(12), [12], [12], routed=12, num_tokens=4, top_k=3)
    dropped = Routes(torch.arange(11), [11], [11], routed=11, num_tokens=4, top_k=3)
    assert (full.pad_rows, dropped.pad_rows) == (0, 1)


def test_the_count_row_flags_every_non_finite_gate_and_counts_every_route():
    from ds_hecate.runtime.dispatcher import slot_histogram
    flat = torch.tensor([0, 2, 2, -1, 5, 3])   # expert 2 twice, a dropped slot, an id out of range (E = 4)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gates = torch.rand(6).to(dtype)
        assert slot_histogram(flat, gates, 4).tolist() == [1, 0, 2, 1, 1, 0]   # counts, out of range, non-finite
        for bad in (float("inf"), float("-inf"), float("nan")):
            spoiled = gates.clone()
            spoiled[3] = bad
            assert slot_histogram(flat, spoiled, 4).tolist() == [1, 0, 2, 1, 1, 1], (dtype, bad)
        assert slot_histogram(flat[:4], spoiled[:4], 4).tolist() == [1, 0, 2, 0, 0, 1], (dtype, bad)
        # any negative id is a dropped slot (Routes sorts them last, as -1): in no expert's count, no flag
        assert slot_histogram(torch.tensor([0, -3, 2, -1]), gates[:4], 4).tolist() == [1, 0, 1, 0, 0, 0]
        huge = torch.full((6,), torch.finfo(dtype).max, dtype=dtype)   # finite, though their sum overflows
        assert slot_histogram(flat, huge, 4)[5] == 0
