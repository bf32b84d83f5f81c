"""Expert shard store: the only persistent copy of expert state.

Per MoE layer, each rank holds the fp32 master vector of the experts it owns (whole experts, one flat vector
each) and, on those same tensors, their gradient accumulators (``.grad``). Nothing here is a module parameter,
so DeepSpeed never sees, flattens, partitions or all-gathers it. The expert optimizer keeps its state on the same
tensors, so the whole job holds exactly one copy of every expert's weights, gradient and optimizer state.

The gradients of a layer's owned experts are the rows of one fp32 ``[owned, numel]`` tensor (each master's
``.grad`` is a view of its row): SparseReduceScatter adds into it in place, a whole layer per op, and the norm
reads it in one reduction.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

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
    #: fp32 ``[owned, numel]`` gradient rows of the owned experts (``masters[e].grad`` views its row), or None
    grads: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

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
        self.grads = None

    def grad_rows(self, device: torch.device) -> torch.Tensor:
        """The owned experts' fp32 gradient rows (in :attr:`owned` order), zeros when a new accumulation starts;
        SparseReduceScatter adds into them in place."""
        if self.grads is None:
            owned = self.owned
            numel = self.kernel.numel
            self.grads = torch.zeros(len(owned), numel, dtype=torch.float32, device=device)
            for e, row in zip(owned, self.grads.unbind(0)):
                self.masters[e].grad = row
        return self.grads

    def zero_grads(self) -> None:
        self.grads = None
        for master in self.masters.values():
            master.grad = None


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
        for shard in self.layers:
            shard.zero_grads()

    def grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's accumulated expert gradients (fp32, raw: before any scaling); one reduction
        per layer."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)  # also on a rank that owns nothing
        for shard in self.layers:
            rows = shard.grads
            if rows is not None and all(shard.masters[e].grad is not None and
                                        shard.masters[e].grad.data_ptr() == row.data_ptr()
                                        for e, row in zip(shard.owned, rows.unbind(0))):
                total = total + rows.pow(2).sum()
                continue
            # a gradient replaced from outside (not a view of the rows): the ones the optimizer will apply count
            for master in shard.masters.values():
                if master.grad is not None:
                    total = total + master.grad.float().pow(2).sum()
        return total

    def master_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def grad_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.parameters() if p.grad is not None)
