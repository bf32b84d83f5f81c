"""The tensor-parallel token exchange (ds_hecate.runtime.tensor_parallel) on 2 real ranks that hold the same tokens,
for token counts DeepSpeed's capacity split cannot take (odd, fewer than the ranks, none): the shares cover every
token exactly once, the output gathered from the shares is the whole slice's on both ranks, and the input's
gradient is whole on both ranks, as if each had run every token."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks

SIZES = (5, 1, 0, 6)


def _exchange(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from ds_hecate.comm.collectives import Communicator
    from ds_hecate.runtime.tensor_parallel import DropTokens, GatherTokens, share

    dist.init_process_group("gloo")
    comm = Communicator(dist.new_group([0, 1]), rank, world)
    out = {}
    for tokens in SIZES:
        g = torch.Generator().manual_seed(tokens)          # the same tokens on both ranks
        x = torch.randn(tokens, 3, generator=g, requires_grad=True)
        gates = torch.rand(2, tokens, generator=g, requires_grad=True)
        weight = torch.randn(3, 3, generator=g)
        part = DropTokens.apply(x, comm, 0)
        part_gates = DropTokens.apply(gates, comm, 1)
        y = GatherTokens.apply((part @ weight) * part_gates.sum(0, keepdim=True).t(), comm, tokens)
        (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        # the same computation on the whole slice, without the exchange
        x_ref, gates_ref = x.detach().clone().requires_grad_(), gates.detach().clone().requires_grad_()
        y_ref = (x_ref @ weight) * gates_ref.sum(0, keepdim=True).t()
        (y_ref * torch.arange(y_ref.numel(), dtype=y_ref.dtype).view_as(y_ref)).sum().backward()
        out[tokens] = {"share": share(tokens, world, rank)[:2], "y": (y.detach(), y_ref.detach()),
                       "x_grad": (x.grad, x_ref.grad), "gates_grad": (gates.grad, gates_ref.grad)}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, _exchange)


@pytest.mark.parametrize("tokens", SIZES)
def test_shares_cover_each_token_once(results, tokens):
    (start0, length0), (start1, length1) = results[0][tokens]["share"], results[1][tokens]["share"]
    assert start0 == 0 and start0 + length0 == start1 and start1 + length1 == tokens


@pytest.mark.parametrize("tokens", SIZES)
def test_output_and_gradients_are_whole_on_every_rank(results, tokens):
    for rank in (0, 1):
        r = results[rank][tokens]
        for key in ("y", "x_grad", "gates_grad"):
            got, want = r[key]
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6), (rank, key, got, want)
