"""The measurement on each rank: the systems take turns step by step on every workload, and rank 0 merges the
ranks' figures into the results dict (schema ``SCHEMA``) that the report and the calibration read."""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback
from typing import Dict, List, Optional, Tuple

from benchmarks.machine import describe_machine
from benchmarks.probes import ByteCounter, parallel_efficiency, resident_bytes, transient_peak_bytes
from benchmarks.routes import route_sources
from benchmarks.systems import DESCRIPTIONS, System

SCHEMA = "ds_hecate-benchmark/1"


def run_workload(args, systems: Dict[str, System], routes, rank: int, world: int, counter: ByteCounter) -> dict:
    import deepspeed.comm as dist
    import torch

    from ds_hecate.planning.cost_model import imbalance, owner_loads
    names = list(systems)
    E = args.experts
    owners = [e // (E // world) for e in range(E)]
    rec: Dict[str, Dict[str, list]] = {s: {"step_s": [], "phases": [], "bytes": [], "load": [], "rows": [],
                                           "hecate_phases": [], "replicas": []} for s in names}
    first_loss: Dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        num_tokens = routes.tokens(step, rank)
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 101 + rank)
        x = torch.randn(num_tokens, args.hidden, generator=gen)
        choices = [routes.choices(step, layer, rank, args.seed) for layer in range(args.layers)]
        all_counts = [routes.counts(step, layer) for layer in range(args.layers)]
        pairs_per_rank = sum(routes.tokens(step, r) for r in range(world)) * args.top_k // world
        order = names[step % len(names):] + names[:step % len(names)]
        for s in order:
            system = systems[s]
            system.set_routes(choices, pairs_per_rank)
            before = _hecate_phase_totals(system)
            dist.barrier()
            counter.bytes, counter.active = 0, True
            start = time.perf_counter()
            phases = system.step(x)
            dist.barrier()
            elapsed = time.perf_counter() - start
            counter.active = False
            if step == 0:
                first_loss[s] = system.last_loss
            if not timed:
                continue
            r = rec[s]
            r["step_s"].append(elapsed)
            r["phases"].append(phases)
            r["bytes"].append(counter.bytes)
            if system.hecate is not None:
                stats = system.hecate.stats()
                after = _hecate_phase_totals(system, stats)
                r["hecate_phases"].append({k: after[k] - before[k] for k in after})
                for layer in stats["layers"]:
                    r["load"].append(layer["load_imbalance_after"])
                    r["rows"].append(layer["compute_per_rank_after"])
                    r["replicas"].append(layer["replicas"])
            elif s == "ideal":
                for _ in range(args.layers):
                    r["load"].append(1.0)
                    r["rows"].append([pairs_per_rank] * world)
            else:
                for counts in all_counts:
                    load = owner_loads(counts, owners, world)
                    r["load"].append(imbalance(load))
                    if s == "deepspeed-ep":  # dropless legacy layer: every expert padded to the largest count
                        capacity = max(max(row) for row in counts)
                        r["rows"].append([world * (E // world) * capacity] * world)
                    else:
                        r["rows"].append(load)
    out = _summarise(rec, systems, first_loss, world)
    if not args.no_memory:
        _measure_memory(args, systems, routes, rank, world, out)
    return out


def _summarise(rec: Dict[str, Dict[str, list]], systems: Dict[str, System], first_loss: Dict[str, float],
               world: int) -> dict:
    """Per system, this rank's figures over the timed steps of one workload."""
    names = list(systems)
    out = {}
    for s in names:
        r, system = rec[s], systems[s]
        res = {"status": "ok", "median_step_s": statistics.median(r["step_s"]), "step_s": r["step_s"],
               "first_step_loss": first_loss.get(s),
               "load_max_over_mean": sum(r["load"]) / len(r["load"]),
               "expert_rows_per_rank": [sum(rows[i] for rows in r["rows"]) / len(r["rows"]) for i in range(world)],
               "bytes_sent_per_step": statistics.mean(r["bytes"]),
               "phases_s": {k: statistics.mean(p[k] for p in r["phases"]) for k in r["phases"][0]}}
        if r["hecate_phases"]:
            res["hecate_phases_s"] = {k: statistics.mean(p[k] for p in r["hecate_phases"])
                                      for k in r["hecate_phases"][0]}
            res["replicas_per_layer"] = statistics.mean(r["replicas"])
            res["measured_costs"] = system.hecate.stats()["measured_costs"]
        out[s] = res
    return out


def _measure_memory(args, systems: Dict[str, System], routes, rank: int, world: int, out: dict) -> None:
    """One profiled step per system after timing: ``resident_bytes`` and ``peak_memory_bytes`` into ``out``."""
    import deepspeed.comm as dist
    import torch
    names = list(systems)
    num_tokens = routes.tokens(0, rank)
    x = torch.randn(num_tokens, args.hidden, generator=torch.Generator().manual_seed(7 + rank))
    choices = [routes.choices(args.warmup, layer, rank, args.seed) for layer in range(args.layers)]
    pairs = sum(routes.tokens(0, r) for r in range(world)) * args.top_k // world
    for s in names:
        systems[s].set_routes(choices, pairs)
        dist.barrier()
        transient = transient_peak_bytes(lambda: systems[s].step(x))
        resident = resident_bytes(systems[s])
        out[s]["resident_bytes"] = resident
        out[s]["peak_memory_bytes"] = resident + transient


def _hecate_phase_totals(system: System, stats: Optional[dict] = None) -> Dict[str, float]:
    if system.hecate is None:
        return {}
    stats = stats or system.hecate.stats()
    totals: Dict[str, float] = {}
    for layer in stats["layers"]:
        for k, v in layer["time_s"].items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def _build_systems(names: List[str], args, world: int, rank: int) -> Tuple[Dict[str, System], Dict[str, str]]:
    """(the systems that every rank built, the reason per system that some rank could not build)."""
    import deepspeed.comm as dist
    systems: Dict[str, System] = {}
    skipped: Dict[str, str] = {}
    for name in names:
        try:
            system, error = System(name, args, world, rank), None
        except Exception as exc:  # a system that cannot run here is reported as skipped, with the reason
            system, error = None, f"{type(exc).__name__}: {exc}".strip()
            if rank == 0:
                traceback.print_exc()
        errors = [None] * world
        dist.all_gather_object(errors, error)
        reason = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)
        if reason:
            skipped[name] = reason[:600]
        else:
            systems[name] = system
    return systems, skipped


def run(args) -> Optional[dict]:
    """Run the benchmark on the current process group (one call per rank); rank 0 returns the results."""
    import deepspeed
    import deepspeed.comm as dist
    import torch
    import ds_hecate  # noqa: F401  (patches deepspeed.initialize)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be a multiple of the {world} ranks")
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in names if s not in DESCRIPTIONS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {', '.join(DESCRIPTIONS)}")
    sources = route_sources(args, world)
    efficiency_before = parallel_efficiency(rank, world)
    load_before = os.getloadavg()[0]

    systems, skipped = _build_systems(names, args, world, rank)
    counter = ByteCounter()
    workloads = {}
    try:
        for wname, title, routes in sources:
            wall = time.perf_counter()
            mine = run_workload(args, systems, routes, rank, world, counter)
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            workloads[wname] = {"title": title, "wall_s": time.perf_counter() - wall,
                                "systems": _merge_ranks(gathered, routes, args, world)}
            for s, reason in skipped.items():
                workloads[wname]["systems"][s] = {"status": "skipped", "reason": reason}
            if rank == 0:
                print(f"[benchmark] {wname} done in {workloads[wname]['wall_s']:.1f} s", flush=True)
        empty_steps = measure_empty_steps(args, systems, rank, world, counter)
    finally:
        counter.restore()
    efficiency_after = parallel_efficiency(rank, world)
    if rank != 0:
        return None
    return {"schema": SCHEMA, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": "OMP_NUM_THREADS=1 deepspeed --num_gpus {} benchmarks/run.py {}".format(
                world, " ".join(a for a in sys.argv[1:] if not a.startswith("--local_rank"))),
            "machine": {**describe_machine(), "parallel_efficiency": [round(efficiency_before, 3),
                                                                      round(efficiency_after, 3)],
                        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
            "world_size": world,
            "config": {k: v for k, v in vars(args).items() if k not in ("local_rank", "report_only")},
            "model": {"layers": args.layers, "hidden": args.hidden, "expert": f"SwiGLU {args.hidden}x{args.ffn}",
                      "experts": args.experts, "top_k": args.top_k, "tokens_per_rank": args.tokens,
                      "expert_params": 3 * args.hidden * args.ffn, "dtype": "fp32", "zero_stage": 2},
            "systems": {s: {"description": DESCRIPTIONS[s], "status": "skipped" if s in skipped else "ok",
                            **({"reason": skipped[s]} if s in skipped else {}),
                            **({"empty_step_s": empty_steps[s]} if s in empty_steps else {})} for s in names},
            "workloads": workloads}


def measure_empty_steps(args, systems: Dict[str, "System"], rank: int, world: int, counter) -> Dict[str, float]:
    """Each system's median step on an almost empty batch (one token per expert per rank, balanced): its fixed cost
    per step (framework, dense parameters, optimizer, small collectives), an input of the simulator's calibration
    (benchmarks/calibration.py). Taken after the workloads, so ds_hecate's cost profiling saw the real batches."""
    from ds_hecate.testing.workloads import WorkloadRoutes
    tiny = argparse.Namespace(**{**vars(args), "tokens": args.experts, "steps": 10, "warmup": 3, "no_memory": True})
    routes = WorkloadRoutes("W0", world, args.experts, args.top_k, args.experts, args.seed)
    mine = run_workload(tiny, systems, routes, rank, world, counter)
    return {s: r["median_step_s"] for s, r in mine.items()}


def _merge_ranks(per_rank: List[dict], routes, args, world: int) -> dict:
    """Per system: rank 0's step times (identical up to the barrier), per-rank lists for rank-local figures."""
    out = {}
    for s in per_rank[0]:
        rows = [r[s] for r in per_rank]
        res = dict(rows[0])
        res["bytes_sent_per_step"] = [r["bytes_sent_per_step"] for r in rows]
        res["bytes_sent_per_step_max"] = max(res["bytes_sent_per_step"])
        for key in ("peak_memory_bytes", "resident_bytes"):
            if key in rows[0]:
                res[key] = [r[key] for r in rows]
        res["phases_s"] = [r["phases_s"] for r in rows]
        if "hecate_phases_s" in rows[0]:
            res["hecate_phases_s"] = [r["hecate_phases_s"] for r in rows]
        out[s] = res
    ref = out.get("ds_hecate", {}).get("median_step_s")
    for s, res in out.items():
        res["ratio_vs_ds_hecate"] = res["median_step_s"] / ref if ref else None
    if "ideal" in out:
        ideal = out["ideal"]["median_step_s"]
        for s, res in out.items():
            res["fraction_of_ideal"] = ideal / res["median_step_s"]
    return out
