"""The forced-uniform route sources (``<name>-uniform`` runs) and which run is a workload's forced-uniform
counterpart: below both the route list (benchmarks/routes.py) and the force-balanced report
(benchmarks/force_balanced.py), so neither imports the other; benchmarks/force_balanced.py describes the metric."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ds_hecate.planning.balance import force_uniform, is_uniform
from ds_hecate.testing.workloads import RouteSource

SUFFIX = "-uniform"
Profile = Tuple[Tuple[Tuple[int, ...], ...], bool]   # (pairs per rank of every (step, layer), uniform throughout)


class UniformRoutes(RouteSource):
    """``base``'s tokens per rank with every call's pairs forced uniform over the experts."""

    def __init__(self, base: RouteSource, name: str) -> None:
        self.base, self.name = base, name
        self.world_size, self.num_experts, self.top_k = base.world_size, base.num_experts, base.top_k

    def tokens(self, step: int, rank: int) -> int:
        return self.base.tokens(step, rank)

    def counts(self, step: int, layer: int) -> List[List[int]]:
        return force_uniform(self.base.counts(step, layer)).tolist()


def _profile(routes: RouteSource, steps: int, layers: int) -> Profile:
    totals, uniform = [], True
    for s in range(steps):
        for layer in range(layers):
            c = np.asarray(routes.counts(s, layer))
            totals.append(tuple(int(t) for t in c.sum(axis=1)))
            uniform = uniform and is_uniform(c)
    return tuple(totals), uniform


def counterparts(sources: Dict[str, RouteSource], steps: int, layers: int) -> Dict[str, Optional[str]]:
    """Per source name, the name of the source that is its forced-uniform routing (itself when it is uniform;
    None when no source is)."""
    profiles = {n: _profile(r, steps, layers) for n, r in sources.items()}
    out: Dict[str, Optional[str]] = {}
    for name, (totals, uniform) in profiles.items():
        out[name] = name if uniform else next((m for m, (t, u) in profiles.items() if u and t == totals), None)
    return out


def uniform_counterparts(sources: Sequence[Tuple[str, str, RouteSource]], steps: int,
                         layers: int) -> List[Tuple[str, str, RouteSource]]:
    """The ``(name, title, routes)`` runs to add to the benchmark's ``sources`` so that every one has a
    forced-uniform counterpart (none when W0 serves them all)."""
    found = counterparts({n: r for n, _, r in sources}, steps, layers)
    extra: List[Tuple[str, str, RouteSource]] = []
    seen: Dict[Tuple[Tuple[int, ...], ...], str] = {}
    for name, title, routes in sources:
        if found[name] is not None:
            continue
        totals, _ = _profile(routes, steps, layers)
        if totals not in seen:   # force_uniform depends only on the pairs per rank: one run serves them all
            seen[totals] = name + SUFFIX
            extra.append((name + SUFFIX, f"{title}, routing forced uniform", UniformRoutes(routes, name + SUFFIX)))
    return extra
