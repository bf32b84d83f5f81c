"""The measurement on each rank of ``python -m benchmarks.step``: the systems take turns step by step on every
workload; rank 0 merges the ranks' figures into the run record (schema :data:`SCHEMA`)."""
from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

from benchmarks import common
from benchmarks.step_systems import System, route_sources

SCHEMA = "ds_hecate-benchmark/1"


class ByteCounter:
    """Bytes this rank sends in torch.distributed collectives while a system steps (ring algorithms): all-to-all the
    input less the rank's own part, all-reduce 2(W-1)/W of the tensor, reduce-scatter (W-1)/W of the input,
    all-gather (W-1) times the input, broadcast (W-1) times the tensor on the source."""

    NAMES = ("all_to_all_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
             "all_gather_single", "all_gather", "broadcast", "reduce_scatter", "all_to_all")

    def __init__(self) -> None:
        import torch.distributed as dist
        self.dist, self.active, self.bytes = dist, False, 0.0
        self.originals: Dict[str, Callable] = {}
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None or (name == "all_gather_into_tensor" and hasattr(dist, "all_gather_single")):
                continue   # torch 2.13+: the old name forwards to all_gather_single, counted there
            self.originals[name] = original
            for where in (dist, dist.distributed_c10d):
                if getattr(where, name, None) is original:
                    setattr(where, name, self._wrap(name, cast(Callable, original)))

    def restore(self) -> None:
        for name, original in self.originals.items():
            setattr(self.dist, name, original)
            setattr(self.dist.distributed_c10d, name, original)

    #: per collective but the all-to-alls: the argument (name, position) it sends and the share of it, of W ranks
    SHARES: Dict[str, Tuple[str, int, Callable[[int], float]]] = {
        "all_reduce": ("tensor", 0, lambda w: 2.0 * (w - 1) / w), "all_gather": ("tensor", 1, lambda w: w - 1),
        "reduce_scatter_tensor": ("input", 1, lambda w: (w - 1) / w), "broadcast": ("tensor", 0, lambda w: w - 1),
        "reduce_scatter": ("input_list", 1, lambda w: (w - 1) / w),
        "all_gather_into_tensor": ("input_tensor", 1, lambda w: w - 1),
        "all_gather_single": ("input_tensor", 1, lambda w: w - 1)}

    def _sent(self, name: str, args, kwargs) -> float:
        def arg(key: str, index: int):
            return kwargs.get(key, args[index] if len(args) > index else None)

        def nbytes(t) -> float:
            return sum(map(nbytes, t)) if isinstance(t, (list, tuple)) else t.numel() * t.element_size()
        group = kwargs.get("group", arg("group", 2) if name == "broadcast" else None)
        w, me = self.dist.get_world_size(group), self.dist.get_rank(group)
        if w <= 1 or (name == "broadcast" and self.dist.get_rank() != arg("src", 1)):
            return 0.0
        if name == "all_to_all_single":
            inp, splits = arg("input", 1), arg("input_split_sizes", 3)
            return nbytes(inp) - (splits[me] * nbytes(inp) / max(1, inp.shape[0]) if splits else nbytes(inp) / w)
        if name == "all_to_all":
            return sum(nbytes(t) for i, t in enumerate(arg("input_tensor_list", 1)) if i != me)
        key, index, share = self.SHARES[name]
        return share(w) * nbytes(arg(key, index))

    def _wrap(self, name: str, original: Callable) -> Callable:
        def counted(*args, **kwargs):
            if self.active:
                try:
                    self.bytes += self._sent(name, args, kwargs)
                except Exception:  # counting must never break the collective; an unknown form counts 0
                    pass
            return original(*args, **kwargs)
        return counted


def _hecate_phases(system: System) -> Dict[str, float]:
    totals: Dict[str, float] = {}
    for layer in (system.hecate.stats()["layers"] if system.hecate is not None else []):
        for k, v in layer["time_s"].items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def _loads(args, system: System, all_counts, pairs: int, world: int) -> Tuple[List[float], List[List[float]]]:
    """(compute max/mean, rows per rank) of each layer call: Hecate runtimes' executed plans, the ideal's mean load,
    expert parallelism's pairs per owner (DeepSpeed's dropless legacy layer: every expert padded to the largest)."""
    from ds_hecate.planning.cost_model import imbalance, owner_loads
    if system.hecate is not None:
        layers = system.hecate.stats()["layers"]
        return [x["load_imbalance_after"] for x in layers], [x["compute_per_rank_after"] for x in layers]
    if system.name == "ideal":
        return [1.0] * args.layers, [[pairs] * world] * args.layers
    owners = [e // (args.experts // world) for e in range(args.experts)]
    loads = [owner_loads(c, owners, world) for c in all_counts]
    if system.name == "deepspeed-ep":
        rows = [[args.experts * max(max(r) for r in c)] * world for c in all_counts]
        return [imbalance(x) for x in loads], rows
    return [imbalance(x) for x in loads], [list(x) for x in loads]


def run_workload(args, systems: Dict[str, System], routes, rank: int, world: int, counter: ByteCounter) -> dict:
    """The workload's steps, every system once per step in a rotated order between barriers; this rank's figures."""
    import deepspeed.comm as dist
    import torch
    names = list(systems)
    rec: Dict[str, Dict[str, list]] = {s: {k: [] for k in ("step_s", "phases", "bytes", "load", "rows", "hecate",
                                                           "replicas")} for s in names}
    first_loss: Dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 101 + rank)
        x = torch.randn(routes.tokens(step, rank), args.hidden, generator=gen)
        choices = [routes.choices(step, layer, rank, args.seed) for layer in range(args.layers)]
        all_counts = [routes.counts(step, layer) for layer in range(args.layers)]
        pairs = sum(routes.tokens(step, r) for r in range(world)) * args.top_k // world
        for s in names[step % len(names):] + names[:step % len(names)]:
            system = systems[s]
            system.set_routes(choices, pairs)
            before = _hecate_phases(system)
            dist.barrier()
            counter.bytes, counter.active = 0.0, True
            start = time.perf_counter()
            phases = system.step(x)
            dist.barrier()
            elapsed, counter.active = time.perf_counter() - start, False
            first_loss.setdefault(s, system.last_loss)
            if step < args.warmup:
                continue
            r = rec[s]
            r["step_s"].append(elapsed)
            r["phases"].append(phases)
            r["bytes"].append(counter.bytes)
            if system.hecate is not None:
                after = _hecate_phases(system)
                r["hecate"].append({k: after[k] - before.get(k, 0.0) for k in after})
                r["replicas"] += [x["replicas"] for x in system.hecate.stats()["layers"]]
            load, rows = _loads(args, system, all_counts, pairs, world)
            r["load"] += load
            r["rows"] += rows
    out = {}
    for s in names:
        r = rec[s]
        out[s] = {"status": "ok", "median_step_s": statistics.median(r["step_s"]), "step_s": r["step_s"],
                  "first_step_loss": first_loss[s], "load_max_over_mean": statistics.mean(r["load"]),
                  "expert_rows_per_rank": [statistics.mean(x[i] for x in r["rows"]) for i in range(world)],
                  "bytes_sent_per_step": statistics.mean(r["bytes"]),
                  "phases_s": {k: statistics.mean(p[k] for p in r["phases"]) for k in r["phases"][0]}}
        if r["hecate"]:
            out[s].update(hecate_phases_s={k: statistics.mean(p[k] for p in r["hecate"]) for k in r["hecate"][0]},
                          replicas_per_layer=statistics.mean(r["replicas"]),
                          measured_costs=systems[s].hecate.stats()["measured_costs"])
    return out


def _merge(per_rank: List[dict], world: int) -> dict:
    """Per system rank 0's step times (the same up to the barriers) and per-rank lists of rank-local figures."""
    out = {s: {**per_rank[0][s], **{key: [r[s][key] for r in per_rank] for key in (
        "bytes_sent_per_step", "phases_s", "hecate_phases_s") if key in per_rank[0][s]}} for s in per_rank[0]}
    for res in out.values():
        res["bytes_sent_per_step_max"] = max(res["bytes_sent_per_step"])
    ideal = out.get("ideal", {}).get("median_step_s")
    for res in out.values():
        res["fraction_of_ideal"] = ideal / res["median_step_s"] if ideal else None
    return out


def _build(names: List[str], args, world: int, rank: int) -> Tuple[Dict[str, System], Dict[str, str]]:
    """(the systems every rank built, the reason per system some rank could not build)."""
    import deepspeed.comm as dist
    systems: Dict[str, System] = {}
    skipped: Dict[str, str] = {}
    for name in names:
        system: Optional[System] = None
        try:
            system, error = System(name, args, world, rank), None
        except Exception as exc:  # a system that cannot run here is reported as skipped, with the reason
            system, error = None, f"{type(exc).__name__}: {exc}".strip()
            if rank == 0:
                traceback.print_exc()
        errors: List[Optional[str]] = [None] * world
        dist.all_gather_object(errors, error)
        reason = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)
        if reason or system is None:
            skipped[name] = (reason or "not built")[:600]
        else:
            systems[name] = system
    return systems, skipped


def run(args) -> Optional[dict]:
    """The benchmark on the current process group (one call per rank); rank 0 returns the run record."""
    import deepspeed
    import deepspeed.comm as dist
    import torch
    import ds_hecate  # noqa: F401  (makes deepspeed.initialize Hecate-aware)
    from ds_hecate.testing.workloads import WorkloadRoutes
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be a multiple of the {world} ranks")
    machine = {**common.describe_machine(), "backend": "gloo", "ranks": world}
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    systems, skipped = _build(names, args, world, rank)
    counter, workloads = ByteCounter(), {}
    try:
        for wname, title, routes in route_sources(args, world):
            mine = run_workload(args, systems, routes, rank, world, counter)
            gathered: List[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
            workloads[wname] = {"title": title, "systems": {**_merge(gathered, world), **{
                s: {"status": "skipped", "reason": why} for s, why in skipped.items()}}}
            if rank == 0:
                print(f"[step] {wname} done", flush=True)
        # each system's step on an almost empty batch (one token per expert per rank): its fixed cost per step,
        # the calibration's alpha; taken last, so ds_hecate's cost profiling saw the real batches
        tiny = argparse.Namespace(**{**vars(args), "steps": 10, "warmup": 3})
        empty = run_workload(tiny, systems, WorkloadRoutes("W0", world, args.experts, args.top_k, args.experts,
                                                           args.seed), rank, world, counter)
    finally:
        counter.restore()
    if rank != 0:
        return None
    config = {k: v for k, v in vars(args).items() if k not in ("local_rank", "report_only", "argv")}
    return common.run_record(SCHEMA, "benchmarks.step", args.argv, machine, world_size=world, config=config,
                             systems={s: {"status": "skipped", "reason": skipped[s]} if s in skipped else
                                      {"status": "ok", "empty_step_s": empty[s]["median_step_s"]} for s in names},
                             workloads=workloads)
