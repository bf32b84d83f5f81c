"""The per-step costs the simulator charges beyond its time model, as the generated simulator block of
docs/benchmarks.md words them (benchmarks/simulated.py): Hecate's host planning and every system's per-call runtime
overhead (docs/simulator.md, "Call overhead"); and the two number formats the block uses."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

def times(v: float) -> str:
    """A ratio as the tables print it (\"1.23x\")."""
    return f"{v:.2f}x"


def span(values: Sequence[float], fmt=times) -> str:
    """``lo-hi`` of ``values`` in ``fmt`` ("1.2-3.4x"), or one value when both ends print alike."""
    lo, hi = fmt(min(values)), fmt(max(values))
    if lo == hi:
        return lo
    if lo[-1:] in ("x", "%") and hi[-1:] == lo[-1:]:
        lo = lo[:-1]
    return f"{lo}-{hi}"


def planning_lines(recs: List[Dict[str, Any]], charged: bool) -> List[str]:
    """What Hecate's host planning (counted in the planner's work models, charged to its step) costs, and the speedup
    without it."""
    if not charged:
        return ["- Host planning time is not charged in these figures (`--no-planning-charge`)."]
    out = []
    for name in ("hecate", "hecate-rm"):
        cells = [(r, r["systems"][name]) for r in recs if name in r["systems"] and "ep" in r["systems"]]
        if not cells:
            continue
        ms = [s["breakdown_s"].get("host_planning", 0.0) * 1e3 for _, s in cells]
        share = [s["breakdown_s"].get("host_planning", 0.0) / s["step_time_s"] * 100 for _, s in cells]
        uncharged = [r["systems"]["ep"]["step_time_s"] / (s["step_time_s"] - s["breakdown_s"].get("host_planning", 0.0))
                     for r, s in cells]
        charged_x = [s["speedup_vs_ep"] for _, s in cells]
        out.append(f"- {name}'s host planning (critical path per layer call plus the search where the non-MoE compute "
                   f"does not hide it, counted in the planner's work models, charged to its step): "
                   f"{span(ms, lambda v: f'{v:.2f}')} ms per step, {span(share, lambda v: f'{v:.1f}')}% of it; speedup "
                   f"over EP {span(charged_x, times)} with it, {span(uncharged, times)} without.")
    return out


def _coefficients(cluster: str) -> str:
    from ds_hecate.sim.presets import resolve_cluster

    model = resolve_cluster(cluster).call_overheads()
    words = []
    for family in ("hecate", "baselines"):
        c = getattr(model, family)
        if not (c.fixed_s or c.per_row_byte_s or c.per_owned_byte_s):
            words.append(f"{'ds_hecate' if family == 'hecate' else 'the baselines'} nothing (none measured on this "
                         "device class)")
            continue
        words.append(f"{'ds_hecate' if family == 'hecate' else 'the baselines'} {c.fixed_s * 1e3:.3f} ms + "
                     f"{c.per_row_byte_s * 1e12:.2f} ps per routed-row byte + {c.per_owned_byte_s * 1e12:.2f} ps "
                     "per owned byte")
    return "; ".join(words)


def call_overhead_lines(recs: List[Dict[str, Any]], charged: bool) -> List[str]:
    """What the per-call runtime overhead (fitted, per cluster) costs each system, and Hecate's speedup over EP
    without it."""
    if not charged:
        return ["- The runtime's per-call overhead is not charged in these figures (`--no-call-overhead`)."]
    out = []
    ovh = lambda s: s["breakdown_s"].get("call_overhead", 0.0)   # noqa: E731
    for cluster in dict.fromkeys(r["cluster"] for r in recs):
        mine = [r for r in recs if r["cluster"] == cluster]
        parts = []
        for name in ("hecate", "hecate-rm", "ep", "fastermoe", "smartmoe", "flexmoe"):
            cells = [r["systems"][name] for r in mine if name in r["systems"]]
            if cells:
                parts.append(f"{name} {span([ovh(s) * 1e3 for s in cells], lambda v: f'{v:.0f}')} ms")
        cells = [(r["systems"]["ep"], r["systems"]["hecate"]) for r in mine if "hecate" in r["systems"]
                 and "ep" in r["systems"]]
        bare = [(ep["step_time_s"] - ovh(ep)) / (h["step_time_s"] - ovh(h)) for ep, h in cells]
        out.append(f"- {cluster}: per-call runtime overhead per layer call, forward + backward ({_coefficients(cluster)};"
                   " fitted, docs/simulator.md \"Call overhead\"), charged per step: " + ", ".join(parts)
                   + (f"; Hecate over EP {span([h['speedup_vs_ep'] for _, h in cells])} with it, {span(bare)} without."
                      if cells else "."))
    return out
