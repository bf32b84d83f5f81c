"""The force-balanced reference of UltraEP's metric: the same system with its routing forced uniform.

Why: "fraction of the ideal" compares a system with a different system (no communication, perfect balance), so it
mixes what balancing could recover with what no placement can (the all-to-all itself). The *force-balanced*
fraction keeps the system and its token volume and changes only where tokens go: step time with every source
rank's token-expert pairs spread uniformly over the experts, divided by the step time on the real routing. 1.0
means the routing's skew costs nothing; 0.5 means the skew doubles the step. It can exceed 1 where the real
routing is *cheaper* than uniform (e.g. tokens that mostly stay on their own rank).

One definition (:func:`force_uniform`) serves the simulator (``ds_hecate.sim``), the measured benchmark
(``python -m benchmarks.step``, which uses it to decide which run is a workload's forced-uniform counterpart)
and ``engine.hecate.stats()`` (:func:`estimated_force_balanced_fraction`, a cost-model estimate).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .cost_model import StepCostModel, estimate_layer
from .plan import IntMatrix, owned_experts


def force_uniform(counts: Any) -> np.ndarray:
    """``counts[rank][expert]`` (token-expert pairs) with each rank's pairs spread uniformly over the experts.

    Keeps every rank's total (same tokens per rank, same top-k), so only the choice of experts changes. Each row
    gets ``total // E`` per expert and its remainder as +1s on consecutive experts, each rank starting where the
    previous one's remainder stopped, so that both every rank's counts and the experts' totals differ by at most 1
    (integer rounding). A count never exceeds the rank's tokens (``ceil(tokens * k / E) <= tokens`` for
    ``k <= E``). Integer-valued input only; returns an int64 ``[world, experts]`` array.
    """
    arr = np.asarray(counts, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError(f"force_uniform: expected a [world, experts] matrix, got shape {arr.shape}")
    if (arr < 0).any() or not np.array_equal(arr, np.round(arr)):
        raise ValueError("force_uniform: counts must be non-negative integers (token-expert pairs)")
    world, num_experts = arr.shape
    totals = arr.sum(axis=1).astype(np.int64)
    base, rem = np.divmod(totals, num_experts)
    start = (np.cumsum(rem) - rem) % num_experts              # where this rank's +1s begin
    offset = (np.arange(num_experts)[None, :] - start[:, None]) % num_experts
    return base[:, None] + (offset < rem[:, None]).astype(np.int64)


def is_uniform(counts: Any) -> bool:
    """True when every rank spreads its pairs uniformly up to integer rounding (row max - min <= 1)."""
    arr = np.asarray(counts, dtype=np.float64)
    return bool(arr.size == 0 or (arr.max(axis=1) - arr.min(axis=1) <= 1).all())


def force_uniform_steps(counts: Sequence[Sequence[Any]]) -> List[List[np.ndarray]]:
    """:func:`force_uniform` of every ``counts[step][layer]`` matrix, as float64 arrays. A matrix object shared by
    several (step, layer) entries maps to one shared result, so the simulator's layer classes (layers whose counts
    are the same objects at every step) survive the forcing."""
    memo: Dict[int, np.ndarray] = {}
    out: List[List[np.ndarray]] = []
    for layers in counts:
        row = []
        for c in layers:
            if id(c) not in memo:
                memo[id(c)] = force_uniform(c).astype(np.float64)
            row.append(memo[id(c)])
        out.append(row)
    return out


def estimated_force_balanced_fraction(counts: IntMatrix, owners: Sequence[int],
                                      materialized: IntMatrix, costs: StepCostModel,
                                      ranks_per_node: int,
                                      prefetched: Optional[IntMatrix] = None) -> float:
    """Cost-model estimate of one layer call's force-balanced fraction (``engine.hecate.stats()``).

    :func:`estimate_layer` of :func:`force_uniform` ``(counts)`` under the owner placement (plain expert
    parallelism needs no replica when the load is uniform) over :func:`estimate_layer` of ``counts`` under the
    executed placement ``materialized`` (``prefetched``: its replicas gathered ahead of the gate, as in
    :func:`estimate_layer`). 1.0 when the estimate has no work at all.
    """
    owned = owned_experts(owners, len(counts))
    uniform = estimate_layer(force_uniform(counts).tolist(), owners, owned, costs, ranks_per_node).time_s
    actual = estimate_layer(counts, owners, materialized, costs, ranks_per_node, prefetched).time_s
    return uniform / actual if actual > 0 else 1.0
