"""The data the sparse collectives hand around: traffic counters, the gathered experts' buffer, a gather in flight,
an expert move's lists, and the helpers that order them. Shared by :mod:`.collectives` (the flat collectives and the
:class:`~.collectives.Communicator`) and :mod:`.relay` (the relayed ones); no collective here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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
    """This rank's materialized experts of one layer call, as the rows of one ``[n, numel]`` buffer in the compute
    dtype: its own experts first (rows ``[0, owned)``, in expert order), then the replicas in the order they
    arrive (owner rank ascending, then expert). The grouped expert compute reads the buffer as it is.

    ``block`` is the allocation the buffer is the first rows of; rows after them are reserved for calibration's
    extras (:meth:`extended`), which are received straight into them: extending a prefetched placement after the
    gate copies nothing, so the replicas never live twice (a copy would hold the prefetched rows and the extended
    buffer at once, up to twice the memory budget)."""

    experts: Tuple[int, ...]
    buffer: torch.Tensor
    owned: int
    block: Optional[torch.Tensor] = None

    def flats(self) -> Dict[int, torch.Tensor]:
        """expert -> its row (a view), for consolidation, export and tests."""
        return dict(zip(self.experts, self.buffer.unbind(0)))

    @property
    def spare_rows(self) -> int:
        """Rows reserved after the buffer's for calibration's extras."""
        return 0 if self.block is None else self.block.shape[0] - self.buffer.shape[0]

    @property
    def replica_bytes(self) -> int:
        """Bytes of the block's replica rows, the reserved ones included (they are allocated)."""
        rows = len(self.experts) - self.owned + self.spare_rows
        return rows * self.buffer.shape[1] * self.buffer.element_size()

    def spare(self, rows: int) -> torch.Tensor:
        """The first ``rows`` reserved rows, for the extras' SparseAllGather to receive into."""
        if rows > self.spare_rows:
            raise HecateError(f"calibration's extras need {rows} replica row(s) and {self.spare_rows} are reserved: "
                              "the calibrated placement exceeds the replica budget the prefetch reserved for it")
        start = self.buffer.shape[0]
        return self.block[start:start + rows]

    def extended(self, extra: "GatheredExperts") -> "GatheredExperts":
        """These rows followed by ``extra``'s replicas, received into this block's reserved rows (no copy)."""
        added = len(extra.experts) - extra.owned
        if added == 0:
            return self
        if extra.owned or extra.buffer.data_ptr() != self.spare(added).data_ptr():
            raise HecateError("calibration's extras were not received into the rows reserved for them")
        rows = len(self.experts) + added
        return GatheredExperts(self.experts + extra.experts, self.block[:rows], self.owned, self.block)


class PendingGather:
    """A SparseAllGather in flight; :meth:`wait` returns the :class:`GatheredExperts`."""

    def __init__(self, placement: Placement, finish: Callable[[], GatheredExperts]) -> None:
        self.placement = placement
        self._finish = finish
        self._result: Optional[GatheredExperts] = None

    def wait(self) -> GatheredExperts:
        if self._result is None:
            self._result = self._finish()
            self._finish = None  # type: ignore[assignment]
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
    its gradient accumulator."""
    return [e for e, owner in enumerate(placement.owners) if owner == rank]


def _source_major(lists: Dict[int, List[int]]) -> List[int]:
    """The experts of per-peer lists in wire order: peer ascending, then list order."""
    return [e for peer in sorted(lists) for e in lists[peer]]
