"""Materialized placement P' for one layer call, and the planner entry point that pairs it with dispatch.

Policies (config key ``hecate.placement``):

- ``owner``: each rank materializes only what it owns: plain expert parallelism, the baseline Hecate improves on.
- ``local``: each rank also materializes every expert its local tokens route to, so no token leaves its rank.
- ``cost``: each rank also materializes an expert its local tokens route to when the cost model says gathering
  the expert moves fewer bytes than moving those tokens away and back (the default of the engine issue; the
  load-aware scheduler plugs in here as another policy).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

from .cost import CommCostModel
from .dispatch import topology_aware_routes
from .plan import LayerPlan, check_routes_cover

Placement = Tuple[Tuple[int, ...], ...]
PlacementPolicy = Callable[[Sequence[Sequence[int]], Sequence[int], Optional[CommCostModel]], Placement]


def _owned(owners: Sequence[int], world: int):
    sets = [set() for _ in range(world)]
    for e, o in enumerate(owners):
        sets[o].add(e)
    return sets


def owner_placement(counts, owners, cost=None) -> Placement:
    return tuple(tuple(sorted(s)) for s in _owned(owners, len(counts)))


def local_placement(counts, owners, cost=None) -> Placement:
    sets = _owned(owners, len(counts))
    for r, row in enumerate(counts):
        sets[r].update(e for e, n in enumerate(row) if n > 0)
    return tuple(tuple(sorted(s)) for s in sets)


def cost_placement(counts, owners, cost: Optional[CommCostModel] = None) -> Placement:
    if cost is None:
        raise ValueError("placement 'cost' needs a CommCostModel")
    sets = _owned(owners, len(counts))
    for r, row in enumerate(counts):
        sets[r].update(e for e, n in enumerate(row) if n > 0 and cost.materialize_is_cheaper(n))
    return tuple(tuple(sorted(s)) for s in sets)


POLICIES: Dict[str, PlacementPolicy] = {
    "owner": owner_placement,
    "local": local_placement,
    "cost": cost_placement,
}


def plan_layer(counts: Sequence[Sequence[int]], owners: Sequence[int], policy: str,
               cost: Optional[CommCostModel] = None, ranks_per_node: Optional[int] = None) -> LayerPlan:
    """Compute the plan for one layer call from all ranks' per-expert token-expert pair counts.

    Deterministic in its inputs (no dict order, no floats in tie-breaks), so every rank gets the same plan.
    """
    world = len(counts)
    if world < 1 or any(len(row) != len(owners) for row in counts):
        raise ValueError(f"plan_layer: counts must be [world_size][num_experts={len(owners)}], got row lengths "
                         f"{[len(row) for row in counts]}")
    if any(not 0 <= o < world for o in owners):
        raise ValueError(f"plan_layer: owners must be ranks in [0, {world}), got {tuple(owners)}")
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; known: {sorted(POLICIES)}")
    materialized = POLICIES[policy](counts, owners, cost)
    routes = topology_aware_routes(counts, materialized, ranks_per_node or world)
    plan = LayerPlan(world_size=world, num_experts=len(owners), owners=tuple(owners),
                     materialized=materialized, routes=routes)
    check_routes_cover(plan, counts)
    return plan
