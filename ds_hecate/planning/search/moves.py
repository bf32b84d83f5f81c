"""The moves the scheduler's greedy search weighs at each step (:func:`~.greedy.schedule_materialization`).

Each function proposes replicas from the search's state (its holders ``mat``, per-expert dispatch columns ``cols``
and ``proc``, ``owners``, ``costs``, ``world``, ``rpn``) and the current rank times; the search evaluates every proposal in
one batch and takes the one with the best profile. Kept apart from the search loop so that each move's reason
stands beside its code. Every input is identical on all ranks and ties break on ids, so all ranks propose alike.
"""
from __future__ import annotations

from typing import List, Optional, Set, Tuple

import numpy as np

from .state import SearchState


def round12(values):
    """Round to 12 significant digits (as ``float(f"{t:.12g}")``), elementwise on a numpy array."""
    values = np.asarray(values, dtype=np.float64)
    magnitude = np.abs(values)
    normal = np.isfinite(values) & (magnitude > 1e-280) & (magnitude < 1e280)
    if normal.all():   # the usual case (rank times): the same arithmetic without the masked copies
        scale = 10.0 ** (11 - np.floor(np.log10(magnitude)))
        return np.round(values * scale) / scale
    out = values.copy()
    if normal.any():
        v = values[normal]
        scale = 10.0 ** (11 - np.floor(np.log10(np.abs(v))))
        out[normal] = np.round(v * scale) / scale
    extreme = np.flatnonzero(~normal & (values != 0))
    if extreme.size:   # denormals, huge values, inf/nan: the exact string rounding, elementwise
        flat = out.reshape(-1)
        for i in extreme:
            flat[i] = float(f"{flat[i]:.12g}")
    return out


def candidate_moves(search: SearchState, best_times, extra, budget_per_rank: int, ranks_per_node: int,
                     candidate_experts: int, candidate_ranks: int):
    """Moves for the experts that load the bottleneck rank most: one replica on one open rank, one on every open
    rank of a node, one on every open rank, and (on more than one node) one on the least-loaded open rank of every
    node that lacks the expert. With more open ranks than ``candidate_ranks``, single replicas and node groups are
    tried only on the least-loaded open ranks (and their nodes): beyond a few dozen ranks the full set costs
    ranks^2 per step for moves that cannot beat the idlest ranks.

    Why one per node: with the NICs priced apart from NVLink, the replicas that keep an expert's tokens on their
    node cost one NIC transfer per node, while every open rank costs one per rank; a search with only the latter
    took it first for a hot expert owned by one rank and ran into its owner's NICs (simulated a100-4x8 gpt-moe-s
    W1: 62 replicas, 3.37x of EP, against 26 and 5.7x with this move).

    And, where the bottleneck is slow for the rows it sends rather than those it processes (ragged sources), a copy
    on the bottleneck itself of the experts it sends most rows to: the objective counts the token traffic such a
    replica keeps home, but no move above would try it."""
    bottleneck = int(np.argmax(best_times))   # first (lowest) rank among the slowest
    load_on_bottleneck = search.proc[:, bottleneck]
    loaded = np.flatnonzero(load_on_bottleneck > 0)
    hot = sorted(loaded.tolist(), key=lambda e: (-load_on_bottleneck[e], e))[:candidate_experts]
    moves: Set[Tuple[int, Tuple[int, ...]]] = set()
    several_nodes = search.world > ranks_per_node
    # every rank by (rounded time, rank id), once: an expert's open ranks in that order are a filter of it
    by_time_all = np.lexsort((np.arange(search.world), round12(best_times)))
    has_room = extra < budget_per_rank
    for e in hot:
        is_open = ~search.mat[:, e] & has_room
        open_ranks = np.flatnonzero(is_open)
        by_time = by_time_all[is_open[by_time_all]]
        if open_ranks.size > candidate_ranks:
            singles = np.sort(by_time[:candidate_ranks])
            nodes = set((singles // ranks_per_node).tolist())
        else:
            singles = open_ranks
            nodes = None
        open_list = open_ranks.tolist()
        moves.update((e, (d,)) for d in singles.tolist())
        # the open ranks of each node (ascending, so each node's ranks are one run of the list)
        node_of_open = (open_ranks // ranks_per_node).tolist()
        run_start = 0
        for i in range(1, len(open_list) + 1):
            if i == len(open_list) or node_of_open[i] != node_of_open[run_start]:
                if nodes is None or node_of_open[run_start] in nodes:
                    moves.add((e, tuple(open_list[run_start:i])))
                run_start = i
        if open_list:
            moves.add((e, tuple(open_list)))
        if several_nodes and by_time.size:
            node_of = by_time // ranks_per_node
            _, first = np.unique(node_of, return_index=True)       # least-loaded open rank of each node
            lacking = ~np.isin(node_of[first], np.flatnonzero(search.mat[:, e]) // ranks_per_node)
            picks = tuple(sorted(int(d) for d in by_time[first][lacking]))
            if picks:
                moves.add((e, picks))
    if extra[bottleneck] < budget_per_rank:
        # keep the bottleneck's tokens home: a copy, on the bottleneck, of the experts it sends most rows to
        sent = search.cols[1][:, bottleneck]
        away = np.flatnonzero((sent > 0) & ~search.mat[bottleneck])
        for e in sorted(away.tolist(), key=lambda e: (-sent[e], e))[:candidate_experts]:
            moves.add((e, (bottleneck,)))
    return sorted(moves)


def quota_move(search: SearchState, best_times, extra, budget_per_rank: int) -> Optional[List[Tuple[int, int]]]:
    """One move that relieves every bottleneck at once: when several ranks tie at the slowest time, each gets one
    replica of the expert that loads it most, on the least-loaded open rank of its own node, else of the others
    (distinct ranks; ties on rank id).

    Why: a move for one expert cannot lower a maximum that other ranks share, so a greedy step over single-expert
    moves either stops or takes the move that pushes its one bottleneck furthest down (a replica on every rank of
    a node), spending the slots the other bottlenecks needed, and at scale a step costs milliseconds, so the search
    budget runs out first. The slowest time is shared by many ranks there (a quarter of 256 experts hot: 64 tied
    owners); this is UltraEP's quota idea as one candidate beside the others, taken only when it gives the better
    profile. Own node first: a replica on the bottleneck's node takes its tokens over NVLink, one elsewhere over
    the NICs (before the objective priced the links apart, least-loaded anywhere measured 3.08x of EP against 3.90x
    node-first on simulated a100-4x8 gpt-moe-s W1). None when the slowest time is not shared or no rank is open."""
    rounded = round12(best_times)
    tied = np.flatnonzero(rounded == rounded.max())
    if tied.size < 2:
        return None
    room = extra < budget_per_rank
    room[tied] = False
    node = np.arange(search.world) // search.rpn
    pairs: List[Tuple[int, int]] = []
    for r in tied.tolist():
        load = search.proc[:, r]
        e = int(np.argmax(load))   # the first expert with the largest load on it
        if load[e] <= 0:
            continue
        order = np.lexsort((np.arange(search.world), rounded, node != node[r]))   # its node first, least loaded
        open_ranks = order[room[order] & ~search.mat[order, e]]
        if open_ranks.size == 0:
            continue
        d = int(open_ranks[0])
        pairs.append((e, d))
        room[d] = False
    return pairs if len(pairs) >= 2 else None


#: cyclic shifts the node-exchange move tries per step (node n copies from node n + s): every partner of a node in a
#: 4-node group, few enough that at 32 nodes a step's batch stays a few node-sets. Fewer lose on the 4-node grid
#: (simulated a100-4x8 gpt-moe-s W0: 212.5 ms a step with one shift, 201.8 with two, 196.9 with three)
NODE_EXCHANGE_SHIFTS = 3


def node_exchange_moves(search: SearchState, best_times, extra, budget_per_rank: int, copies: int = 1,
                         shifts: int = NODE_EXCHANGE_SHIFTS) -> List[List[Tuple[int, int]]]:
    """Moves that keep tokens on every node at once: for each cyclic shift ``s``, every node ``n`` takes ``copies``
    replicas of the expert owned on node ``(n + s) mod N`` that it sends the most rows across nodes to (lowest id on
    ties), on its least-loaded open ranks (ties on rank id, one replica per rank). Empty on one node, and where the
    cost model does not price the NICs apart (nothing for it to relieve).

    Why: a node's NIC time is the larger of what it sends and what it receives. A copy that keeps one node's rows
    home cuts that node's sends and its owner node's receives, so no NIC gets faster until every node is relieved
    in both directions, which a single replica never does, and the quota move only gives replicas to ranks off
    the tie. On balanced routing all ranks tie on the NICs: simulated a100-4x8 gpt-moe-s W0 kept the owners
    (13.94 ms a layer by the estimate); with cyclic exchanges the search reaches 12.4 ms, the replicas' weights
    crossing the NICs while the non-MoE compute runs. A cyclic shift is a permutation of the nodes, so every node
    sends and receives one fewer expert's rows. Two copies a node: the search tries them where one finds nothing,
    as where the compute is balanced already and one holder would take its whole node's pairs (simulated a100-4x8
    bert-moe W5: 19.4 ms a layer by the estimate with one, 18.1 with two)."""
    rpn, world, costs = search.rpn, search.world, search.costs
    nodes = -(-world // rpn)
    if nodes < 2 or costs.token_transfer_inter_s is None:
        return []
    node_of = np.arange(world) // rpn
    starts = np.arange(0, world, rpn)
    node_rows = np.add.reduceat(search.cols[3], starts, axis=1)                      # [experts, nodes] sent across
    held = np.add.reduceat(search.mat.T.astype(np.int64), starts, axis=1) > 0        # [experts, nodes]
    owner_node = np.asarray(search.owners) // rpn
    by_time = np.lexsort((np.arange(world), round12(best_times)))                  # least loaded first
    room = extra < budget_per_rank
    moves: List[List[Tuple[int, int]]] = []
    for shift in range(1, min(nodes - 1, shifts) + 1):
        pairs: List[Tuple[int, int]] = []
        taken = np.zeros(world, dtype=bool)
        for n in range(nodes):
            offered = np.flatnonzero((owner_node == (n + shift) % nodes) & ~held[:, n] & (node_rows[:, n] > 0))
            if offered.size == 0:
                continue
            e = int(offered[np.lexsort((offered, -node_rows[offered, n]))[0]])
            open_ranks = by_time[(node_of[by_time] == n) & room[by_time] & ~taken[by_time]]
            for d in open_ranks[:copies].tolist():
                pairs.append((e, d))
                taken[d] = True
        if len(pairs) >= 2:
            moves.append(pairs)
    return moves
