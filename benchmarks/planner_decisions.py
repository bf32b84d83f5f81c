"""The planner's decisions, call by call, as a digest two checkouts can compare (a refactor must not change them).

    python -m benchmarks.planner_decisions --out decisions.json [--no-budgets]
    python -m benchmarks.planner_decisions --compare before.json after.json

Runs the call sequence of ``python -m benchmarks.planner`` (load window, prefetch search with re-use, the after-gate
plan of one rank) on a grid of worlds and loads and records, per call, a digest of the prefetched placement, the
call's placement, this rank's splits, send rows and expert-major segments, whether calibration searched, and the
node traffic. ``--no-budgets`` lifts both search budgets: what is left is the planner's logic, which must match
exactly; with the default budgets a change of the work model may cut searches elsewhere. Every call's executed
placement is estimated on the call's counts (the cost model's layer time), and where calibration placed, its
prefetched and sharded placements too; ``--compare`` checks that a differing call is never slower than before, nor
a calibrated one slower than either placement it started from.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from typing import Dict, List

from ds_hecate.planning.cost_model import estimate_layer
from ds_hecate.planning.search import SearchSettings, calibration_settings, plan_after_gate
from ds_hecate.planning.plan import Placement, owned_experts

from .planner import COSTS, REPLICAS_PER_RANK, CallSequence

GRID = ((8, 8, 2, "skewed"), (8, 64, 8, "skewed"), (8, 64, 8, "burst"), (64, 64, 8, "skewed"),
        (64, 64, 2, "balanced"), (64, 256, 8, "skewed"), (64, 256, 8, "burst"), (64, 8, 8, "skewed"),
        (256, 64, 8, "skewed"), (256, 256, 8, "burst"))


def decisions(ranks: int, experts: int, top_k: int, load: str, budgets: bool, seed: int = 0) -> List[dict]:
    seq = CallSequence(ranks, experts, top_k, load, seed)
    cfg, owners, rpn, rank, schedule = seq.cfg, seq.owners, seq.rpn, seq.rank, seq.schedule
    sharded = owned_experts(owners, ranks)
    out = []
    search = SearchSettings(COSTS, REPLICAS_PER_RANK, rpn, budget_us=cfg.search_budget_us if budgets else None)
    calibration = calibration_settings(COSTS, REPLICAS_PER_RANK, rpn, cfg.plan_budget_us if budgets else 1e12)
    for call in range(40 if ranks * experts >= 16384 else 60):
        prediction = seq.window.predict_array()
        prefetched = schedule.schedule(prediction, owners, search)
        counts = seq.draw(call)
        after = plan_after_gate(counts, Placement(owners, prefetched), schedule, calibration, rank, cfg.calibration)
        mine = after.mine
        seen = (prefetched, after.plan.materialized, mine.send_splits, mine.recv_splits, mine.send_rows.tolist(),
                mine.order_starts.tolist(), mine.order_lengths.tolist(), mine.sizes, after.searched,
                after.plan.node_traffic(rpn))
        def layer_s(materialized):
            return estimate_layer(counts, owners, materialized, COSTS, rpn, prefetched=prefetched).time_s

        # every call's executed placement, estimated on its own counts: a differing call is weighed against before
        row = {"digest": hashlib.sha1(repr(seen).encode()).hexdigest()[:16],
               "layer_s": layer_s(after.plan.materialized)}
        if after.searched or after.shadowed or after.grown:   # calibration placed: against what it started from
            row.update(prefetched_s=layer_s(prefetched), sharded_s=layer_s(sharded))
        out.append(row)
        seq.window.push(counts)
    return out


def compare(before: Dict[str, List[dict]], after: Dict[str, List[dict]]) -> bool:
    """Print the calls whose decisions differ; False if a differing call's executed placement is estimated slower
    than before (where both runs estimated it: files written before every call was estimated have ``layer_s`` only
    for calibrated calls), or a differing calibrated call slower than its prefetched or sharded placement, or the
    grids differ."""
    ok = before.keys() == after.keys()
    for case, rows in before.items():
        other = after.get(case, [])
        differ = [i for i, (a, b) in enumerate(zip(rows, other)) if a["digest"] != b["digest"]]
        print(f"{case}: {len(rows)} calls, {len(differ)} differ {differ[:12]}")
        for i in differ:
            a, b = rows[i], other[i]
            flags = []
            if "layer_s" in a and "layer_s" in b and b["layer_s"] > a["layer_s"] * (1 + 1e-12):
                flags.append("WORSE THAN BEFORE")
            if "prefetched_s" in b and b["layer_s"] > min(b["prefetched_s"], b["sharded_s"]) * (1 + 1e-12):
                flags.append("WORSE THAN ITS START")
            ok &= not flags
            was = f"{a['layer_s']:.4f}" if "layer_s" in a else "not estimated"
            now = f"{b['layer_s']:.4f}" if "layer_s" in b else "not estimated"
            start = (f" (prefetched {b['prefetched_s']:.4f}, sharded {b['sharded_s']:.4f})" if "prefetched_s" in b
                     else "")
            print(f"  call {i}: estimated layer {was} -> {now} s{start}{'  ' + ', '.join(flags) if flags else ''}")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write this checkout's decisions here (JSON)")
    p.add_argument("--no-budgets", action="store_true", help="lift search_budget_us and plan_budget_us")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two --out files")
    args = p.parse_args(argv)
    if args.compare:
        before, after = (json.load(open(f)) for f in args.compare)
        return 0 if compare(before, after) else 1
    if not args.out:
        p.error("give --out FILE or --compare BEFORE AFTER")
    result = {f"{r}x{e} top-{k} {load}": decisions(r, e, k, load, not args.no_budgets) for r, e, k, load in GRID}
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
