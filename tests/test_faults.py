"""Bad numbers at an MoE layer stop every rank at the same collective with an error naming the layer and the rank,
instead of one rank failing while the others wait forever."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks


class _OutOfRangeGate(torch.nn.Module):
    """A gate whose sparse routes name an expert that does not exist."""

    def __init__(self, gate) -> None:
        super().__init__()
        self.inner = gate

    def forward(self, x, used_token=None, sparse_routes=False, use_tutel=False):
        l_aux, cap, num_e, indices, locations, gates, counts = self.inner(x, used_token, sparse_routes, use_tutel)
        return l_aux, cap, num_e, torch.full_like(indices, num_e), locations, gates, counts


def _bad_numbers_worker(rank: int, world: int, fault: str) -> str:
    import torch.distributed as dist
    from torch import nn

    import ds_hecate
    from ds_hecate.config import HecateConfig
    from ds_hecate.convert import take_over_layer
    from ds_hecate.errors import HecateError
    from ds_hecate.initialize import build_runtime

    dist.init_process_group("gloo")
    runtime = build_runtime(HecateConfig(enabled=True, placement="hecate"), {})
    torch.manual_seed(0)
    layer = ds_hecate.MoE(8, nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), num_experts=4, k=2,
                          drop_tokens=False, min_capacity=0)
    take_over_layer("blocks.3.moe", layer, runtime)
    x = torch.randn(16, 8)
    if fault == "nan" and rank == 1:
        x[3, 2] = float("nan")
    if fault == "out-of-range" and rank == 0:
        layer.gate = _OutOfRangeGate(layer.gate)
    try:
        layer(x)
    except HecateError as exc:
        return str(exc)
    return "NO ERROR"


@pytest.mark.parametrize("fault,rank_text", [("nan", "non-finite gate values (NaN/Inf) on rank(s) [1]"),
                                              ("out-of-range", "expert indices outside [0, 4) on rank(s) [0]")])
def test_bad_numbers_stop_every_rank_with_the_layer_named(fault, rank_text):
    messages = run_ranks(2, _bad_numbers_worker, fault, timeout=120)
    for message in messages:
        assert "MoE layer 'blocks.3.moe'" in message and rank_text in message, message
