"""Load-aware sparse materialization (the paper's Algorithm 1, reworked as a cost-driven greedy search).

The paper replicates the top-t experts on all devices when memory allows, else gives replicas in proportion to
load. We optimise the quantity the paper only argues about: the estimated layer time

    max over ranks of (expert compute + token all-to-all + SparseAllGather not hidden by the preceding compute)

Starting from the sharded placement (plain expert parallelism), we repeatedly add the single replica
(expert, rank) that lowers this estimate the most, considering the experts the current bottleneck rank processes,
until no replica helps or every rank's memory budget is used. The overlap degree t enters through the hidden
communication window: a rank can receive or send ``t`` experts for free, beyond that transfers are exposed and a
replica must earn its cost. Compared with the paper this (1) never replicates an expert whose replica would not
shorten the step (e.g. hot but sourced on its owner's rank under local-first dispatch), (2) trades replicas
against the token traffic they save, and (3) respects a per-rank budget rather than one global slot count. Every
input is identical on all ranks and ties break on (expert id, rank), so all ranks compute the same placement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Set, Tuple

from .dispatch import eligible_ranks, expert_holders

Placement = Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per unit of work; profiled or configured, identical on every rank.

    compute_s_per_pair: one token through one expert, forward + backward.
    token_transfer_s: one token row leaving (or entering) a rank, all four all-to-all passes together.
    expert_transfer_s: one expert through SparseAllGather + SparseReduceScatter on one rank's link.
    overlap_s: communication time hidden behind the non-MoE compute before the layer (T_nonMoE).
    """

    compute_s_per_pair: float
    token_transfer_s: float
    expert_transfer_s: float
    overlap_s: float = 0.0

    @property
    def overlap_degree(self) -> int:
        """t in the paper: experts a rank can move while the preceding non-MoE compute runs."""
        if self.expert_transfer_s <= 0:
            return 1 << 30
        return int(self.overlap_s / self.expert_transfer_s)


@dataclass(frozen=True)
class LayerEstimate:
    time_s: float
    compute_pairs: Tuple[float, ...]   # token-expert pairs processed per rank
    rank_time_s: Tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """max/mean of per-rank expert compute (1.0 = perfectly balanced)."""
        loads = self.compute_pairs
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0


def rank_loads(counts: Sequence[Sequence[float]], materialized: Sequence[Sequence[int]], ranks_per_node: int):
    """Fractional version of the topology-aware dispatch.

    Returns (pairs processed per rank and expert ``[world][experts]``, rows sent per rank, rows received per rank).
    """
    world = len(counts)
    num_experts = len(counts[0]) if world else 0
    holders = expert_holders(materialized, num_experts)
    processed = [[0.0] * num_experts for _ in range(world)]
    sent = [0.0] * world
    received = [0.0] * world
    for src in range(world):
        row = counts[src]
        for e in range(num_experts):
            n = row[e]
            if not n:
                continue
            cands = eligible_ranks(src, holders[e], ranks_per_node)
            if cands == [src]:
                processed[src][e] += n
                continue
            share = n / len(cands)
            sent[src] += n
            for d in cands:
                processed[d][e] += share
                received[d] += share
    return processed, sent, received


def estimate_layer(counts: Sequence[Sequence[float]], owners: Sequence[int], materialized: Sequence[Sequence[int]],
                   costs: StepCostModel, ranks_per_node: int,
                   prefetched: Optional[Sequence[Sequence[int]]] = None) -> LayerEstimate:
    """Estimated time of one layer under a placement.

    Replicas listed in ``prefetched`` were gathered ahead of time (hidden up to ``overlap_s``); others are gathered
    on the critical path (calibration), fully exposed.
    """
    world = len(counts)
    per_expert, sent, received = rank_loads(counts, materialized, ranks_per_node)
    processed = [sum(row) for row in per_expert]
    moved_in = [0] * world
    moved_out = [0] * world
    exposed_in = [0] * world
    exposed_out = [0] * world
    for r, experts in enumerate(materialized):
        early = set(prefetched[r]) if prefetched is not None else None
        for e in experts:
            o = owners[e]
            if o == r:
                continue
            if early is None or e in early:
                moved_in[r] += 1
                moved_out[o] += 1
            else:
                exposed_in[r] += 1
                exposed_out[o] += 1
    times = []
    for r in range(world):
        hidden_comm = max(moved_in[r], moved_out[r]) * costs.expert_transfer_s
        exposed = max(0.0, hidden_comm - costs.overlap_s)
        exposed += max(exposed_in[r], exposed_out[r]) * costs.expert_transfer_s
        tokens = max(sent[r], received[r]) * costs.token_transfer_s
        times.append(processed[r] * costs.compute_s_per_pair + tokens + exposed)
    return LayerEstimate(max(times), tuple(processed), tuple(times))


def _profile(est: LayerEstimate) -> Tuple[float, ...]:
    """Rank times sorted from slowest, rounded so that float noise never decides: the search compares these
    lexicographically, so a move that lowers one of several tied maxima counts as progress."""
    return tuple(float(f"{t:.12g}") for t in sorted(est.rank_time_s, reverse=True))


def schedule_materialization(counts: Sequence[Sequence[float]], owners: Sequence[int], costs: StepCostModel,
                             budget_per_rank: int, ranks_per_node: int,
                             start: Optional[Sequence[Sequence[int]]] = None,
                             prefetched: Optional[Sequence[Sequence[int]]] = None,
                             candidate_experts: int = 4, min_gain: float = 0.05) -> Placement:
    """Greedy replica placement minimising :func:`estimate_layer` under ``budget_per_rank`` extra experts/rank.

    Moves considered for the experts that load the bottleneck rank most: one new replica on one rank, a replica on
    every rank of one node that lacks the expert, and a replica on every rank that lacks it. Single replicas alone
    get stuck where local-first dispatch makes each new copy overload its own rank; the group moves are Algorithm
    1's "replicate on all devices" as one option among others. A move is taken when it lowers the sorted profile
    of rank times (see :func:`_profile`); ties break on (expert, ranks); the result is the earliest placement on
    that path with the lowest layer time, kept only if it beats the starting placement by ``min_gain`` (a
    fraction): predicted loads are noisy, and replicas that promise a few percent cost more than they return
    when the routing moves. ``start`` is a placement to extend (the prefetched one, for calibration); by default
    the sharded placement.
    """
    world = len(counts)
    num_experts = len(owners)
    mat: List[Set[int]] = [set() for _ in range(world)]
    for e, o in enumerate(owners):
        mat[o].add(e)
    if start is not None:
        for r, experts in enumerate(start):
            mat[r].update(experts)
    extra = [sum(1 for e in mat[r] if owners[e] != r) for r in range(world)]
    num_nodes = max(1, world // ranks_per_node)

    def frozen(m: List[Set[int]]) -> Placement:
        return tuple(tuple(sorted(s)) for s in m)

    best = estimate_layer(counts, owners, frozen(mat), costs, ranks_per_node, prefetched)
    # The search may pass through placements that only break a tie among the slowest ranks; what it returns is the
    # earliest placement with the lowest layer time, so no replica is kept that does not shorten the step.
    result = (best.time_s, frozen(mat))
    threshold = best.time_s * (1.0 - min_gain)
    while True:
        bottleneck = max(range(world), key=lambda r: (best.rank_time_s[r], -r))
        load_on_bottleneck = rank_loads(counts, frozen(mat), ranks_per_node)[0][bottleneck]
        hot = sorted((e for e in range(num_experts) if load_on_bottleneck[e] > 0),
                     key=lambda e: (-load_on_bottleneck[e], e))[:candidate_experts]
        moves = set()
        for e in hot:
            open_ranks = [d for d in range(world) if e not in mat[d] and extra[d] < budget_per_rank]
            moves.update((e, (d,)) for d in open_ranks)
            for n in range(num_nodes):
                in_node = tuple(d for d in open_ranks if d // ranks_per_node == n)
                if in_node:
                    moves.add((e, in_node))
            if open_ranks:
                moves.add((e, tuple(open_ranks)))
        choice: Optional[Tuple[Tuple[float, ...], int, Tuple[int, ...], LayerEstimate]] = None
        for e, ranks in sorted(moves):
            for d in ranks:
                mat[d].add(e)
            est = estimate_layer(counts, owners, frozen(mat), costs, ranks_per_node, prefetched)
            for d in ranks:
                mat[d].discard(e)
            key = (_profile(est), e, ranks)
            if choice is None or key < choice[:3]:
                choice = (key[0], e, ranks, est)
        if choice is None or not choice[0] < _profile(best):
            return result[1]
        _, e, ranks, best = choice
        for d in ranks:
            mat[d].add(e)
            extra[d] += 1
        if _profile(best)[0] < float(f"{result[0]:.12g}") and best.time_s <= threshold:
            result = (best.time_s, frozen(mat))
