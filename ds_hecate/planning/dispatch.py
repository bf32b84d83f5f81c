"""Topology-aware token dispatch: where each source rank's token-expert pairs are processed.

Rules (paper §4.4): a pair stays on its rank when the expert is materialized there; otherwise it goes to a rank
of the same node holding the expert; it crosses nodes only when no rank of its node has it. Among eligible
replicas the pairs are spread evenly, the remainder rotated by source rank so sources do not all pile their
extra token onto the same replica.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from .plan import IntMatrix, Routes, holders_matrix


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


def topology_aware_routes(counts: IntMatrix, materialized: Sequence[Sequence[int]],
                          ranks_per_node: int) -> Routes:
    """Routes for every (src, expert) given the per-rank counts and the materialized placement."""
    world = len(counts)
    num_experts = len(counts[0]) if world else 0
    holders = expert_holders(materialized, num_experts)
    routes = []
    for src in range(world):
        per_expert: List[Tuple[Tuple[int, int], ...]] = []
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


# -- the same rule, fractional and vectorised (estimates: the scheduler, the simulator) ----------------------------
def rank_loads(counts: Sequence[Sequence[float]], materialized: Sequence[Sequence[int]], ranks_per_node: int):
    """Fractional version of the topology-aware dispatch.

    Returns (pairs processed per rank and expert ``[world][experts]``, rows sent per rank, rows received per rank).
    Computed by :func:`dispatch_flows` (numpy, all experts at once); the rule is
    :func:`~ds_hecate.planning.dispatch.eligible_ranks`.
    """
    world = len(counts)
    num_experts = len(counts[0]) if world else 0
    if not world or not num_experts:
        return [[0.0] * num_experts for _ in range(world)], [0.0] * world, [0.0] * world
    holders = holders_matrix(materialized, world, num_experts).T
    if (~holders.any(axis=1) & (np.asarray(counts, dtype=np.float64).sum(axis=0) != 0)).any():
        # an expert with pairs but no holder: the pure-Python rule cannot route it either
        raise ValueError("rank_loads: an expert with token-expert pairs is materialized nowhere")
    flows = dispatch_flows(np.asarray(counts, dtype=np.float64).T, holders, ranks_per_node)
    return flows.processed.T.tolist(), flows.sent.sum(axis=0).tolist(), flows.received.sum(axis=0).tolist()


@dataclass(frozen=True)
class DispatchFlows:
    """Fractional topology-aware dispatch as arrays (numpy), per expert column: what :func:`rank_loads` computes,
    plus the part of the traffic that crosses nodes (for the simulator's link model).

    Arrays are ``[K, world]`` for K candidate holder sets of one expert, or ``[experts, world]`` when evaluated for
    all experts of a placement at once.
    """

    processed: "np.ndarray"
    sent: "np.ndarray"
    received: "np.ndarray"
    sent_inter: "np.ndarray"
    received_inter: "np.ndarray"


def dispatch_flows(pairs, holders, ranks_per_node: int) -> DispatchFlows:
    """Vectorised :func:`rank_loads` (the same rule: :func:`~ds_hecate.planning.dispatch.eligible_ranks`).

    ``pairs``: ``[K, world]`` (or ``[world]``, broadcast) token-expert pairs each source rank has for the expert;
    ``holders``: ``[K, world]`` bool, ranks that materialize it. A source holding the expert keeps its pairs;
    otherwise they split evenly over the holders on its node, or over all holders when its node has none.
    """
    holders = np.asarray(holders, dtype=bool)
    k, world = holders.shape
    n = np.broadcast_to(np.asarray(pairs, dtype=np.float64), (k, world))
    starts = np.arange(0, world, ranks_per_node)
    node_idx = np.arange(world) // ranks_per_node
    hf = holders.astype(np.float64)
    node_cnt = np.add.reduceat(hf, starts, axis=1)
    node_has = (node_cnt > 0)[:, node_idx]
    positive = n > 0
    outsider = positive & ~holders
    same = outsider & node_has
    remote = outsider & ~node_has
    node_mass = np.add.reduceat(np.where(same, n, 0.0), starts, axis=1)
    remote_mass = np.where(remote, n, 0.0).sum(axis=1)
    total_holders = np.maximum(hf.sum(axis=1), 1.0)
    from_node = (node_mass / np.maximum(node_cnt, 1.0))[:, node_idx]
    from_remote = (remote_mass / total_holders)[:, None]
    received = hf * (from_node + from_remote)
    processed = np.where(holders, n, 0.0) + received
    sent = np.where(outsider, n, 0.0)
    return DispatchFlows(processed, sent, received, np.where(remote, n, 0.0), hf * from_remote)
