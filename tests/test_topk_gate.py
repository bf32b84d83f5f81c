"""``ds_hecate.ops.topk_gate`` against DeepSpeed's ``TopKGate``: the same routes, weights, ``l_aux`` and counts, and
the same gradients of the tokens and the router weight, bit for bit (it replaces DeepSpeed's gate on Hecate's
layers, whose promise is DeepSpeed's training)."""
from __future__ import annotations

import math

import pytest
import torch
from deepspeed.moe.sharded_moe import TopKGate, gumbel_rsample

from ds_hecate.ops.topk_gate import gate_routes, gumbel_noise, sparse_topk_gate, supports

CASES = [  # tokens, hidden, experts, k, drop_tokens, capacity factor, input dtype
    (64, 16, 8, 3, False, 1.0, torch.float32),
    (512, 32, 128, 8, False, 1.0, torch.float32),
    (300, 24, 64, 6, False, 1.0, torch.bfloat16),
    (256, 16, 16, 4, True, 1.0, torch.float32),     # capacity drops routes
    (256, 16, 16, 4, True, 0.25, torch.bfloat16),
    (1, 8, 8, 3, False, 1.0, torch.float32),
    (512, 32, 16, 2, False, 1.0, torch.float32),    # top-2: DeepSpeed's top2gating, second expert sampled
    (300, 24, 64, 2, False, 1.0, torch.bfloat16),
    (256, 16, 8, 2, True, 1.0, torch.float32),      # top-2 with capacity drops
    (256, 16, 8, 2, True, 0.25, torch.bfloat16),
]


def _gate(hidden, experts, k, drop, factor, seed):
    torch.manual_seed(seed)
    gate = TopKGate(hidden, experts, k, capacity_factor=factor, eval_capacity_factor=factor, min_capacity=2,
                    drop_tokens=drop)
    return gate


def _run(fn, gate, x, grads, loss="both"):
    """(outputs, input gradient, router gradient) of one gate call with a loss on the weights and ``l_aux``
    (``loss``: ``"both"``, or only one of them: ``"weights"``, ``"l_aux"``)."""
    gate.wg.weight.grad = None
    x = x.detach().clone().requires_grad_(True)
    l_aux, indices, weights, counts = fn(gate, x)
    terms = {"weights": (weights.float() * grads).sum(), "l_aux": l_aux * 0.37}
    (terms["weights"] + terms["l_aux"] if loss == "both" else terms[loss]).backward()
    return (l_aux.detach(), indices, weights.detach(), counts), x.grad, gate.wg.weight.grad.clone()


def _deepspeed(gate, x):
    l_aux, _c, _n, indices, _loc, weights, counts = gate(x, None, True, False)
    return l_aux, indices, weights, counts


@pytest.mark.parametrize("tokens,hidden,experts,k,drop,factor,dtype", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_routes_and_gradients_as_deepspeed_bit_for_bit(tokens, hidden, experts, k, drop, factor, dtype, seed):
    gate = _gate(hidden, experts, k, drop, factor, seed)
    assert supports(gate)
    x = torch.randn(tokens, hidden).to(dtype)
    grads = torch.randn(k, tokens)
    if seed == 2:   # some routes without gradient, a whole token's included
        grads[:, : tokens // 2] = 0.0
    torch.manual_seed(100 + seed)   # top-2 samples its second expert: the same draws for both
    ours, ours_dx, ours_dw = _run(lambda g, t: gate_routes(g, t), gate, x, grads)
    torch.manual_seed(100 + seed)
    ref, ref_dx, ref_dw = _run(_deepspeed, gate, x, grads)
    assert ours[1].dtype == torch.int64 and ref[1].dtype == torch.int32   # ours: the dispatcher's index type
    for name, a, b in zip(("l_aux", "indices", "weights", "counts"), ours, ref):
        if name == "indices":
            a, b = a.long(), b.long()
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    if drop:
        assert (ref[1] < 0).any(), "the case was meant to drop routes"
    assert torch.equal(ours_dx, ref_dx)
    assert torch.equal(ours_dw, ref_dw)


@pytest.mark.parametrize("loss", ["weights", "l_aux"])
@pytest.mark.parametrize("k,drop", [(4, False), (4, True), (2, False)])
def test_a_loss_on_one_output_alone_has_deepspeeds_gradients(loss, k, drop):
    """The top-k gate adds ``l_aux``'s gradient in the weights' backward: with only one of the two in the loss
    the other's part must be absent, not zero-filled (a ``-0`` would become ``+0``) or taken twice."""
    gate = _gate(16, 16, k, drop, 1.0, 3)
    x, grads = torch.randn(256, 16), torch.randn(k, 256)
    torch.manual_seed(7)
    _, ours_dx, ours_dw = _run(lambda g, t: gate_routes(g, t), gate, x, grads, loss)
    torch.manual_seed(7)
    _, ref_dx, ref_dw = _run(_deepspeed, gate, x, grads, loss)
    assert torch.equal(ours_dx, ref_dx) and torch.equal(ours_dw, ref_dw)
    assert (ours_dx.signbit() == ref_dx.signbit()).all()


def test_jitter_draws_the_same_noise():
    gate = _gate(16, 16, 4, False, 1.0, 3)
    gate.noisy_gate_policy = "Jitter"
    x, grads = torch.randn(128, 16), torch.randn(4, 128)
    torch.manual_seed(7)
    ours = _run(lambda g, t: sparse_topk_gate(g, t), gate, x, grads)
    torch.manual_seed(7)
    ref = _run(_deepspeed, gate, x, grads)
    assert all(torch.equal(a, b) for a, b in zip(ours[0], ref[0]))
    assert torch.equal(ours[1], ref[1]) and torch.equal(ours[2], ref[2])


@pytest.mark.parametrize("shape", [(64, 8), (1, 3), (4096, 128)])
def test_the_gumbel_draw_is_deepspeeds_bit_for_bit(shape):
    """The top-2 gate's second-expert noise: DeepSpeed's values and zero signs, and the generator left where
    DeepSpeed's draw leaves it."""
    cpu = torch.device("cpu")
    for seed in range(5):
        torch.manual_seed(seed)
        ref, ref_next = gumbel_rsample(shape, cpu), torch.rand(4)
        torch.manual_seed(seed)
        ours, ours_next = gumbel_noise(shape, cpu), torch.rand(4)
        assert torch.equal(ours, ref) and torch.equal(ours.signbit(), ref.signbit())
        assert torch.equal(ours_next, ref_next)


def test_a_gumbel_draw_of_zero_is_a_positive_zero_as_in_deepspeed(monkeypatch):
    """Uniform samples around ``1/e``, where ``log(-log(u))`` rounds to zero: DeepSpeed's ``0 + -1 * 0`` is ``+0``."""
    near = torch.tensor(math.exp(-1), dtype=torch.float32) + torch.arange(-200, 200, dtype=torch.float32) * 2.0 ** -25
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: near.clone())
    cpu = torch.device("cpu")
    ref, ours = gumbel_rsample((400,), cpu), gumbel_noise((400,), cpu)
    assert (ref == 0).any()
    assert torch.equal(ours, ref) and torch.equal(ours.signbit(), ref.signbit())


def test_top2_without_sampling_and_the_second_route_differs_from_the_first():
    gate = _gate(16, 8, 2, False, 1.0, 4)
    gate.top2_2nd_expert_sampling = False
    x, grads = torch.randn(200, 16), torch.randn(2, 200)
    ours = _run(lambda g, t: gate_routes(g, t), gate, x, grads)
    ref = _run(_deepspeed, gate, x, grads)
    assert all(torch.equal(a, b) for a, b in zip(ours[0], ref[0]))
    assert torch.equal(ours[1], ref[1]) and torch.equal(ours[2], ref[2])
    assert (ours[0][1][0] != ours[0][1][1]).all()


def test_gates_it_does_not_cover_run_deepspeeds_own():
    top1 = _gate(16, 8, 1, False, 1.0, 0)
    assert not supports(top1)
    timed = _gate(16, 8, 4, False, 1.0, 0)
    timed.wall_clock_breakdown = True
    assert not supports(timed)
    class Biased(TopKGate):   # a gate of the user's own: its forward, not DeepSpeed's, is the routing
        def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
            return super().forward(input * 2.0, used_token, sparse_routes, use_tutel)

    biased = Biased(16, 8, 4, drop_tokens=False)
    assert not supports(biased)
    x = torch.randn(32, 16)
    assert torch.equal(gate_routes(biased, x)[2], _deepspeed(biased, x)[2])
    assert not torch.equal(gate_routes(biased, x)[2], sparse_topk_gate(biased, x)[2])   # the override matters
    torch.manual_seed(5)
    ours = gate_routes(top1, x)
    torch.manual_seed(5)
    ref = _deepspeed(top1, x)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
