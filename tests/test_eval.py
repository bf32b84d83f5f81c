"""Evaluation passes with Hecate (issue 18): ``engine.eval()`` and ``torch.no_grad()`` at any batch size, including
batches smaller than the number of experts and a rank with zero tokens, give plain DeepSpeed's eval outputs, with
no hang (every rank still takes part in each layer's count exchange and token all-to-all)."""
from __future__ import annotations

from dataclasses import replace
from typing import List

import pytest
import torch

from moe_training import Spec, TinyMoE, ds_config

SPEC = Spec(steps=0, k=2, num_experts=8)
# (rank 0, rank 1) eval batch sizes: larger than the experts, smaller, one rank empty, one token, the other rank
# empty, the first empty again. Rank 0 is empty more often than rank 1: a rank that skipped its layer calls when
# empty would leave the other waiting (balanced skips would pair up across batches and go unnoticed).
SIZES = [(24, 24), (3, 5), (0, 4), (1, 1), (2, 0), (0, 3)]


def _eval(rank: int, world_size: int, hecate: bool) -> List[torch.Tensor]:
    import deepspeed
    import ds_hecate  # noqa: F401

    deepspeed.init_distributed(dist_backend="gloo")
    spec = replace(SPEC, hecate={"enabled": True, "placement": "hecate", "overlap_degree": 1} if hecate else None)
    torch.manual_seed(spec.seed)
    model = TinyMoE(spec)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(spec))
    g = torch.Generator().manual_seed(7 + rank)
    x, y = torch.randn(16, spec.hidden, generator=g), torch.randn(16, generator=g)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()  # one training step first: eval follows a trained state
    outputs = []
    head = engine.module.head
    captured = []
    handle = head.register_forward_hook(lambda m, i, o: captured.append(o.detach().clone()))
    engine.eval()
    with torch.no_grad():
        for sizes in SIZES:
            n = sizes[rank]
            x, y = torch.randn(n, spec.hidden, generator=g), torch.randn(n, generator=g)
            engine(x, y)
            outputs.append(captured.pop())
    handle.remove()
    engine.train()
    return outputs


def _both(rank: int, world_size: int):
    return [_eval(rank, world_size, False), _eval(rank, world_size, True)]


@pytest.fixture(scope="module")
def runs():
    from dist_utils import run_ranks

    return run_ranks(2, _both)


def test_eval_outputs_match_plain_deepspeed_at_any_batch_size(runs):
    for rank, (oracle, mine) in enumerate(runs):
        for sizes, o, m in zip(SIZES, oracle, mine):
            assert o.shape == m.shape == (sizes[rank], 1), (sizes, o.shape, m.shape)
            assert torch.allclose(o, m, rtol=1e-5, atol=1e-5), f"rank {rank}, batch sizes {sizes}: {o} vs {m}"
