"""The stateless placement policies: materialized placement P' from one call's counts alone.

Policies (config key ``hecate.placement``; the default ``hecate``, which predicts and prefetches, is the stateful
one and lives in :mod:`.layer_planner`, which runs these too):

- ``owner``: each rank materializes only what it owns: plain expert parallelism, the baseline Hecate improves on.
- ``local``: each rank also materializes every expert its local tokens route to, so no token leaves its rank.
- ``cost``: each rank also materializes an expert its local tokens route to when the cost model says gathering
  the expert moves fewer bytes than moving those tokens away and back.
- ``shadow``: FasterMoE-style expert shadowing (PPoPP'22), a baseline: after the gate, the hottest experts are
  broadcast to every rank, as many as FasterMoE's greedy rule says shorten the layer (compute + token traffic +
  broadcasts on the critical path, estimated with the scheduler's cost model); everything else stays with its owner.
- ``all``: every rank materializes every expert (ZeRO-3 / FSDP style gather-all), a baseline: no token leaves its
  rank, every expert crosses the wire every iteration.

``shadow`` needs the scheduler's :class:`~ds_hecate.planning.search.greedy.StepCostModel` (compute speed as well as
bandwidth) rather than the byte-only :class:`CommCostModel`; callers look this up in :data:`STEP_COST_POLICIES`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from .cost_model import CommCostModel, StepCostModel, estimate_layer
from .dispatch import topology_aware_routes
from .plan import (IntMatrix, LayerPlan, Materialized, check_routes_cover, holders_matrix, materialized_of,
                   owned_experts)

#: (counts, owners, cost model) -> P'. Which cost model a policy needs depends on the policy (the byte-only
#: CommCostModel, or the StepCostModel for :data:`STEP_COST_POLICIES`); each checks what it got.
CostModel = Optional[Union[CommCostModel, StepCostModel]]
PlacementPolicy = Callable[[IntMatrix, Sequence[int], CostModel], Materialized]


def _owned(owners: Sequence[int], world: int):
    """The owner placement as mutable per-rank sets, for the policies that add replicas to it."""
    return [set(experts) for experts in owned_experts(owners, world)]


def owner_placement(counts, owners, cost=None) -> Materialized:
    return owned_experts(owners, len(counts))


def local_placement(counts, owners, cost=None) -> Materialized:
    sets = _owned(owners, len(counts))
    for r, row in enumerate(counts):
        sets[r].update(e for e, n in enumerate(row) if n > 0)
    return tuple(tuple(sorted(s)) for s in sets)


def cost_placement(counts, owners, cost: CostModel = None) -> Materialized:
    if not isinstance(cost, CommCostModel):
        raise ValueError("placement 'cost' needs a CommCostModel")
    sets = _owned(owners, len(counts))
    for r, row in enumerate(counts):
        sets[r].update(e for e, n in enumerate(row) if n > 0 and cost.materialize_is_cheaper(n))
    return tuple(tuple(sorted(s)) for s in sets)


def all_placement(counts, owners, cost=None) -> Materialized:
    """Every expert on every rank: the gather-all baseline (what ZeRO-3/FSDP does to an MoE layer)."""
    everything = tuple(range(len(owners)))
    return tuple(everything for _ in range(len(counts)))


def shadow_placement(counts, owners, cost: CostModel = None) -> Materialized:
    """FasterMoE's shadowing policy: shadow the top-n experts by load on every rank, owners keep the rest.

    FasterMoE grows n one expert at a time, hottest first, while its latency model falls, and stops at the first
    n that does not help. Its model (compute of the busiest worker, token traffic, and one broadcast per shadow on
    the critical path, since the decision is taken after the gate) is the scheduler's :func:`estimate_layer` with
    nothing prefetched, every transfer on the slowest link (:meth:`StepCostModel.single_link`: its model does
    not tell NVLink from the NICs) and each shadow a ring broadcast, so the baseline is judged with the same cost
    numbers as Hecate. Deterministic: ties in
    load break on the expert id.
    """
    if not isinstance(cost, StepCostModel):
        raise ValueError("placement 'shadow' needs a StepCostModel (compute and transfer seconds), got "
                         f"{type(cost).__name__}")
    world = len(counts)
    # FasterMoE's model: every transfer on one link (the slowest), each shadow a ring broadcast (every rank receives
    # it once and forwards it once: a chain, fan-out 1), as the simulator times it; NCCL pipelines a broadcast in
    # small chunks, so the chain is priced as one flow (not as Hecate's relays run)
    cost = replace(cost.single_link(), fanout=1, relay_levels_exposed=False)
    pairs = np.asarray(counts, dtype=np.float64).reshape(world, len(owners))
    nothing_prefetched = np.zeros(pairs.shape, dtype=bool)

    def estimate(holders: np.ndarray) -> float:
        return estimate_layer(pairs, owners, holders, cost, world, nothing_prefetched).time_s

    grown, _, _ = grow_hottest(pairs.sum(axis=0), holders_matrix(owned_experts(owners, world), *pairs.shape),
                               None, estimate)
    return materialized_of(grown)


def grow_hottest(loads: np.ndarray, holders: np.ndarray, room: Optional[np.ndarray],
                 estimate: Callable[[np.ndarray], float],
                 can_try: Callable[[], bool] = lambda: True) -> Tuple[np.ndarray, float, float]:
    """FasterMoE's growth, the one loop of the ``shadow`` baseline and of calibration's growth
    (:func:`~.critical_path.growth_calibration`): the experts by ``loads`` (``[experts]``), hottest first (ties on
    the expert id), each added on every rank that lacks it (and, with ``room``, ``[ranks]`` free slots, has one),
    while that lowers ``estimate`` (of a ``[ranks, experts]`` bool holders matrix); stops at the first expert that
    does not, at the first without load, or where ``can_try`` says no further estimate is affordable. Returns (the
    grown holders, their estimate, the estimate of ``holders``); ``holders`` itself is not modified."""
    start_s = best_s = estimate(holders)
    grown = holders
    for e in np.argsort(-np.asarray(loads), kind="stable").tolist():
        if loads[e] <= 0 or not can_try():
            break
        open_ranks = ~grown[:, e] if room is None else ~grown[:, e] & (room > 0)
        if not open_ranks.any():
            continue
        candidate = grown.copy()
        candidate[open_ranks, e] = True
        candidate_s = estimate(candidate)
        if not candidate_s < best_s:
            break
        grown, best_s = candidate, candidate_s
        if room is not None:
            room = room - open_ranks
    return grown, best_s, start_s


POLICIES: Dict[str, PlacementPolicy] = {
    "owner": owner_placement,
    "local": local_placement,
    "cost": cost_placement,
    "shadow": shadow_placement,
    "all": all_placement,
}

#: Policies that take the scheduler's StepCostModel instead of the byte-only CommCostModel.
STEP_COST_POLICIES = frozenset({"shadow"})

#: every value of ``hecate.placement``, defined here once (the config's schema reads it): the stateful default
#: ``hecate`` (predicts and prefetches, :mod:`.layer_planner`) and the stateless policies above
PLACEMENT_POLICIES = ("hecate",) + tuple(POLICIES)


def plan_layer(counts: IntMatrix, owners: Sequence[int], policy: str,
               cost: CostModel = None, ranks_per_node: Optional[int] = None) -> LayerPlan:
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
