"""The routing the benchmark forces, in one place below both the measurement (benchmarks/measure.py) and the
readers of its results (benchmarks/calibration.py, benchmarks/force_balanced.py), which rebuild it from the config."""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def route_sources(args, world: int):
    """``(name, title, routes)`` per run of the benchmark: the named workloads, the traces, then the forced-uniform
    runs that W0 does not stand for."""
    from ds_hecate.testing.workloads import TraceRoutes, WorkloadRoutes
    from ds_hecate.sim.workloads import WORKLOADS
    sources = []
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        sources.append((name, WORKLOADS[name].title if name in WORKLOADS else name,
                        WorkloadRoutes(name, world, args.experts, args.top_k, args.tokens, args.seed)))
    for path in args.trace:
        src = TraceRoutes(path, world, args.experts, args.top_k, args.tokens)
        sources.append((src.name, f"trace {os.path.basename(path)} ({src.num_steps} steps)", src))
    from benchmarks.uniform_routes import uniform_counterparts   # forced-uniform runs W0 does not stand for
    return sources + uniform_counterparts(sources, args.warmup + args.steps, args.layers)


def sources_from_results(results: dict, world: int) -> Dict[str, Any]:
    """The benchmark's own route sources (:func:`route_sources`) for a results JSON's arguments, by name."""
    cfg = dict(results["config"])
    traces = []
    for path in cfg.get("trace") or []:   # the benchmark ran from the repository root
        traces.append(path if os.path.isabs(path) or os.path.exists(path) else os.path.join(REPO, path))
    args = argparse.Namespace(**{**cfg, "trace": traces, "workloads": cfg.get("workloads") or ""})
    return {name: routes for name, _, routes in route_sources(args, world)}
