"""Fraction of the force-balanced ideal in the measured benchmark (benchmarks/run.py), UltraEP's metric.

A system's force-balanced step on a workload is its own median step on the same tokens per rank with the routing
forced uniform (:func:`ds_hecate.planning.balance.force_uniform`); the fraction is that step / its step on the
workload. Which run of the benchmark is a workload's forced-uniform counterpart is decided from the routing the
benchmark forces, not from names: a workload whose counts are uniform up to rounding at every step and layer and
whose pairs per rank equal the workload's at every step. W0 is that for every workload with equal tokens per rank
(and for itself). Where the run has none (W4's ragged sources, a trace with ragged ranks), :func:`uniform_counterparts`
adds a ``<name>-uniform`` run (:class:`UniformRoutes`), one per distinct set of pairs per rank.

Why W0 is reused rather than re-run: it *is* the forced-uniform routing of those workloads, and the systems already
took turns on it in the same processes; its steps ran in another minute of the run than the workload's, so the
fraction carries the machine's drift between the two (a few percent on the shared 2-vCPU box; it can exceed 1).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from benchmarks.uniform_routes import SUFFIX, counterparts
from ds_hecate.testing.workloads import RouteSource


def _sources(results: dict) -> Dict[str, RouteSource]:
    from benchmarks.routes import sources_from_results
    built = sources_from_results(results, int(results["world_size"]))
    return {n: r for n, r in built.items() if n in results["workloads"]}


def force_balanced(results: dict) -> Dict[str, Dict[str, Any]]:
    """Per workload: ``counterpart`` (the run that is its forced-uniform routing, or None, with ``reason``) and, per
    system that ran on both, ``force_balanced_step_s`` and ``force_balanced_fraction``."""
    cfg = results.get("config") or {}
    try:
        found = counterparts(_sources(results), int(cfg["warmup"]) + int(cfg["steps"]), int(cfg["layers"]))
        reason = "no run of this benchmark has its routing forced uniform with the same tokens per rank"
    except Exception as exc:  # a report must render even when the routing cannot be rebuilt (e.g. a moved trace)
        found, reason = {}, f"routing not rebuilt from results['config'] ({type(exc).__name__}: {exc})"
    out: Dict[str, Dict[str, Any]] = {}
    for wname, w in results["workloads"].items():
        ref = found.get(wname)
        entry: Dict[str, Any] = {"counterpart": ref, "systems": {}}
        if ref is None:
            entry["reason"] = reason
        else:
            base = results["workloads"][ref]["systems"]
            for s, r in w["systems"].items():
                b = base.get(s) or {}
                if r.get("status") == "ok" and b.get("status") == "ok":
                    entry["systems"][s] = {"force_balanced_step_s": b["median_step_s"],
                                           "force_balanced_fraction": b["median_step_s"] / r["median_step_s"]}
        out[wname] = entry
    return out


def annotate(results: dict) -> None:
    """Write :func:`force_balanced` into the results: per workload ``force_balanced_counterpart``, per system
    ``force_balanced_step_s`` and ``force_balanced_fraction``."""
    for wname, entry in force_balanced(results).items():
        w = results["workloads"][wname]
        w["force_balanced_counterpart"] = entry["counterpart"]
        for s, values in entry["systems"].items():
            w["systems"][s].update(values)


def report(results: dict) -> Tuple[Dict[Tuple[str, str], str], str]:
    """(cell text per (workload, system), a sentence naming each workload's counterpart) for the markdown table."""
    fb = force_balanced(results)
    cells = {(w, s): f"{v['force_balanced_fraction']:.2f}" for w, e in fb.items() for s, v in e["systems"].items()}
    by_ref: Dict[Optional[str], List[str]] = {}
    for w, e in fb.items():
        by_ref.setdefault(e["counterpart"], []).append(w)
    parts = [f"{ref} for {', '.join(ws)}" for ref, ws in by_ref.items() if ref is not None]
    missing = by_ref.get(None)
    note = ("*of force-balanced* (UltraEP's metric): the same system's median step with the routing forced uniform "
            "(same tokens per rank, `ds_hecate.planning.balance.force_uniform`) / its median step on the workload; "
            "1.00 = the routing's skew costs nothing. Forced-uniform run used: " + ("; ".join(parts) or "none")
            + (f"; n/a for {', '.join(missing)}: {fb[missing[0]]['reason']} (a new run adds `<workload>{SUFFIX}` "
               "for them)" if missing else "") + ".")
    return cells, note
