"""Expert shard store: the only persistent copy of expert state.

Per MoE layer, each rank holds the fp32 master vector of the experts it owns (whole experts, one flat vector
each) and, on those same tensors, their gradient accumulators (``.grad``). Nothing here is a module parameter,
so DeepSpeed never sees, flattens, partitions or all-gathers it. The expert optimizer keeps its state on the same
tensors, so the whole job holds exactly one copy of every expert's weights, gradient and optimizer state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
from torch import nn

from ..experts import ExpertKernel


def initial_master(flat: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """An expert's fp32 master taken from the model at take-over. DeepSpeed's fp16/bf16 optimizers copy their fp32
    masters from the model after casting it to the compute dtype, so the experts' masters start from the same
    rounded values as every dense parameter's (and as a data-parallel run's experts)."""
    return flat.to(compute_dtype).to(torch.float32)


@dataclass
class LayerShard:
    """One MoE layer's experts on this rank."""

    layer_id: int
    name: str
    num_experts: int
    kernel: ExpertKernel
    owners: Tuple[int, ...]
    rank: int
    masters: Dict[int, nn.Parameter] = field(default_factory=dict)

    @property
    def owned(self) -> List[int]:
        return sorted(self.masters)

    def set_masters(self, flats: Dict[int, torch.Tensor]) -> None:
        expected = [e for e, o in enumerate(self.owners) if o == self.rank]
        if sorted(flats) != expected:
            raise RuntimeError(f"layer {self.name}: rank {self.rank} should own experts {expected}, "
                               f"got {sorted(flats)}")
        self.masters = {e: nn.Parameter(flats[e].to(torch.float32).contiguous(), requires_grad=False)
                        for e in expected}

    def accumulate(self, totals: Dict[int, torch.Tensor]) -> None:
        """Add summed gradients (SparseReduceScatter output) into the owners' accumulators."""
        for e, g in totals.items():
            master = self.masters[e]
            if master.grad is None:
                master.grad = g.to(torch.float32).clone()
            else:
                master.grad.add_(g)


class ExpertShardStore:
    """All MoE layers' shards on this rank."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device   # the rank's working device
        self.layers: List[LayerShard] = []

    def add(self, shard: LayerShard) -> None:
        self.layers.append(shard)

    def parameters(self) -> List[nn.Parameter]:
        return [shard.masters[e] for shard in self.layers for e in shard.owned]

    def zero_grads(self) -> None:
        for p in self.parameters():
            p.grad = None

    def grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's accumulated expert gradients (fp32, raw: before any scaling)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)  # also on a rank that owns nothing
        for p in self.parameters():
            if p.grad is not None:
                total = total + p.grad.float().pow(2).sum()
        return total

    def master_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def grad_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.parameters() if p.grad is not None)
