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


def expert_holders(materialized: Sequence[Sequence[int]], num_experts: int) -> List[List[int]]:
    """holders[e]: ranks (ascending) where expert e is materialized."""
    holders: List[List[int]] = [[] for _ in range(num_experts)]
    for rank, experts in enumerate(materialized):
        for e in experts:
            holders[e].append(rank)
    return holders


def eligible_ranks(src: int, holders: Sequence[int], ranks_per_node: int) -> List[int]:
    """Where src's pairs for an expert go: itself if it holds the expert, else the holders on its node, else all
    holders. The single statement of the dispatch rule, shared by the runtime and the scheduler's estimate."""
    if src in holders:
        return [src]
    node = node_of(src, ranks_per_node)
    return [r for r in holders if node_of(r, ranks_per_node) == node] or list(holders)


def topology_aware_routes(counts: Sequence[Sequence[int]], materialized: Sequence[Sequence[int]],
                          ranks_per_node: int) -> Routes:
    """Routes for every (src, expert) given the per-rank counts and the materialized placement."""
    world = len(counts)
    num_experts = len(counts[0]) if world else 0
    holders = expert_holders(materialized, num_experts)
    routes = []
    for src in range(world):
        per_expert = []
        for e in range(num_experts):
            n = int(counts[src][e])
            if n == 0:
                per_expert.append(())
                continue
            if not holders[e]:
                raise ValueError(f"dispatch: expert {e} is materialized nowhere")
            per_expert.append(split_evenly(n, eligible_ranks(src, holders[e], ranks_per_node), src))
        routes.append(tuple(per_expert))
    return tuple(routes)
