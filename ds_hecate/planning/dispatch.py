"""Topology-aware token dispatch: where each source rank's token-expert pairs are processed.

Rules (paper §4.4): a pair stays on its rank when the expert is materialized there; otherwise it goes to a rank
of the same node holding the expert; it crosses nodes only when no rank of its node has it. Among eligible
replicas the pairs are spread evenly, the remainder rotated by source rank so sources do not all pile their
extra token onto the same replica.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from .plan import Routes


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def split_evenly(num_tokens: int, candidates: Sequence[int], src: int) -> Tuple[Tuple[int, int], ...]:
    """Split ``num_tokens`` over sorted ``candidates`` as evenly as possible; deterministic in (src, candidates)."""
    m = len(candidates)
    base, rem = divmod(num_tokens, m)
    start = src % m
    rotated = list(candidates[start:]) + list(candidates[:start])
    routes = []
    for i, dst in enumerate(rotated):
        cnt = base + (1 if i < rem else 0)
        if cnt:
            routes.append((dst, cnt))
    return tuple(sorted(routes))


def topology_aware_routes(counts: Sequence[Sequence[int]], materialized: Sequence[Sequence[int]],
                          ranks_per_node: int) -> Routes:
    """Routes for every (src, expert) given the per-rank counts and the materialized placement."""
    world = len(counts)
    num_experts = len(counts[0]) if world else 0
    holders: List[List[int]] = [[] for _ in range(num_experts)]
    for rank, experts in enumerate(materialized):
        for e in experts:
            holders[e].append(rank)
    routes = []
    for src in range(world):
        per_expert = []
        src_node = node_of(src, ranks_per_node)
        for e in range(num_experts):
            n = int(counts[src][e])
            if n == 0:
                per_expert.append(())
                continue
            if not holders[e]:
                raise ValueError(f"dispatch: expert {e} is materialized nowhere")
            if src in holders[e]:
                per_expert.append(((src, n),))
                continue
            same_node = [r for r in holders[e] if node_of(r, ranks_per_node) == src_node]
            per_expert.append(split_evenly(n, same_node or holders[e], src))
        routes.append(tuple(per_expert))
    return tuple(routes)
