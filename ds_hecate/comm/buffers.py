"""The data the sparse collectives hand around: traffic counters, the gathered experts' buffer, a gather in flight,
an expert move's lists, and the helpers that order them. Shared by :mod:`.collectives` (the flat collectives and the
:class:`~.collectives.Communicator`) and :mod:`.relay` (the relayed ones); no collective here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ..errors import HecateError
from ..planning import Placement


@dataclass
class CommCounters:
    """Bytes this rank sent, per kind of traffic (local copies excluded), and calls per collective."""

    allgather_bytes: int = 0
    reducescatter_bytes: int = 0
    dispatch_bytes: int = 0
    calls: Dict[str, int] = field(default_factory=dict)

    def count(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def add(self, other: "CommCounters") -> None:
        self.allgather_bytes += other.allgather_bytes
        self.reducescatter_bytes += other.reducescatter_bytes
        self.dispatch_bytes += other.dispatch_bytes
        for k, v in other.calls.items():
            self.calls[k] = self.calls.get(k, 0) + v

    def as_dict(self) -> dict:
        return {"bytes_allgather": self.allgather_bytes, "bytes_reducescatter": self.reducescatter_bytes,
                "bytes_dispatch": self.dispatch_bytes, "calls": dict(self.calls)}


def materialized_buffer(rows: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``[rows, numel]`` block a layer call's experts live in (tests/test_memory_budget.py finds these blocks by
    this function's name on the allocator's stack)."""
    return torch.empty(rows, numel, dtype=dtype, device=device)


@dataclass
class GatheredExperts:
    """This rank's materialized experts of one layer call, in the compute dtype: its own experts' rows
    (``owned_rows``, in expert order: the shard's resident weights as they are, or a packed copy) and the replicas
    received into ``buffer`` (in arrival order: owner rank ascending, then expert, or the relay plan's), the first
    rows of ``block``. ``experts`` lists them in that order, own first. The grouped expert compute runs the two
    parts as they are (no copy of the owned weights per call).

    Rows of ``block`` after ``buffer``'s are reserved for calibration's extras (:meth:`extended`), which are
    received straight into them: extending a prefetched placement after the gate copies nothing, so the replicas
    never live twice (a copy would hold the prefetched rows and the extended buffer at once, up to twice the
    memory budget)."""

    experts: Tuple[int, ...]
    owned_rows: torch.Tensor
    buffer: torch.Tensor
    block: Optional[torch.Tensor] = None

    @property
    def owned(self) -> int:
        return self.owned_rows.shape[0]

    def flats(self) -> Dict[int, torch.Tensor]:
        """expert -> its row (a view), for consolidation, export and tests."""
        return dict(zip(self.experts, list(self.owned_rows.unbind(0)) + list(self.buffer.unbind(0))))

    @property
    def spare_rows(self) -> int:
        """Rows reserved after the buffer's for calibration's extras."""
        return 0 if self.block is None else self.block.shape[0] - self.buffer.shape[0]

    @property
    def replica_bytes(self) -> int:
        """Bytes of the block's replica rows, the reserved ones included (they are allocated)."""
        rows = self.buffer.shape[0] + self.spare_rows
        return rows * self.buffer.shape[1] * self.buffer.element_size()

    def spare(self, rows: int) -> torch.Tensor:
        """The first ``rows`` reserved rows, for the extras' SparseAllGather to receive into."""
        if rows > self.spare_rows:
            raise HecateError(f"calibration's extras need {rows} replica row(s) and {self.spare_rows} are reserved: "
                              "the calibrated placement exceeds the replica budget the prefetch reserved for it")
        assert self.block is not None   # spare_rows is 0 without a block
        start = self.buffer.shape[0]
        return self.block[start:start + rows]

    def extended(self, extra: "GatheredExperts") -> "GatheredExperts":
        """These rows followed by ``extra``'s replicas, received into this block's reserved rows (no copy)."""
        added = extra.buffer.shape[0]
        if added == 0:
            return self
        if extra.owned or extra.buffer.data_ptr() != self.spare(added).data_ptr():
            raise HecateError("calibration's extras were not received into the rows reserved for them")
        rows = self.buffer.shape[0] + added
        assert self.block is not None   # spare() found the extras' rows in it
        return GatheredExperts(self.experts + extra.experts, self.owned_rows, self.block[:rows], self.block)


class Accumulator(Protocol):
    """The owner's fp32 ``[owned, numel]`` gradient rows of one layer, as SparseReduceScatter and the expert
    compute add into them: ``rows()``, and ``fresh_columns()``, the column ranges (one per expert parameter) that
    hold nothing of the accumulation window yet: their first contribution is written, not added, so nothing
    zero-fills them. ``written(names)`` once contributions to those parameters (None: all) are in."""

    def rows(self) -> torch.Tensor: ...

    def fresh_columns(self) -> List[Tuple[int, int]]: ...

    def written(self, names: Optional[Sequence[str]] = None) -> None: ...


@dataclass
class TensorAccumulator:
    """An :class:`Accumulator` over given rows that already hold the window's sums so far (zeros to start), or,
    ``fresh``, nothing yet."""

    tensor: torch.Tensor
    fresh: bool = False

    def rows(self) -> torch.Tensor:
        return self.tensor

    def fresh_columns(self) -> List[Tuple[int, int]]:
        return [(0, self.tensor.shape[1])] if self.fresh else []

    def written(self, names: Optional[Sequence[str]] = None) -> None:
        self.fresh = False


def add_into(accumulator: Accumulator, grads: torch.Tensor) -> torch.Tensor:
    """``accumulator``'s rows plus ``grads`` (fp32 accumulation of compute-dtype gradients, whole rows): written
    where the window is fresh (zeros plus ``grads`` without the zeros), added elsewhere. Returns the rows."""
    rows = accumulator.rows()
    fresh = accumulator.fresh_columns()
    if not fresh:
        rows.add_(grads)
    elif fresh == [(0, rows.shape[1])] or sum(hi - lo for lo, hi in fresh) == rows.shape[1]:
        rows.copy_(grads)
    else:
        done = 0
        for lo, hi in sorted(fresh):
            if lo > done:
                rows[:, done:lo].add_(grads[:, done:lo])
            rows[:, lo:hi].copy_(grads[:, lo:hi])
            done = hi
        if done < rows.shape[1]:
            rows[:, done:].add_(grads[:, done:])
    accumulator.written()
    return rows


class PendingGather:
    """A SparseAllGather in flight; :meth:`wait` returns the :class:`GatheredExperts`."""

    def __init__(self, placement: Placement, finish: Callable[[], GatheredExperts]) -> None:
        self.placement = placement
        self._finish: Optional[Callable[[], GatheredExperts]] = finish   # dropped once it has given its result
        self._result: Optional[GatheredExperts] = None

    def wait(self) -> GatheredExperts:
        if self._result is None:
            assert self._finish is not None
            self._result = self._finish()
            self._finish = None
        return self._result


@dataclass
class ExpertMove:
    """This rank's part of a one-off expert redistribution: experts kept, sent per destination, received per
    source (each list in expert order)."""

    kept: List[int]
    sends: Dict[int, List[int]]
    recvs: Dict[int, List[int]]

    @staticmethod
    def of(sources: Sequence[int], owners: Sequence, rank: int) -> "ExpertMove":
        """``owners[e]``: the rank, or the ranks (one per group), that end up holding expert ``e``."""
        move = ExpertMove([], {}, {})
        for e, (src, dsts) in enumerate(zip(sources, owners)):
            for dst in (dsts if isinstance(dsts, tuple) else (dsts,)):
                if src == dst == rank:
                    move.kept.append(e)
                elif src == rank:
                    move.sends.setdefault(dst, []).append(e)
                elif dst == rank:
                    move.recvs.setdefault(src, []).append(e)
        return move


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def owned_experts_of(placement: Placement, rank: int) -> List[int]:
    """The experts ``rank`` owns in ``placement``, ascending: the first rows of its gathered buffer and the rows of
    its gradient accumulator (listed once per placement and rank: a placement lives across many calls)."""
    cache = placement.__dict__.setdefault("_owned_experts", {})
    if rank not in cache:
        cache[rank] = [e for e, owner in enumerate(placement.owners) if owner == rank]
    return list(cache[rank])


def _source_major(lists: Dict[int, List[int]]) -> List[int]:
    """The experts of per-peer lists in wire order: peer ascending, then list order."""
    return [e for peer in sorted(lists) for e in lists[peer]]
