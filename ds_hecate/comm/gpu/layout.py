"""Buffer layouts of the CuPy backend's sparse collectives: who packs which chunk where, and which received chunks
the owner sums. Pure functions of the placement (identical on every rank), shared by the CuPy backend and the
CPU tests that check them, with the reference kernels, against the torch backend's results."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from ...planning import Placement


@dataclass(frozen=True)
class ExchangeLayout:
    """Chunk-level layout on one rank: send buffer = chunks of ``send_experts`` (grouped by destination rank in rank
    order, ``send_counts[d]`` chunks for rank d), receive buffer = chunks of ``recv_experts`` (grouped by source rank,
    ``recv_counts[s]`` from rank s)."""

    send_experts: List[int]
    send_counts: List[int]
    recv_experts: List[int]
    recv_counts: List[int]


def _layout(sends: Dict[int, List[int]], recvs: Dict[int, List[int]], world_size: int) -> ExchangeLayout:
    return ExchangeLayout(
        send_experts=[e for d in range(world_size) for e in sends.get(d, ())],
        send_counts=[len(sends.get(d, ())) for d in range(world_size)],
        recv_experts=[e for s in range(world_size) for e in recvs.get(s, ())],
        recv_counts=[len(recvs.get(s, ())) for s in range(world_size)])


def gather_layout(placement: Placement, rank: int) -> ExchangeLayout:
    """SparseAllGather: owners send each expert to the ranks of P' \\ P that lack it."""
    return _layout(placement.gather_sends(rank), placement.gather_recvs(rank), placement.world_size)


def reduce_layout(placement: Placement, rank: int) -> ExchangeLayout:
    """SparseReduceScatter: the same pairs in the opposite direction (replica -> owner)."""
    return _layout(placement.gather_recvs(rank), placement.gather_sends(rank), placement.world_size)


def owned_materialized(placement: Placement, rank: int) -> List[int]:
    """Experts ``rank`` owns (and therefore materializes), ascending: the outputs of its SparseReduceScatter."""
    return [e for e in placement.materialized[rank] if placement.owners[e] == rank]


def reduce_chunk_lists(placement: Placement, rank: int) -> List[List[int]]:
    """Per owned expert, the indices of its received gradient chunks in the receive buffer, by source rank: the
    order the owner adds them (after its own copy)."""
    own = owned_materialized(placement, rank)
    chunks: Dict[int, List[int]] = {e: [] for e in own}
    for index, e in enumerate(reduce_layout(placement, rank).recv_experts):
        chunks[e].append(index)
    return [chunks[e] for e in own]
