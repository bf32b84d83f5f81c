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

The gradients of a layer's owned experts are the rows of one fp32 ``[owned, numel]`` tensor (:attr:`grads`), kept
across steps: the window's first contribution is written into it, later ones added, a whole layer per op. The rows
the optimizer reads (:attr:`optimizer_grads`) are those, or, partitioned, the ``[owned, slice]`` reduce-scatter over
the peers. Every owned expert's weights are also kept in the compute dtype (:attr:`LayerShard.weight_rows`), the
first rows of the block a layer call computes from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..experts import ExpertKernel


def initial_master(flat: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """An expert's fp32 master taken from the model at take-over. DeepSpeed's fp16/bf16 optimizers copy their fp32
    masters from the model after casting it to the compute dtype, so the experts' masters start from the same
    rounded values as every dense parameter's (and as a data-parallel run's experts)."""
    return flat.to(compute_dtype).to(torch.float32)


class _RowsByExpert(Mapping):
    """expert -> its row of ``rows`` (``experts`` in row order); the rows are unbound at the first lookup."""

    def __init__(self, experts: Sequence[int], rows: torch.Tensor) -> None:
        self._experts, self._rows = list(experts), rows
        self._views: Optional[Dict[int, torch.Tensor]] = None

    def __getitem__(self, expert: int) -> torch.Tensor:
        if self._views is None:
            self._views = dict(zip(self._experts, self._rows.unbind(0)))
        return self._views[expert]

    def __iter__(self) -> Iterator[int]:
        return iter(self._experts)

    def __len__(self) -> int:
        return len(self._experts)


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
    """One MoE layer's experts on this rank (``rank`` and ``owners`` are ranks of the rank's group).

    **Resident weights.** The owned experts' whole weights in the compute dtype are kept as :attr:`weight_rows`,
    refreshed once per optimizer step (and after a checkpoint load, a re-shard or any other write to the masters:
    :meth:`refresh`); a layer call computes the owned experts from these rows as they are (no cast, no pack per
    call) and SparseAllGather sends replicas from them. With fp32 compute and whole masters the masters *are*
    those rows (views), so nothing is refreshed and nothing is kept twice.

    **Gradient accumulator.** :attr:`grads` (fp32 ``[owned, numel]``) is kept across steps (unpartitioned);
    :attr:`fresh_params` names the parameters whose columns hold nothing of the current accumulation window, so the
    first contribution to them is written, later ones added (the values of zeros-then-add, without the zero fill).
    Readers go through :meth:`grad_rows`, which zero-fills what is fresh (a layer that ran no backward in the
    window).
    """

    layer_id: int
    name: str
    num_experts: int
    kernel: ExpertKernel
    owners: Tuple[int, ...]
    rank: int
    masters: Dict[int, nn.Parameter] = field(default_factory=dict)
    #: fp32 ``[owned, numel]`` gradient rows of the owned experts (summed over the group), or None
    grads: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    #: the parameters (kernel names) whose columns of :attr:`grads` hold nothing of this window yet
    fresh_params: frozenset = field(default=frozenset(), repr=False, compare=False)
    #: how the masters are split over the expert-data-parallel peers; None: whole masters
    partition: Optional[Partition] = field(default=None, repr=False, compare=False)
    #: ``[owned, numel]`` whole weights in the compute dtype, resident (the masters themselves when they share)
    weight_rows: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    #: partitioned: ``[owned, slice]`` reduced gradient slices (``masters[e].grad`` views a row), else None
    slice_grads: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    compute_dtype: torch.dtype = field(default=torch.float32, repr=False, compare=False)
    #: (lo, hi, shape) -> :attr:`grads`' columns as ``[owned, *shape]``, where the expert compute writes: made once
    #: per accumulator, not per call; dropped whenever ``grads`` is replaced or freed
    _grad_columns: Dict[Tuple[int, int, Tuple[int, ...]], torch.Tensor] = field(default_factory=dict, repr=False,
                                                                                  compare=False)

    def __setattr__(self, name: str, value) -> None:
        if name == "grads":   # the views would keep a replaced or freed accumulator alive
            object.__setattr__(self, "_grad_columns", {})
        object.__setattr__(self, name, value)

    def grad_columns(self, device: torch.device, lo: int, hi: int, shape: Tuple[int, ...]) -> torch.Tensor:
        """The accumulator's columns ``[lo, hi)`` as ``[owned, *shape]`` (allocated when missing, not filled)."""
        rows = self.accumulator_rows(device)
        key = (lo, hi, shape)
        if key not in self._grad_columns:
            self._grad_columns[key] = rows[:, lo:hi].view(rows.shape[0], *shape)
        return self._grad_columns[key]

    @property
    def owned(self) -> List[int]:
        return sorted(self.masters)

    @property
    def master_numel(self) -> int:
        """Elements of each master on this rank: the whole expert, or its slice."""
        return self.partition.size if self.partition is not None else self.kernel.numel

    @property
    def shares_weights(self) -> bool:
        """Whether the masters are the resident weight rows themselves (fp32 compute, whole masters)."""
        return self.partition is None and self.compute_dtype == torch.float32

    @property
    def weights(self) -> Mapping[int, torch.Tensor]:
        """expert -> its whole flat weights in the compute dtype (rows of :attr:`weight_rows`), what
        SparseAllGather sends from (the rows are taken apart only when a row is asked for: a call that sends
        nothing issues no op for them)."""
        assert self.weight_rows is not None   # laid out with the masters (set_masters), before any layer call
        return _RowsByExpert(self.owned, self.weight_rows)

    def set_masters(self, flats: Dict[int, torch.Tensor], partition: Optional[Partition] = None,
                    compute_dtype: torch.dtype = torch.float32) -> None:
        """Own these whole fp32 experts; with ``partition`` keep this rank's slices as masters. The resident
        weights are laid out anew from them (shared: the masters are new Parameters viewing their rows)."""
        expected = [e for e, o in enumerate(self.owners) if o == self.rank]
        if sorted(flats) != expected:
            raise RuntimeError(f"layer {self.name}: rank {self.rank} should own experts {expected}, "
                               f"got {sorted(flats)}")
        self.partition = partition
        self.compute_dtype = compute_dtype
        whole = {e: flats[e].to(torch.float32).contiguous() for e in expected}
        device = next(iter(whole.values())).device if whole else None
        self.weight_rows = self._rows([whole[e] for e in expected], device)
        if self.shares_weights:
            self.masters = {e: nn.Parameter(row, requires_grad=False)
                            for e, row in zip(expected, self.weight_rows.unbind(0))}
        elif partition is None:
            self.masters = {e: nn.Parameter(whole[e], requires_grad=False) for e in expected}
        else:
            self.masters = {e: nn.Parameter(partition.slice_of(whole[e]), requires_grad=False) for e in expected}
        self.grads = self.slice_grads = None
        self.fresh_params = frozenset(self.kernel.names)

    def relayout(self, device: torch.device) -> Dict[nn.Parameter, nn.Parameter]:
        """After the owned set changed (re-sharding): resident weights for the new owned experts, from the masters
        (partitioned: left for :func:`~ds_hecate.runtime.edp.refresh_weights` to gather), and an empty accumulator.
        Shared, every master becomes a new Parameter viewing its new row: returns old -> new, so the caller moves
        their optimizer state."""
        owned = self.owned
        heads = [] if self.partition is not None else [self.masters[e].detach() for e in owned]
        self.weight_rows = self._rows(heads, device, len(owned))
        replaced: Dict[nn.Parameter, nn.Parameter] = {}
        if self.shares_weights:
            for e, row in zip(owned, self.weight_rows.unbind(0)):
                new = nn.Parameter(row, requires_grad=False)
                replaced[self.masters[e]] = new
                self.masters[e] = new
        self.grads = None
        self.fresh_params = frozenset(self.kernel.names)
        return replaced

    def _rows(self, heads: List[torch.Tensor], device, count: Optional[int] = None) -> torch.Tensor:
        """``[owned, numel]`` compute-dtype rows filled from ``heads`` (cast; none: left for a refresh)."""
        rows = torch.empty(len(heads) if count is None else count, self.kernel.numel, dtype=self.compute_dtype,
                           device=device)
        if heads:
            torch.stack([h.reshape(-1) for h in heads], out=rows)
        return rows

    def refresh(self, pack: Optional[Callable[[List[torch.Tensor], torch.Tensor], None]] = None) -> None:
        """The resident weights from the (updated) whole masters: one cast pass (``pack(srcs, out)``: the
        transport's device op, a CUDA kernel with the CuPy transport). Nothing to do when the masters are the
        weights; partitioned layers are refreshed by :func:`~ds_hecate.runtime.edp.refresh_weights` (an all-gather
        of the peers' slices)."""
        if self.shares_weights or self.partition is not None or not self.masters:
            return
        masters = [self.masters[e].detach() for e in self.owned]
        assert self.weight_rows is not None   # laid out with the masters
        if pack is None:
            torch.stack(masters, out=self.weight_rows)
        else:
            pack(masters, self.weight_rows)

    # -- gradient accumulator ------------------------------------------------------------------------------------
    def accumulator_rows(self, device: torch.device) -> torch.Tensor:
        """The accumulator rows (allocated, not filled, when missing: their fresh columns hold nothing yet)."""
        if self.grads is None:
            self.grads = torch.empty(len(self.masters), self.kernel.numel, dtype=torch.float32, device=device)
            self.fresh_params = self.kernel.name_set
        return self.grads

    def param_columns(self, name: str) -> Tuple[int, int]:
        """The columns ``[lo, hi)`` of parameter ``name`` in an expert's flat vector."""
        i = self.kernel.names.index(name)
        lo = sum(self.kernel.numels[:i])
        return lo, lo + self.kernel.numels[i]

    def mark_written(self, names: Optional[Sequence[str]] = None) -> None:
        """Contributions to ``names`` (None: every parameter) are in the accumulator: later ones add; the masters'
        ``.grad`` view their rows."""
        fresh = self.fresh_params
        if not fresh:
            return
        first = fresh == self.kernel.name_set
        self.fresh_params = frozenset() if names is None else fresh.difference(names)
        if first and self.partition is None:
            assert self.grads is not None   # the contributions were written into it
            # fresh views each window (a view handed out as .grad could have been re-pointed by its holder)
            masters = self.masters
            for e, row in zip(sorted(masters), self.grads.unbind(0)):
                masters[e].grad = row

    def grad_rows(self, device: torch.device) -> torch.Tensor:
        """The owned experts' fp32 gradient rows (in :attr:`owned` order) to read or add into: the columns with no
        contribution of this window are zero-filled first. Unpartitioned, each master's ``.grad`` views its row."""
        rows = self.accumulator_rows(device)
        for name in self.kernel.names:
            if name in self.fresh_params:
                lo, hi = self.param_columns(name)
                rows[:, lo:hi].zero_()
        self.mark_written()
        return rows

    def set_slice_grads(self, slices: torch.Tensor) -> None:
        """Partitioned: the reduce-scattered ``[owned, slice]`` gradients become the masters' ``.grad``."""
        self.slice_grads = slices
        for e, row in zip(self.owned, slices.unbind(0)):
            self.masters[e].grad = row

    @property
    def optimizer_grads(self) -> Optional[torch.Tensor]:
        """The rows whose rows are the masters' ``.grad`` (the whole gradients, or partitioned their slices)."""
        if self.partition is None:
            return None if self.fresh_params == self.kernel.name_set else self.grads
        return self.slice_grads

    def zero_grads(self) -> None:
        """A new accumulation window: the accumulator is kept (unpartitioned; freed partitioned, whose whole rows
        live only until the reduction over the peers) and written by the next contributions; the masters have no
        gradient until then."""
        self.fresh_params = self.kernel.name_set
        self.slice_grads = None
        if self.partition is not None:
            self.grads = None
        for master in self.masters.values():
            master.grad = None


@dataclass
class ShardAccumulator:
    """A shard's gradient accumulator as SparseReduceScatter and the expert compute add into it
    (:class:`~ds_hecate.comm.buffers.Accumulator`)."""

    shard: LayerShard
    device: torch.device

    def rows(self) -> torch.Tensor:
        return self.shard.accumulator_rows(self.device)

    def columns_view(self, lo: int, hi: int, shape: Tuple[int, ...]) -> torch.Tensor:
        return self.shard.grad_columns(self.device, lo, hi, shape)

    def fresh_columns(self) -> List[Tuple[int, int]]:
        self.rows()
        return [self.shard.param_columns(n) for n in self.shard.kernel.names if n in self.shard.fresh_params]

    def columns(self, name: str) -> Tuple[int, int]:
        return self.shard.param_columns(name)

    def is_fresh(self, name: str) -> bool:
        self.rows()
        return name in self.shard.fresh_params

    def written(self, names: Optional[Sequence[str]] = None) -> None:
        self.shard.mark_written(names)


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
            if rows is not None and all((grad := shard.masters[e].grad) is not None and
                                        grad.data_ptr() == row.data_ptr()
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
        """The resident compute-dtype weights kept besides the masters (none where the masters are the weights)."""
        return sum(s.weight_rows.numel() * s.weight_rows.element_size() for s in self.layers
                   if s.weight_rows is not None and not s.shares_weights)



    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers for t in (s.grads, s.slice_grads)
                   if t is not None)
