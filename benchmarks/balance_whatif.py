"""What a compute-balanced placement would cost where Hecate leaves the expert compute unbalanced on purpose.

    python -m benchmarks.balance_whatif [--workloads W4] [--prices 1,0.1,0.01,0] [--json FILE]

On W4 (ragged sources: ranks hold 1.75x..0.25x of the mean tokens) the scheduler keeps the heavy ranks' tokens
home on copies of the experts they send to, so those ranks compute more: post-plan expert-compute imbalance
1.34-1.48 on the 32-GPU grid, where the other workloads reach 1.00-1.10. This re-runs those cells with Hecate's
planners seeing token traffic at a fraction of its cost (``SimSettings(planner_token_price=...)``; the time model
still charges every row whole), so the search trades token traffic for compute balance, and prints what that
balance costs in step time. Every figure is a model output of ds_hecate's own planner in the simulator, host
planning charged from its work models (the same table on any machine, loaded or idle).
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional, Sequence

from .simulated import BASELINES, GRID_CLUSTERS, GRID_MODELS, best_baseline, cli_defaults

PRICES = (1.0, 0.1, 0.01, 0.0)


def run_cell(cluster: str, model: str, workload: str, price: float, defaults: Dict[str, Any]) -> Dict[str, Any]:
    """One grid cell with Hecate's planners pricing token traffic at ``price``; the figures the table prints."""
    from ds_hecate.sim import SimSettings, simulate

    settings = SimSettings(steps=defaults["steps"], warmup=defaults["warmup"], seed=defaults["seed"],
                           spag=defaults["spag"], planner_token_price=price)
    result = simulate(cluster, model, workload, settings, systems=["ep", *BASELINES, "hecate"])
    hecate = result.systems["hecate"]
    baseline, baseline_speedup = best_baseline(
        {"systems": {name: {"speedup_vs_ep": r.speedup_vs_ep} for name, r in result.systems.items()}})
    return {"cluster": cluster, "model": model, "workload": workload, "token_price": price,
            "hecate_step_s": hecate.step_time_s, "hecate_vs_ep": hecate.speedup_vs_ep,
            "imbalance": hecate.imbalance, "force_balanced_fraction": hecate.force_balanced_fraction,
            "replicas_per_layer": hecate.replicas_per_layer, "best_baseline": baseline,
            "best_baseline_vs_ep": baseline_speedup}


def run_all(workloads: Sequence[str], prices: Sequence[float]) -> List[Dict[str, Any]]:
    defaults = cli_defaults()
    return [run_cell(c, m, w, p, defaults) for w in workloads for c in GRID_CLUSTERS for m in GRID_MODELS
            for p in prices]


def markdown(rows: List[Dict[str, Any]]) -> str:
    """One line per cell and price; the step cost is against the same cell at price 1 (the runtime's model)."""
    own = {(r["cluster"], r["model"], r["workload"]): r for r in rows if r["token_price"] == 1.0}
    lines = ["| cell | token price seen by the planner | Hecate vs EP | step vs price 1 | expert-compute "
             "imbalance | of force-balanced | replicas/layer | best baseline vs EP |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = own.get((r["cluster"], r["model"], r["workload"]))
        step = f"{r['hecate_step_s'] / ref['hecate_step_s']:.3f}x" if ref else "-"
        lines.append(f"| {r['cluster']} / {r['model']} / {r['workload']} | {r['token_price']:g} | "
                     f"{r['hecate_vs_ep']:.3f}x | {step} | {r['imbalance']:.2f} | "
                     f"{r['force_balanced_fraction'] * 100:.0f}% | {r['replicas_per_layer']:.0f} | "
                     f"{r['best_baseline']} {r['best_baseline_vs_ep']:.3f}x |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W4", help="comma-separated grid workloads (default W4)")
    parser.add_argument("--prices", default=",".join(f"{p:g}" for p in PRICES),
                        help="comma-separated token prices in [0, 1] the planner sees (1: the runtime's model)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    prices = [float(p) for p in args.prices.split(",")]
    if 1.0 not in prices:
        prices.insert(0, 1.0)   # the reference every other price is compared with
    rows = run_all([w.strip() for w in args.workloads.split(",")], prices)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
