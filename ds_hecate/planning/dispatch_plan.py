"""The topology-aware dispatch of one layer call, vectorised: what one rank sends and receives.

Same rule as :func:`~ds_hecate.planning.dispatch.topology_aware_routes` (paper §4.4): a source keeps its pairs for
an expert it holds; otherwise they split evenly over the holders on its node, else over all holders, the
remainder rotated by the source rank. Why a second statement of it: the explicit routes are a
ranks x experts x holders table of Python tuples, and the plan built on them a ranks x ranks x experts token
matrix; at 64 ranks x 256 experts that cost ~70 ms per layer call and at 1,024 ranks half a minute, on the critical
path. Here each rank computes only its own row and column:

- the amount source ``s`` sends to destination ``d`` for expert ``e`` is a closed form of
  (``counts[s, e]``, the number of eligible holders ``m``, and ``d``'s index among them), so
- per placement (known before the gate, off the critical path) :class:`HolderTables` and :class:`RankTables`
  precompute eligibility, ``m`` and the rotated index; per call only ``divmod`` and a compare run:
  O(experts + ranks x experts held by the rank) for the rank's sends and receives, and no rank ever builds the
  full token matrix.

Everything here is numpy and pure; :func:`~ds_hecate.planning.dispatch.topology_aware_routes` stays as the
readable reference and the tests compare both on random placements.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Tuple

import numpy as np

from .plan import IntMatrix, LayerPlan, Placement


class HolderTables:
    """Per-placement tables of the dispatch rule, shared by every rank's :class:`RankTables`.

    ``index_all[d, e]``: holders of e with a lower rank than d (d's position among all holders);
    ``index_node[d, e]``: the same among the holders on d's node; ``node_count[g, e]``: holders of e on node g.
    """

    def __init__(self, holders: np.ndarray, ranks_per_node: int) -> None:
        world, num_experts = holders.shape
        self.holders = holders
        self.world, self.num_experts, self.ranks_per_node = world, num_experts, ranks_per_node
        self.node = np.arange(world) // ranks_per_node
        starts = np.arange(0, world, ranks_per_node)
        h = holders.astype(np.int64)
        below = np.cumsum(h, axis=0) - h
        self.total = h.sum(axis=0)
        self.node_count = np.add.reduceat(h, starts, axis=0) if world else np.zeros((0, num_experts), np.int64)
        self.index_all = below
        self.index_node = below - below[starts][self.node]
        #: per source rank and expert: 0 keeps (holds it), 1 node-local holders, 2 holders anywhere
        node_has = self.node_count[self.node] > 0
        self.case = np.where(holders, 0, np.where(node_has, 1, 2)).astype(np.int8)
        #: holders a source's pairs split over (1 when it keeps them)
        self.ways = np.where(holders, 1, np.where(node_has, self.node_count[self.node], np.maximum(self.total, 1)))
        #: ``[nodes, experts]`` 1 where the node holds no replica: its sources' pairs leave it (node traffic per call
        #: is then one reduction over the node sums, not a masked sum over ranks x experts)
        self.node_lacks = (self.node_count == 0).astype(np.int64)
        self.starts = starts

    def rank_tables(self, rank: int) -> "RankTables":
        return RankTables(self, rank)


class RankTables:
    """What rank ``rank`` sends and receives under one placement, up to the per-call counts.

    Send side, in route order (expert, then destination ascending): ``send_expert``, ``send_dst``. Receive side:
    ``[sources, K]`` cells over the K experts the rank holds (``mine``, ascending). Per entry the rule is a closed
    form of the count, the number of eligible holders and the destination's rotated position among them; all of it
    but the count is precomputed here, with the placement (off the critical path).
    """

    def __init__(self, tables: HolderTables, rank: int) -> None:
        t = tables
        self.rank, self.world = rank, t.world
        ranks = np.arange(t.world)
        # --- sends: for each expert, the eligible destinations of this source
        case, ways = t.case[rank], t.ways[rank]
        same_node = (t.node == t.node[rank])[:, None]
        eligible = np.where(case == 0, (ranks == rank)[:, None],
                            np.where(case == 1, t.holders & same_node, t.holders))
        index = np.where(case == 1, t.index_node, t.index_all)
        dst, expert = np.nonzero(eligible.T)[::-1]          # expert-major, destinations ascending
        self.send_expert, self.send_dst = expert, dst
        send_ways = ways[expert]
        send_pos = (index[dst, expert] - rank % send_ways) % send_ways
        # --- receives: from every source, for the experts this rank holds
        held = np.flatnonzero(t.holders[rank])
        self.mine = tuple(int(e) for e in held)
        #: the columns of ``mine`` in a count row: the whole row when the rank holds every expert (a rank alone)
        self.mine_columns = slice(None) if held.size == t.num_experts else held
        src_case, src_ways = t.case[:, held], t.ways[:, held]
        my_index = np.where(src_case == 1, t.index_node[rank, held][None, :], t.index_all[rank, held][None, :])
        recv_eligible = (((src_case == 0) & (ranks == rank)[:, None])
                         | ((src_case == 1) & same_node) | (src_case == 2))
        recv_pos = (my_index - ranks[:, None] % src_ways) % src_ways
        # One gather, one divmod and one compare per call for both sides: the send entries, then the [sources, K]
        # receive cells (source-major). Ineligible receive cells divide by a number no count reaches (base 0,
        # remainder = count) at a position no remainder exceeds.
        never = np.iinfo(np.int64).max
        self._n_send, self._k = expert.size, held.size
        self._rows = np.concatenate([np.full(expert.size, rank), np.repeat(ranks, held.size)])
        self._cols = np.concatenate([expert, np.tile(held, t.world)])
        self._div = np.concatenate([send_ways, np.where(recv_eligible, src_ways, never).reshape(-1)])
        self._pos = np.concatenate([send_pos, np.where(recv_eligible, recv_pos, never).reshape(-1)])

    def amounts(self, counts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(pairs sent per entry of the send table, in route order; ``[sources, K]`` pairs received from each
        source for each expert in :attr:`mine`): the rule's closed form, ``base + (position < remainder)``."""
        base, rem = np.divmod(counts[self._rows, self._cols], self._div)
        base += self._pos < rem
        return base[:self._n_send], base[self._n_send:].reshape(self.world, self._k)


@dataclass(frozen=True)
class RankDispatch:
    """One rank's part of a layer call, handed from planning to the token exchange and the expert compute.

    ``send_dst``/``send_rows``: the rank's routes in expert-major order (destination per segment, pairs per
    segment), so the sender expands them to its token order; ``send_splits``/``recv_splits`` per peer;
    ``order_starts``/``order_lengths``: the received buffer (source-major, then expert) as segments in
    expert-major order; ``sizes``: rows per expert of ``mine``.
    """

    rank: int
    mine: Tuple[int, ...]
    send_dst: np.ndarray
    send_rows: np.ndarray
    send_splits: List[int]
    recv_splits: List[int]
    order_starts: np.ndarray
    order_lengths: np.ndarray
    sizes: List[int]

    @property
    def tokens_processed(self) -> int:
        return int(sum(self.recv_splits))


def rank_dispatch(tables: RankTables, counts: np.ndarray) -> RankDispatch:
    """The per-call work of one rank: O(experts + sources x experts it holds), vectorised."""
    world = tables.world
    if world == 1:   # the rank alone: it keeps every pair of the experts it holds (all of them), in expert order
        kept = counts[0, tables.mine_columns]
        total = int(kept.sum())
        starts = kept.cumsum()
        starts -= kept
        return RankDispatch(rank=tables.rank, mine=tables.mine, send_dst=tables.send_dst, send_rows=kept,
                            send_splits=[total], recv_splits=[total], order_starts=starts, order_lengths=kept,
                            sizes=kept.tolist())
    sent, received = tables.amounts(counts)                 # received: [sources, K]
    send_splits = np.bincount(tables.send_dst, weights=sent, minlength=world).astype(np.int64)
    by_expert = received.T                                  # the expert-major order of the segments
    starts = received.cumsum().reshape(received.shape).T - by_expert
    return RankDispatch(rank=tables.rank, mine=tables.mine, send_dst=tables.send_dst,
                        send_rows=sent, send_splits=send_splits.tolist(),
                        recv_splits=received.sum(axis=1).tolist(), order_starts=starts.reshape(-1),
                        order_lengths=by_expert.reshape(-1), sizes=by_expert.sum(axis=1).tolist())


def _ring_hits(ring_of: np.ndarray, start: np.ndarray, length: np.ndarray, ring_offset: np.ndarray,
               ring_size: np.ndarray, positions: int) -> np.ndarray:
    """Per ring position, how many entries cover it; entry i covers ``length[i]`` positions of ring
    ``ring_of[i]`` from ``start[i]`` on, wrapping around (``length < size``). One difference array for all rings."""
    off, size = ring_offset[ring_of], ring_size[ring_of]
    end = start + length
    wraps = end > size
    idx = np.concatenate([off + start, off + np.minimum(end, size), off[wraps], off[wraps] + end[wraps] - size[wraps]])
    val = np.concatenate([np.ones_like(start), -np.ones_like(start), np.ones(wraps.sum(), np.int64),
                          -np.ones(wraps.sum(), np.int64)])
    return np.cumsum(np.bincount(idx, weights=val, minlength=positions + 1))[:positions]


def all_rank_loads(tables: HolderTables, counts: np.ndarray) -> np.ndarray:
    """Token-expert pairs each rank computes under the rule, all ranks at once in O(ranks x experts)."""
    t = tables
    counts = np.asarray(counts, dtype=np.int64)
    loads = np.bincount(np.nonzero(t.holders)[0], weights=counts[t.holders], minlength=t.world)
    base, rem = np.divmod(counts, t.ways)
    h_rank, h_exp = np.nonzero(t.holders)
    for case, size, ring_of_src, pos_of_holder, ring_of_holder in (
            (1, t.node_count.reshape(-1), t.node[:, None] * t.num_experts + np.arange(t.num_experts)[None, :],
             t.index_node[h_rank, h_exp], t.node[h_rank] * t.num_experts + h_exp),
            (2, np.maximum(t.total, 0), np.broadcast_to(np.arange(t.num_experts), counts.shape),
             t.index_all[h_rank, h_exp], h_exp)):
        src = (t.case == case) & (counts > 0)
        if not src.any():
            continue
        rings = ring_of_src[src]
        offset = np.cumsum(size) - size
        ring_base = np.bincount(rings, weights=base[src], minlength=size.size)
        s_rank = np.nonzero(src)[0]
        ways = t.ways[src]
        hits = _ring_hits(rings, s_rank % ways, rem[src], offset, size, int(size.sum()))
        per_holder = ring_base[ring_of_holder] + hits[offset[ring_of_holder] + pos_of_holder]
        loads += np.bincount(h_rank, weights=per_holder, minlength=t.world)
    return np.rint(loads).astype(np.int64)


@dataclass(frozen=True, eq=False)
class DispatchPlan:
    """A layer call's plan with the topology-aware dispatch kept implicit: placement + counts + node size.

    The same read interface as :class:`~ds_hecate.planning.plan.LayerPlan` (splits, loads, node traffic, explicit
    ``routes`` for small worlds and tests), but a rank's sends and receives cost O(ranks x experts) at most.
    ``counts`` is the all-gathered ``[ranks, experts]`` int64 array.
    """

    placement: Placement
    counts: np.ndarray
    ranks_per_node: int
    tables: HolderTables = field(repr=False)
    _rank_cache: Dict[int, RankDispatch] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, counts: IntMatrix, placement: Placement, ranks_per_node: int,
              counted: bool = False) -> "DispatchPlan":
        """``counted``: ``counts`` are a count exchange's (non-negative by construction: not scanned again)."""
        counts = np.asarray(counts, dtype=np.int64)
        tables = placement_tables(placement, ranks_per_node)
        if counts.shape != tables.holders.shape:
            raise ValueError(f"plan: counts must be [{tables.world}][{tables.num_experts}], got {counts.shape}")
        if not counted and counts.size and counts.min() < 0:
            raise ValueError("plan: token-expert pair counts must be >= 0")
        return cls(placement, counts, ranks_per_node, tables)

    # -- the LayerPlan face ------------------------------------------------------------------------------------
    world_size = property(lambda self: self.placement.world_size)
    num_experts = property(lambda self: len(self.placement.owners))
    owners = property(lambda self: self.placement.owners)
    materialized = property(lambda self: self.placement.materialized)
    gather_pairs = property(lambda self: self.placement.gather_pairs)
    num_moved = property(lambda self: self.placement.num_moved)

    def gather_sends(self, rank: int) -> Dict[int, List[int]]:
        return self.placement.gather_sends(rank)

    def gather_recvs(self, rank: int) -> Dict[int, List[int]]:
        return self.placement.gather_recvs(rank)

    def for_rank(self, rank: int) -> RankDispatch:
        """``rank``'s sends, receives and expert-major order (the runtime asks only for its own rank)."""
        if rank not in self._rank_cache:
            self._rank_cache[rank] = rank_dispatch(rank_tables(self.placement, self.ranks_per_node, rank),
                                                   self.counts)
        return self._rank_cache[rank]

    def send_splits(self, rank: int) -> List[int]:
        return self.for_rank(rank).send_splits

    def recv_splits(self, rank: int) -> List[int]:
        return self.for_rank(rank).recv_splits

    def tokens_processed(self, rank: int) -> int:
        return self.for_rank(rank).tokens_processed

    def expert_load_on(self, rank: int) -> List[int]:
        out = [0] * self.num_experts
        d = self.for_rank(rank)
        for e, n in zip(d.mine, d.sizes):
            out[e] = int(n)
        return out

    def loads(self) -> List[int]:
        return all_rank_loads(self.tables, self.counts).tolist()

    def node_traffic(self, ranks_per_node: int) -> Tuple[int, int]:
        """(token rows crossing nodes, of which avoidable). Under the rule only pairs whose node holds no replica
        leave their node, so none is avoidable; ``ranks_per_node`` must be the plan's own."""
        if ranks_per_node != self.ranks_per_node:
            return self.explicit.node_traffic(ranks_per_node)
        t = self.tables
        if t.world % ranks_per_node == 0:
            node_sums = self.counts.reshape(-1, ranks_per_node, t.num_experts).sum(axis=1)
        else:
            node_sums = np.add.reduceat(self.counts, t.starts, axis=0)
        return int(np.vdot(node_sums, t.node_lacks)), 0

    @cached_property
    def explicit(self) -> LayerPlan:
        """The same plan with explicit routes (O(ranks^2 x experts): small worlds, reports and tests only)."""
        from .dispatch import topology_aware_routes
        routes = topology_aware_routes(self.counts.tolist(), self.materialized, self.ranks_per_node)
        return LayerPlan(world_size=self.world_size, num_experts=self.num_experts, owners=self.owners,
                         materialized=self.materialized, routes=routes)

    @property
    def routes(self):
        return self.explicit.routes

    @property
    def token_matrix(self):
        return self.explicit.token_matrix

    def __repr__(self) -> str:
        return (f"DispatchPlan(owners={self.owners}, materialized={self.materialized}, "
                f"counts={self.counts.tolist()}, ranks_per_node={self.ranks_per_node})")


# Placement-level tables live as long as the placement (a prefetched placement is planned before the gate and
# reused while the schedule holds), keyed by identity of the frozen Placement and the node size.
def placement_tables(placement: Placement, ranks_per_node: int) -> HolderTables:
    """The placement's :class:`HolderTables`, built (and the placement checked) once per placement."""
    cache = placement.__dict__.setdefault("_dispatch_tables", {})
    if ranks_per_node not in cache:
        holders = placement.holders
        owners = np.asarray(placement.owners, dtype=np.int64)
        if owners.size and (owners.min() < 0 or owners.max() >= holders.shape[0]):
            raise ValueError(f"plan: owners must give a rank in [0, {holders.shape[0]}) for each of "
                             f"{owners.size} experts: {placement.owners}")
        missing = np.flatnonzero(~holders[owners, np.arange(owners.size)])
        if missing.size:
            e = int(missing[0])
            raise ValueError(f"plan: owner {placement.owners[e]} of expert {e} must materialize it (P ⊆ P')")
        cache[ranks_per_node] = HolderTables(holders, ranks_per_node)
    return cache[ranks_per_node]


def rank_tables(placement: Placement, ranks_per_node: int, rank: int) -> RankTables:
    cache = placement.__dict__.setdefault("_rank_tables", {})
    key = (ranks_per_node, rank)
    if key not in cache:
        cache[key] = placement_tables(placement, ranks_per_node).rank_tables(rank)
    return cache[key]
