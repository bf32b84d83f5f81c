"""Heterogeneous sharding (the paper's Algorithm 2): who owns which expert, all MoE layers together.

All layers share one memory space: every rank owns the same number of experts in total (to within one when the
total does not divide), while a rank may own 0..E experts of any one layer. Per layer, the experts that will not
be materialized anyway (not among the top-t by load) are spread first so their owners' loads balance, least-loaded
node first, then least-loaded rank on it; the top-t ("overlappable") experts fill the remaining slots, since
sparse materialization replicates them regardless of who owns them. Layers with the hottest such experts are placed
first. Ties break on (load, free slots, id), so every rank computes the same sharding.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

from .dispatch import node_of


def slots_per_rank(total_experts: int, world_size: int) -> List[int]:
    base, extra = divmod(total_experts, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def heterogeneous_sharding(layer_loads: Sequence[Sequence[float]], world_size: int, ranks_per_node: int,
                           overlap_degree: Union[int, Sequence[int]]) -> List[Tuple[int, ...]]:
    """Owners per layer (``owners[layer][expert] = rank``) from predicted per-expert loads of every layer.

    ``overlap_degree`` is t, one value for all layers or one per layer.
    """
    degrees = ([overlap_degree] * len(layer_loads) if isinstance(overlap_degree, int) else list(overlap_degree))
    if len(degrees) != len(layer_loads):
        raise ValueError(f"overlap_degree: {len(degrees)} values for {len(layer_loads)} layers")
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide world_size={world_size}")
    total = sum(len(loads) for loads in layer_loads)
    free = slots_per_rank(total, world_size)
    num_nodes = world_size // ranks_per_node
    owners: List[List[int]] = [[-1] * len(loads) for loads in layer_loads]

    def top_t(loads: Sequence[float], t: int) -> List[int]:
        t = max(0, min(t, len(loads)))
        return sorted(range(len(loads)), key=lambda e: (-loads[e], e))[:t]

    overlappable = [set(top_t(loads, t)) for loads, t in zip(layer_loads, degrees)]
    underloaded = [[e for e in range(len(loads)) if e not in overlappable[i]] for i, loads in enumerate(layer_loads)]
    order = sorted(range(len(layer_loads)),
                   key=lambda i: (-max((layer_loads[i][e] for e in underloaded[i]), default=0.0), i))
    for i in order:
        loads = layer_loads[i]
        rank_load = [0.0] * world_size
        for e in sorted(underloaded[i], key=lambda e: (-loads[e], e)):
            node_load = [0.0] * num_nodes
            node_free = [0] * num_nodes
            for r in range(world_size):
                node_load[node_of(r, ranks_per_node)] += rank_load[r]
                node_free[node_of(r, ranks_per_node)] += free[r]
            node = min((n for n in range(num_nodes) if node_free[n] > 0),
                       key=lambda n: (node_load[n], -node_free[n], n))
            ranks = [r for r in range(node * ranks_per_node, (node + 1) * ranks_per_node) if free[r] > 0]
            rank = min(ranks, key=lambda r: (rank_load[r], -free[r], r))
            owners[i][e] = rank
            rank_load[rank] += loads[e]
            free[rank] -= 1
    for i in range(len(layer_loads)):
        for e in sorted(overlappable[i]):
            rank = max(range(world_size), key=lambda r: (free[r], -r))
            owners[i][e] = rank
            free[rank] -= 1
    assert all(f == 0 for f in free) and all(o >= 0 for layer in owners for o in layer)
    return [tuple(layer) for layer in owners]
