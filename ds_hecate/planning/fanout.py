"""Tree fan-out of the sparse collectives: who forwards an expert to whom.

Flat, an expert's owner sends every copy itself in SparseAllGather and receives every replica's gradient itself in
SparseReduceScatter, so with many replicas its link serialises the layer's weight traffic (a one-step burst shadowed
on 31 ranks: 31 sends from one rank, 24 of them through its node's NICs). With more replicas than ``fanout``
(``hecate.fanout``), the copies relay through replica holders instead, in a tree that crosses nodes once per node:

- each node holding the expert has a leader: the owner on its own node, elsewhere its lowest-ranked holder;
- the leaders form an ``f``-ary tree rooted at the owner (nodes ascending): leader ``i`` (the owner is 0) hangs
  under leader ``(i - 1) // f``; ``f`` is ``fanout``, or, where the transport runs every level from the
  collective's start (stream-ordered: NCCL on CUDA), :func:`node_fanout` of the number of nodes holding the expert
  and the pipeline's chunks (a chain of nodes on a few nodes, a wider tree on many);
- inside each node the holders form a ``fanout``-ary tree under the leader (leader first, then ranks ascending).

So a rank sends at most ``fanout`` copies of an expert across nodes and ``fanout`` inside its node, whatever the
replica count. Why the tree of nodes picks its own fan-out: its copies cross the NICs, which a node's ranks share,
so a leader sending ``fanout`` copies holds its node's NICs ``fanout`` times as long as one; pipelined in chunks, a
deeper tree costs only one chunk's time per extra level (simulated a100-4x8 bert-moe W1, 32 replicas of each of two
hot experts on 4 nodes: with the whole tree pipelined from the prefetch, the exposed transfers fell from 13.6 to
0.4 ms per step with a chain of nodes instead of the owner sending to all three other nodes). Only there: where
the levels below the first run at the collective's wait (gloo), each extra level is exposed, and a deeper tree of
nodes made calibration's placements slower (planner_decisions, 256 x 256 burst: 0.92 s -> 1.51 s estimated).

SparseAllGather runs the tree top-down, one stage per depth; SparseReduceScatter runs it bottom-up, each relay
adding its children's fp32 partial sums to its own gradient in a fixed order (its own first, then the children's
by rank) before passing the sum to its parent. With at most ``fanout`` replicas (or ``fanout`` 0) the
tree is flat: the owner sends every copy, as before.

:class:`RelayPlan` is the explicit tree the runtime runs; :func:`tree_transfers` counts the same tree's transfers
per rank, vectorised, for the scheduler's cost and the simulator (tests/test_fanout.py holds them equal). Pure:
numpy only, identical on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Dict, List, Sequence, Tuple

import numpy as np

from .plan import Placement

#: (expert, sender, receiver) of one SparseAllGather copy
Edge = Tuple[int, int, int]


def node_fanout(nodes: int, fanout: int, chunks: int = 1) -> int:
    """The fan-out of the tree of nodes for an expert held on ``nodes`` nodes (the owner's included): the ``f`` in
    ``1..fanout`` that minimises ``f * (1 + (depth - 1) / chunks)``, ``depth`` the tree's (:func:`heap_depth` of its
    last leader): the busiest leader's NIC time, ``f`` copies of the row, plus the pipeline's fill, one chunk of
    ``f`` copies per level below the first. Ties go to the wider tree (fewer stages, fewer latencies). Pure
    arithmetic on what every rank holds alike, so every rank builds the same trees."""
    nodes = max(0, int(nodes))
    return int(_node_fanouts(max(1, int(fanout)), max(1, int(chunks)), nodes)[nodes])


@lru_cache(maxsize=64)
def _node_fanouts(fanout: int, chunks: int, upto: int) -> np.ndarray:
    """:func:`node_fanout` for 0..``upto`` nodes (index = nodes), as one array for the vectorised trees; grown in
    powers of two so that a cache entry serves every smaller count."""
    size = 1
    while size < upto + 1:
        size *= 2
    best = np.ones(size, dtype=np.int64)
    cost = np.full(size, np.inf)
    last = np.maximum(np.arange(size) - 1, 0)          # index of the last leader (the owner is 0)
    for f in range(1, fanout + 1):
        depth = heap_depth(last, f)
        here = f * (1.0 + np.maximum(depth - 1, 0) / chunks)
        better = here <= cost + 1e-12
        best = np.where(better, f, best)
        cost = np.where(better, here, cost)
    return best


def relay_parents(owner: int, holders: Sequence[int], ranks_per_node: int, fanout: int,
                  chunks: int = 1, stream_ordered: bool = False) -> Dict[int, int]:
    """replica holder -> the rank it receives the expert from (see the module docstring); ``holders`` may include
    the owner. ``chunks``: the relay's pipeline pieces (``hecate.relay_chunks``), which set the tree of nodes'
    fan-out (:func:`node_fanout`) where the transport is ``stream_ordered``."""
    replicas = sorted(r for r in set(holders) if r != owner)
    if fanout <= 0 or len(replicas) <= fanout:
        return {r: owner for r in replicas}
    by_node: Dict[int, List[int]] = {}
    for r in replicas:
        by_node.setdefault(r // ranks_per_node, []).append(r)
    home = owner // ranks_per_node
    by_node[home] = [owner] + by_node.get(home, [])
    parents: Dict[int, int] = {}
    leaders = [owner] + [by_node[n][0] for n in sorted(by_node) if n != home]
    across = node_fanout(len(leaders), fanout, chunks) if stream_ordered else max(1, fanout)
    for i in range(1, len(leaders)):
        parents[leaders[i]] = leaders[(i - 1) // across]
    for members in by_node.values():
        for j in range(1, len(members)):
            parents[members[j]] = members[(j - 1) // fanout]
    return parents


@dataclass(frozen=True)
class RelayPlan:
    """The SparseAllGather copies of one placement by stage: ``stages[s]`` holds the sorted (expert, sender,
    receiver) edges whose receiver is ``s + 1`` hops from the owner. Every rank computes the same plan, so every
    rank issues ``len(stages)`` exchanges in each sparse collective."""

    stages: Tuple[Tuple[Edge, ...], ...]
    #: pieces each expert row is cut into past the first stage, so the tree's levels pipeline (``hecate.relay_chunks``)
    chunks: int = 1

    @staticmethod
    def of(placement: Placement, ranks_per_node: int, fanout: int, chunks: int = 1,
           stream_ordered: bool = False) -> "RelayPlan":
        """``stream_ordered``: the transport runs every level from the collective's start (the tree of nodes then
        takes :func:`node_fanout`; else ``fanout``)."""
        return _relay_plan(placement, max(1, int(ranks_per_node)), int(fanout), max(1, int(chunks)),
                           bool(stream_ordered))

    def pipeline(self, chunks: int) -> List[List[Tuple[int, int]]]:
        """The exchanges after the first stage, each a list of (stage, chunk) pairs that travel together, stage
        ascending: exchange ``t`` carries chunk ``t - (s - 1)`` of every stage ``s >= 1`` that has it. A relay
        forwards chunk ``c`` of stage ``s + 1`` one exchange after receiving it at stage ``s``, so a tree of depth
        ``D`` takes ``D - 2 + chunks`` exchanges past the first instead of ``D - 1`` whole-row ones that each wait
        for the level above (``chunks`` 1: level by level). The first stage travels whole, with the collective's
        start (prefetched). ``chunks``: the pieces rows are really cut into (:func:`chunk_bounds`, at most
        :attr:`chunks`). Every rank computes the same list."""
        depth = len(self.stages)
        if depth <= 1:
            return []
        return [[(s, t - (s - 1)) for s in range(1, depth) if 0 <= t - (s - 1) < chunks]
                for t in range(depth - 2 + chunks)]

    @property
    def relayed(self) -> bool:
        """Whether any copy is forwarded by a replica holder (else the flat owner-sends-all exchange)."""
        return len(self.stages) > 1

    def sends(self, rank: int, stage: int) -> Dict[int, List[int]]:
        """receiver -> experts (ascending) ``rank`` sends at ``stage``."""
        return self._peers(rank, stage, mine=1, peer=2)

    def recvs(self, rank: int, stage: int) -> Dict[int, List[int]]:
        """sender -> experts (ascending) ``rank`` receives at ``stage``."""
        return self._peers(rank, stage, mine=2, peer=1)

    def _peers(self, rank: int, stage: int, mine: int, peer: int) -> Dict[int, List[int]]:
        """The edges of ``stage`` whose field ``mine`` (1: sender, 2: receiver) is ``rank``, as peer -> experts
        (a copy: callers may keep or change it)."""
        return {p: list(es) for p, es in self._index[(stage, mine)].get(rank, {}).items()}

    @cached_property
    def _index(self) -> Dict[Tuple[int, int], Dict[int, Dict[int, List[int]]]]:
        """(stage, 1 | 2) -> rank -> peer -> experts, built once per plan (plans are cached by placement), so a
        relayed collective's lookups cost the rank's own edges, not a scan of every edge of the stage (thousands
        at 1,024 ranks). Edges are sorted by expert, so each list is ascending."""
        index: Dict[Tuple[int, int], Dict[int, Dict[int, List[int]]]] = {}
        for stage, edges in enumerate(self.stages):
            sends = index.setdefault((stage, 1), {})
            recvs = index.setdefault((stage, 2), {})
            for e, src, dst in edges:
                sends.setdefault(src, {}).setdefault(dst, []).append(e)
                recvs.setdefault(dst, {}).setdefault(src, []).append(e)
        return index

    def received_order(self, rank: int) -> List[int]:
        """The experts ``rank`` receives, in the order its replica rows hold them: stage by stage, each stage
        sender-major (sender ascending, then expert). One stage: the flat order (owner ascending, then expert)."""
        return [e for s in range(len(self.stages)) for _, es in sorted(self.recvs(rank, s).items()) for e in es]

    def children(self, rank: int) -> Dict[int, List[int]]:
        """expert -> the ranks ``rank`` forwards it to (ascending), over all stages."""
        out: Dict[int, List[int]] = {}
        for stage in range(len(self.stages)):
            for dst, experts in self._index[(stage, 1)].get(rank, {}).items():
                for e in experts:
                    out.setdefault(e, []).append(dst)
        return {e: sorted(d) for e, d in sorted(out.items())}


def chunk_bounds(numel: int, chunks: int) -> List[Tuple[int, int]]:
    """``chunks`` consecutive [lo, hi) slices of a row of ``numel`` elements, equal but for the last (fewer when
    the row has fewer elements than chunks): how a pipelined relay cuts each expert row."""
    count = max(1, min(int(chunks), int(numel)))
    width = -(-int(numel) // count)
    return [(lo, min(lo + width, int(numel))) for lo in range(0, int(numel), width)]


@lru_cache(maxsize=256)
def _relay_plan(placement: Placement, ranks_per_node: int, fanout: int, chunks: int = 1,
                stream_ordered: bool = False) -> RelayPlan:
    holders: Dict[int, List[int]] = {}
    for e, dst in placement.gather_pairs:
        holders.setdefault(e, []).append(dst)
    depth_edges: Dict[int, List[Edge]] = {}
    for e, replicas in holders.items():
        owner = placement.owners[e]
        parents = relay_parents(owner, replicas, ranks_per_node, fanout, chunks, stream_ordered)
        depth = {owner: 0}
        for r in sorted(parents, key=lambda r: _hops(r, parents, owner)):
            depth[r] = depth[parents[r]] + 1
            depth_edges.setdefault(depth[r], []).append((e, parents[r], r))
    return RelayPlan(tuple(tuple(sorted(depth_edges[d])) for d in sorted(depth_edges)), chunks)


def _hops(rank: int, parents: Dict[int, int], owner: int) -> int:
    hops = 0
    while rank != owner:
        rank = parents[rank]
        hops += 1
    return hops


def tree_transfers(holders: np.ndarray, owners: np.ndarray, ranks_per_node: int, fanout: int, chunks: int = 1,
                   stream_ordered: bool = False):
    """Per rank, the copies of :func:`relay_parents`' trees it receives and sends, inside its node and across
    nodes: ``(in_intra, out_intra, in_inter, out_inter)``, each ``[K, world]`` float, for ``K`` experts with holder
    rows ``holders`` (``[K, world]`` bool, owners included or not) owned by ``owners`` (``[K]``): all levels
    together, as one pipelined flow would carry them (:func:`relay_transfers` splits them as the runtime runs
    them)."""
    return _trees(holders, owners, ranks_per_node, fanout, chunks, stream_ordered)[0]


def relay_transfers(holders: np.ndarray, owners: np.ndarray, ranks_per_node: int, fanout: int, chunks: int,
                    exposed_levels: bool = True, stream_ordered: bool = False):
    """:func:`tree_transfers` split as the runtime's relays run (:mod:`ds_hecate.comm.relay`): ``(first, later,
    depth)``, the first two ``[4, K, world]`` arrays (the four arrays there, stacked), ``depth`` each expert's tree
    depth (``[K]``; 0 without a replica, 1 flat). ``first``: the level the collective starts with, issued with it
    (so it can hide behind compute): the owner's copies and its children's receipts (every copy of an expert sent
    flat). ``later``: the levels below, run when the collective is waited for, pipelined in ``chunks`` pieces:
    ``D - 2 + chunks`` chunk exchanges for a tree of depth ``D``, so each expert's deeper copies are charged
    ``1 + (D - 2) / chunks`` times (the pipeline's fill). What the scheduler and the simulator charge a
    placement's SparseAllGather (and, reversed, its SparseReduceScatter). ``exposed_levels`` False: every level
    in ``first``, as one pipelined flow issued with the collective (the optimistic pricing the scheduler's second
    search uses, :func:`~.search.greedy.schedule_materialization`). ``stream_ordered``: the runtime issues every
    level with the collective (a CUDA transport, :meth:`~ds_hecate.comm.transport.Transport.relay_scope`), so the
    deeper levels, fill included, join the first and nothing is left for the wait."""
    total, first, depth = _trees(holders, owners, ranks_per_node, fanout, chunks, stream_ordered)
    nothing_later = np.broadcast_to(np.zeros((), dtype=total.dtype), total.shape)
    if not exposed_levels or not (depth >= 2).any():   # one level (or one flow): all of it is the first
        # nothing later: a read-only zero view (callers only add it), not a zero-filled copy of ``total``
        return total, nothing_later, depth
    fill = 1.0 + np.maximum(depth - 2, 0) / max(1, int(chunks))
    later = (total - first) * fill[None, :, None]
    if stream_ordered:
        return first + later, nothing_later, depth
    return first, later, depth


def heap_depth(index: np.ndarray, fanout: int) -> np.ndarray:
    """Depth of position ``index`` in a ``fanout``-ary tree laid out as a heap (the parent of ``i`` is
    ``(i - 1) // fanout``), as :func:`relay_parents` hangs the nodes' leaders and each node's holders."""
    index = np.asarray(index, dtype=np.int64)
    if fanout <= 1:
        return index.copy()
    # positions [0, reach_d] lie at depth <= d: reach_d = fanout + fanout^2 + ... + fanout^d
    top = int(index.max()) if index.size else 0
    reach = [0]
    while reach[-1] < top:
        reach.append(reach[-1] * fanout + fanout)
    return np.searchsorted(np.asarray(reach, dtype=np.int64), index, side="left")


def _trees(holders: np.ndarray, owners: np.ndarray, ranks_per_node: int, fanout: int, chunks: int = 1,
           stream_ordered: bool = False):
    """(all levels' transfers, the first level's, each expert's tree depth): see :func:`relay_transfers`."""
    holders = np.asarray(holders, dtype=bool)
    k, world = holders.shape
    owners = np.asarray(owners, dtype=np.int64)
    rows = np.arange(k)
    node = np.arange(world) // ranks_per_node
    own = np.zeros((k, world), dtype=bool)
    own[rows, owners] = True
    rep = holders & ~own
    held = rep | own
    same = node[None, :] == node[owners][:, None]
    flat = (rep.sum(axis=1) <= fanout) if fanout > 0 else np.ones(k, dtype=bool)
    depth = (rep.sum(axis=1) > 0).astype(np.int64)      # flat: one level, or none without a replica

    # all levels as one [4, K, world] array (in-intra, out-intra, in-inter, out-inter): what callers stack anyway
    total = np.zeros((4, k, world))
    in_intra, out_intra, in_inter, out_inter = total
    rep_same = rep & same
    rep_other = rep & ~same
    # flat: the owner sends every copy
    out_intra[rows, owners] = rep_same.sum(axis=1)
    out_inter[rows, owners] = rep_other.sum(axis=1)
    in_intra[...] = rep_same
    in_inter[...] = rep_other
    tree = np.flatnonzero(~flat) if fanout > 0 else np.zeros(0, dtype=np.int64)
    if not tree.size:   # every expert flat: the first level is all of it
        return total, total, depth
    # the relayed experts' rows only (usually few of a layer's)
    t_held, t_own, t_same, t_owners = held[tree], own[tree], same[tree], owners[tree]
    t_rows = np.arange(tree.size)
    starts = np.arange(0, world, ranks_per_node)
    counts = np.cumsum(t_held, axis=1)
    before = np.concatenate([np.zeros((tree.size, 1), dtype=counts.dtype), counts[:, starts[1:] - 1]], axis=1)
    index = counts - before[:, node] - 1            # position among its node's holders, ranks ascending
    # on the owner's node the owner comes first: holders ranked below it move one down
    index = np.where(t_same & t_held & (np.arange(world)[None, :] < t_owners[:, None]), index + 1, index)
    index[t_rows, t_owners] = 0
    per_node = np.add.reduceat(t_held.astype(np.int64), starts, axis=1)
    members = per_node[:, node]
    home = (np.arange(len(starts))[None, :] == node[t_owners][:, None])
    leader_nodes = (per_node > 0) & ~home
    position = np.cumsum(leader_nodes, axis=1)       # 1-based among the other nodes' leaders
    others = leader_nodes.sum(axis=1)
    leader = t_held & (index == 0)
    inter_index = np.where(t_own, 0, position[:, node])
    # the tree of nodes' fan-out per expert (stream-ordered: node_fanout of its holding nodes, the owner's included)
    if stream_ordered:
        across = _node_fanouts(max(1, int(fanout)), max(1, int(chunks)), int(others.max()) + 1)[others + 1][:, None]
    else:
        across = np.full((tree.size, 1), max(1, int(fanout)))
    out_intra[tree] = np.where(t_held, np.clip(members - 1 - index * fanout, 0, fanout), 0)
    in_intra[tree] = t_held & (index >= 1)
    out_inter[tree] = np.where(leader, np.clip(others[:, None] - inter_index * across, 0, across), 0)
    in_inter[tree] = leader & ~t_own
    # the first level: the owner's sends, and the receipts of its children (positions 1..fanout under it on its
    # node, leaders 1..fanout in the tree of nodes)
    first = np.zeros_like(total)
    first[0], first[2] = in_intra, in_inter
    first[0, tree] *= t_same & (index <= fanout)
    first[2, tree] *= inter_index <= across
    first[1, rows, owners] = out_intra[rows, owners]
    first[3, rows, owners] = out_inter[rows, owners]
    # depth: per holding node, its leader's depth in the tree of nodes plus its last holder's under the leader
    leader_depth = np.zeros_like(position)
    for f in np.unique(across):   # a handful of fan-outs: one heap walk each
        rows_f = across[:, 0] == f
        leader_depth[rows_f] = heap_depth(np.where(home[rows_f], 0, position[rows_f]), int(f))
    node_depth = leader_depth + heap_depth(np.maximum(per_node - 1, 0), fanout)
    depth[tree] = np.where(per_node > 0, node_depth, 0).max(axis=1)
    return total, first, depth

