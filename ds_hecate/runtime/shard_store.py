"""Expert shard store: the only persistent copy of expert state (one per group of ``hecate.ep_size`` ranks).

Per MoE layer, each rank holds the experts it owns inside its group (whole experts, one flat vector each): their
fp32 master vectors, on the same tensors their gradient accumulators (``.grad``), and the expert optimizer's state.
Nothing here is a module parameter, so DeepSpeed never sees, flattens, partitions or all-gathers it.

With groups (``world / ep_size = R > 1`` expert-data-parallel peers of every owner, one per group), ZeRO stage 1 and
above partition an owner's expert state over its peers as DeepSpeed partitions expert state over its EDP group:
each peer's ``masters[e]`` is its ``1/R`` slice of the fp32 vector (padded to equal slices), the optimizer steps
slices, and the whole weights the layer calls materialize from are kept in :attr:`LayerShard.weights` (compute
dtype), refreshed from the slices after every applied step. Unpartitioned, the masters are whole and the weights
are the masters.

The gradients of a layer's owned experts are the rows of one fp32 ``[owned, numel]`` tensor (:attr:`grads`):
SparseReduceScatter adds into it in place, a whole layer per op. The rows the optimizer reads
(:attr:`optimizer_grads`) are those, or, partitioned, the ``[owned, slice]`` reduce-scatter over the peers.
"""
from __future__ import annotations

import math
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


@dataclass(frozen=True)
class Partition:
    """This rank's part of every owned expert's state when it is split over ``peers`` expert-data-parallel peers:
    elements ``[index * size, (index + 1) * size)`` of the vector padded to ``peers * size``."""

    peers: int
    index: int
    numel: int

    @property
    def size(self) -> int:
        return math.ceil(self.numel / self.peers)

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole vector (zeros past its end), a new tensor."""
        out = flat.new_zeros(self.size)
        start = self.index * self.size
        stop = min(start + self.size, self.numel)
        if stop > start:
            out[:stop - start] = flat[start:stop]
        return out

    def padded(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, numel]`` rows as ``[peers, n, size]``, peer-major (zero padding), the reduce-scatter's input."""
        out = rows.new_zeros(rows.shape[0], self.peers * self.size)
        out[:, :self.numel] = rows
        return out.view(rows.shape[0], self.peers, self.size).transpose(0, 1).contiguous()

    def whole(self, gathered: torch.Tensor) -> torch.Tensor:
        """``[peers, n, size]`` gathered slices back as ``[n, numel]`` whole rows (a view where it can be)."""
        peers, n, size = gathered.shape
        return gathered.transpose(0, 1).reshape(n, peers * size)[:, :self.numel]


@dataclass
class LayerShard:
    """One MoE layer's experts on this rank (``rank`` and ``owners`` are ranks of the rank's group)."""

    layer_id: int
    name: str
    num_experts: int
    kernel: ExpertKernel
    owners: Tuple[int, ...]
    rank: int
    masters: Dict[int, nn.Parameter] = field(default_factory=dict)
    #: fp32 ``[owned, numel]`` gradient rows of the owned experts (summed over the group), or None
    grads: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    #: how the masters are split over the expert-data-parallel peers; None: whole masters
    partition: Optional[Partition] = field(default=None, repr=False, compare=False)
    #: partitioned: ``[owned, numel]`` whole weights in the compute dtype (the layer calls' source), else None
    weight_rows: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    #: partitioned: ``[owned, slice]`` reduced gradient slices (``masters[e].grad`` views a row), else None
    slice_grads: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    @property
    def owned(self) -> List[int]:
        return sorted(self.masters)

    @property
    def master_numel(self) -> int:
        """Elements of each master on this rank: the whole expert, or its slice."""
        return self.partition.size if self.partition is not None else self.kernel.numel

    @property
    def weights(self) -> Dict[int, torch.Tensor]:
        """expert -> its whole flat weights, what SparseAllGather packs from: the masters, or partitioned the rows
        of :attr:`weight_rows`."""
        if self.partition is None:
            return self.masters
        return dict(zip(self.owned, self.weight_rows.unbind(0)))

    def set_masters(self, flats: Dict[int, torch.Tensor], partition: Optional[Partition] = None,
                    compute_dtype: torch.dtype = torch.float32) -> None:
        """Own these whole fp32 experts; with ``partition`` keep this rank's slices as masters and the whole
        weights in ``compute_dtype``."""
        expected = [e for e, o in enumerate(self.owners) if o == self.rank]
        if sorted(flats) != expected:
            raise RuntimeError(f"layer {self.name}: rank {self.rank} should own experts {expected}, "
                               f"got {sorted(flats)}")
        self.partition = partition
        whole = {e: flats[e].to(torch.float32).contiguous() for e in expected}
        if partition is None:
            self.masters = {e: nn.Parameter(whole[e], requires_grad=False) for e in expected}
            self.weight_rows = None
        else:
            self.masters = {e: nn.Parameter(partition.slice_of(whole[e]), requires_grad=False) for e in expected}
            device = next(iter(whole.values())).device if whole else None
            self.weight_rows = (torch.stack([whole[e] for e in expected]).to(compute_dtype) if whole else
                                torch.zeros(0, self.kernel.numel, dtype=compute_dtype, device=device))
        self.grads = self.slice_grads = None

    def grad_rows(self, device: torch.device) -> torch.Tensor:
        """The owned experts' fp32 gradient rows (in :attr:`owned` order), zeros when a new accumulation starts;
        SparseReduceScatter adds into them in place. Unpartitioned, each master's ``.grad`` views its row."""
        if self.grads is None:
            owned = self.owned
            self.grads = torch.zeros(len(owned), self.kernel.numel, dtype=torch.float32, device=device)
            if self.partition is None:
                for e, row in zip(owned, self.grads.unbind(0)):
                    self.masters[e].grad = row
        return self.grads

    def set_slice_grads(self, slices: torch.Tensor) -> None:
        """Partitioned: the reduce-scattered ``[owned, slice]`` gradients become the masters' ``.grad``."""
        self.slice_grads = slices
        for e, row in zip(self.owned, slices.unbind(0)):
            self.masters[e].grad = row

    @property
    def optimizer_grads(self) -> Optional[torch.Tensor]:
        """The rows whose rows are the masters' ``.grad`` (the whole gradients, or partitioned their slices)."""
        return self.grads if self.partition is None else self.slice_grads

    def zero_grads(self) -> None:
        self.grads = self.slice_grads = None
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
        """Sum of squares of the gradients this rank's expert optimizer will apply (fp32, raw: before any scaling);
        one reduction per layer."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)  # also on a rank that owns nothing
        for shard in self.layers:
            rows = shard.optimizer_grads
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

    def weight_bytes(self) -> int:
        """Partitioned layers' whole compute-dtype weights (unpartitioned ones are their masters)."""
        return sum(s.weight_rows.numel() * s.weight_rows.element_size() for s in self.layers
                   if s.weight_rows is not None)

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers for t in (s.grads, s.slice_grads)
                   if t is not None)
