"""``ds-hecate simulate`` and ``ds-hecate plan``: argument parsing and printing (the work is in
:mod:`ds_hecate.sim.core` and :mod:`ds_hecate.sim.memory_plan`; presets in :mod:`ds_hecate.sim.presets`)."""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict, Optional, Tuple

from ..errors import HecateError


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, "r", encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise HecateError(f"cannot read {what} {path!r}: {exc}") from None


def _hecate_from_ds_config(path: Optional[str]) -> Tuple[Any, Dict[str, Any]]:
    """(HecateConfig, DeepSpeed config dict) from a DeepSpeed JSON config; defaults when no path or no section."""
    from ..config import HecateConfig, split_hecate_section

    if path is None:
        return HecateConfig(enabled=True), {}
    ds = _read_json(path, "DeepSpeed config")
    if not isinstance(ds, dict):
        raise HecateError(f"{path}: a DeepSpeed config must be a JSON object")
    hecate, _ = split_hecate_section(ds)
    return (hecate if hecate is not None else HecateConfig(enabled=True)), ds


def _measured(path: str) -> Dict[str, float]:
    """``measured_costs`` from a JSON file: the dict itself, or engine.hecate.stats() output holding it."""
    data = _read_json(path, "measured costs")
    if isinstance(data, dict) and isinstance(data.get("measured_costs"), dict):
        data = data["measured_costs"]
    if not isinstance(data, dict):
        raise HecateError(f"{path}: expected a JSON object of measured costs (or stats with 'measured_costs')")
    return data


def _zero_and_precision(ds: Dict[str, Any]) -> Tuple[int, str]:
    """ZeRO stage (DeepSpeed's default 0) and precision (bf16/fp16 sections, else fp32) of a DeepSpeed config."""
    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    precision = ("bf16" if (ds.get("bf16") or {}).get("enabled") else
                 "fp16" if (ds.get("fp16") or {}).get("enabled") else "fp32")
    return stage, precision


def run_simulate(args: argparse.Namespace) -> int:
    from .presets import Cluster, resolve_cluster
    from .core import SYSTEMS, format_table, simulate
    from .settings import SimSettings

    if args.warmup >= args.steps:
        args.parser.error(f"argument --warmup: must be fewer than --steps ({args.steps}), got {args.warmup}")
    if args.grid:
        return run_grid(args)
    missing = [f"--{name}" for name in ("cluster", "model", "workload") if getattr(args, name) is None]
    if missing:
        args.parser.error(f"the following arguments are required: {', '.join(missing)} (or --grid)")
    systems = [s for part in args.systems for s in part.split(",") if s] if args.systems else list(SYSTEMS)
    hecate, ds = _hecate_from_ds_config(args.config)
    stage, precision = _zero_and_precision(ds) if args.config else (1, "bf16")
    cluster: Any = args.cluster
    if args.measured:
        base = resolve_cluster(args.cluster)
        cluster = Cluster.from_measured(_measured(args.measured), world_size=args.world_size or base.world_size,
                                        name=f"{base.name}+measured", device_memory_gb=base.device_memory_gb)
    settings = SimSettings(steps=args.steps, warmup=args.warmup, seed=args.seed, world_size=args.world_size,
                           tokens_per_rank=args.tokens_per_rank, hecate=hecate if args.config else None,
                           materialize_budget_mb=args.materialize_budget_mb,
                           zero_stage=args.zero_stage if args.zero_stage is not None else stage,
                           precision=args.precision or precision, spag=args.spag,
                           charge_planning=not args.no_planning_charge, ep_size=args.ep_size,
                           planning_clock=args.planning_clock, charge_call_overhead=not args.no_call_overhead,
                           call_overhead_fit=args.call_overhead_fit)
    result = simulate(cluster, args.model, args.workload, settings, systems=systems)
    print(format_table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"cluster": result.cluster.name, "model": result.model.name, "workload": result.workload,
                       "world_size": result.world_size, "ep_size": result.ep_size, "edp_size": result.edp_size,
                       "steps": result.steps, "wall_s": result.wall_s, "call_overhead": result.call_overhead,
                       "systems": {k: vars(v) for k, v in result.systems.items()}}, handle, indent=1)
    return 0


def run_grid(args: argparse.Namespace) -> int:
    """``--grid``: the simulator's tables (:mod:`.grid`), printed, and into ``--json`` and ``--markdown``."""
    import sys

    from . import grid
    if args.markdown:
        grid.check_markers(args.markdown)   # before minutes of simulation, not after
    flags = [("--no-large", args.no_large), ("--no-planning-charge", args.no_planning_charge),
             ("--no-call-overhead", args.no_call_overhead),
             (f"--call-overhead-fit {args.call_overhead_fit}", args.call_overhead_fit),
             (f"--steps {args.steps}", args.steps != 30),
             (f"--json {args.json}", args.json), (f"--markdown {args.markdown}", args.markdown)]
    command = " ".join(["ds-hecate simulate --grid"] + [flag for flag, given in flags if given])
    results = grid.run_all(steps=args.steps, large=() if args.no_large else grid.LARGE_CASES, command=command,
                           charge_planning=not args.no_planning_charge,
                           charge_call_overhead=not args.no_call_overhead, call_overhead_fit=args.call_overhead_fit,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    if args.markdown:
        grid.write_markdown(args.markdown, results)
    print(grid.markdown_section(results))
    return 0


def _ranks_per_node(args: argparse.Namespace, hecate: Any, cluster: Any) -> Tuple[int, str]:
    """Ranks per node for ``plan`` and where the number comes from (for the message that blames it)."""
    if args.ranks_per_node:
        return args.ranks_per_node, "--ranks-per-node"
    if hecate.ranks_per_node:
        return hecate.ranks_per_node, "hecate.ranks_per_node of --config"
    if cluster is not None:
        return cluster.devices_per_node, f"the devices per node of --cluster {cluster.name}"
    return 8, "the default; set --ranks-per-node"


def run_plan(args: argparse.Namespace) -> int:
    from .memory_plan import format_plan, optimizer_layout_from_ds_config, plan_memory
    from .presets import resolve_cluster, resolve_model

    hecate, ds = _hecate_from_ds_config(args.config)
    model = resolve_model(args.model)
    cluster = resolve_cluster(args.cluster) if args.cluster else None
    rpn, source = _ranks_per_node(args, hecate, cluster)
    rpn = min(rpn, args.world_size)
    if args.world_size % rpn:
        args.parser.error(f"argument --world-size: {args.world_size} must be a multiple of the ranks per node, {rpn} "
                          f"({source})")
    stage, precision = _zero_and_precision(ds)
    plan = plan_memory(model, hecate, args.world_size, rpn, stage, precision, optimizer_layout_from_ds_config(ds),
                       cluster=cluster, ep_size=args.ep_size)
    memory = args.device_memory_gb or (cluster.device_memory_gb if cluster else 80.0)
    print(format_plan(plan, model, memory))
    return 0


def add_parsers(sub: Any) -> None:
    """Register ``simulate`` and ``plan`` on the ``ds-hecate`` sub-parsers (every flag typed by
    :mod:`ds_hecate.cli_args`: a bad value is argparse's error, exit status 2)."""
    from .. import cli_args as args
    from .presets import CALL_OVERHEAD_FIT, CLUSTERS, DEFAULT_CALL_OVERHEAD_FIT, MODELS
    from .workloads import WORKLOADS
    from .core import SYSTEMS

    sim = sub.add_parser("simulate", help="replay routing on a modelled cluster for Hecate and the baselines")
    sim.add_argument("--cluster", default=None, type=args.preset_or_file(CLUSTERS, "cluster", "a JSON file"),
                     help=f"preset ({', '.join(CLUSTERS)}) or a JSON file")
    sim.add_argument("--model", default=None, type=args.preset_or_file(MODELS, "model", "a JSON file of sizes"),
                     help=f"preset ({', '.join(MODELS)}) or a JSON file of sizes")
    sim.add_argument("--workload", default=None, type=args.routing_workload(WORKLOADS),
                     help=f"{'/'.join(WORKLOADS)} or a routing trace (.jsonl)")
    sim.add_argument("--systems", nargs="*", default=None, type=args.names_from(SYSTEMS, "system"),
                     help=f"any of {', '.join(SYSTEMS)} (default: all), space or comma separated")
    sim.add_argument("--steps", type=args.positive_int, default=30, help="simulated training steps (default 30)")
    sim.add_argument("--warmup", type=args.non_negative_int, default=1,
                     help="first steps left out of the averages, fewer than --steps (default 1)")
    sim.add_argument("--world-size", type=args.positive_int, default=None, help="devices (default: the cluster's)")
    sim.add_argument("--tokens-per-rank", type=args.positive_int, default=None,
                     help="default: the model's seq_len * micro_batch")
    sim.add_argument("--config", default=None, type=args.existing_file("DeepSpeed config"),
                     help="DeepSpeed JSON config whose hecate section the Hecate systems plan with (default: hecate "
                          "defaults)")
    sim.add_argument("--materialize-budget-mb", type=args.bounded_float(0, 1e9, "MiB"), default=None,
                     help="replica memory per rank, MiB (default: the config's, else 10%% of device memory)")
    sim.add_argument("--measured", default=None, type=args.existing_file("measured costs"),
                     help="JSON of ds_hecate's measured costs (stats()['measured_costs'] or the whole stats): "
                          "calibrates compute, link and T_nonMoE")
    sim.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                     help="compute dtype (default: the config's, else bf16)")
    sim.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                     help="ZeRO stage of the dense parameters, for the memory column (default: the config's, else 1)")
    sim.add_argument("--spag", choices=("p2p", "ring"), default="p2p",
                     help="Hecate's sparse collectives: p2p from the owner (as ds_hecate runs them, default) or "
                          "ring broadcast/reduce per expert (what-if)")
    sim.add_argument("--ep-size", type=args.positive_int, default=None,
                     help="group size (ep_size): Hecate shards the experts inside groups of ep_size consecutive ranks, replicated "
                          "across groups (expert data parallelism); the EP baselines use the same ep_size (default: the "
                          "config's hecate.ep_size, else the runtime's rule)")
    sim.add_argument("--seed", type=args.non_negative_int, default=0, help="workload seed (W4, W7)")
    sim.add_argument("--no-planning-charge", action="store_true",
                     help="leave Hecate's host planning time out of its step")
    sim.add_argument("--no-call-overhead", action="store_true",
                     help="leave every system's per-call runtime overhead out (the cluster's call_overhead: "
                          "docs/simulator.md, Call overhead)")
    sim.add_argument("--call-overhead-fit", choices=sorted(CALL_OVERHEAD_FIT["fits"]), help="charge this committed "
                     f"per-call overhead fit (default: the cluster's; a preset's: {DEFAULT_CALL_OVERHEAD_FIT})")
    sim.add_argument("--planning-clock", choices=("work", "thread"), default="work",
                     help="count the host planning from what the planner did, in its work models' microseconds "
                          "(work: the same figures on every machine), or as this machine's thread CPU time")
    sim.add_argument("--json", default=None, type=args.writable_path,
                     help="also write the results as JSON to this file")
    sim.add_argument("--grid", action="store_true",
                     help="the simulator's tables instead of one simulation: the 32-GPU grid and the 1,024-GPU cases "
                          "(--steps, --json, --markdown, --no-large, --no-planning-charge, --no-call-overhead, "
                          "--call-overhead-fit apply)")
    sim.add_argument("--markdown", default=None, type=args.writable_path,
                     help="with --grid: replace the generated block of this Markdown file by the tables")
    sim.add_argument("--no-large", action="store_true", help="with --grid: leave the 1,024-GPU cases out")
    sim.set_defaults(run=run_simulate, parser=sim)

    plan = sub.add_parser("plan", help="memory per rank and the scheduler's budgets, before launching")
    plan.add_argument("--config", default=None, type=args.existing_file("DeepSpeed config"),
                      help="DeepSpeed JSON config (ZeRO stage, precision, optimizer, hecate section)")
    plan.add_argument("--model", required=True, type=args.preset_or_file(MODELS, "model", "a JSON file of sizes"),
                      help=f"preset ({', '.join(MODELS)}) or a JSON file of sizes")
    plan.add_argument("--world-size", type=args.positive_int, required=True, help="ranks")
    plan.add_argument("--ranks-per-node", type=args.positive_int, default=None,
                      help="default: hecate.ranks_per_node, else the cluster's, else 8")
    plan.add_argument("--ep-size", type=args.positive_int, default=None,
                      help="group size G of the Hecate domain (default: the config's hecate.ep_size, else the "
                           "runtime's rule)")
    plan.add_argument("--cluster", default=None, type=args.preset_or_file(CLUSTERS, "cluster", "a JSON file"),
                      help="preset or JSON: device memory and bandwidth/T_nonMoE for t")
    plan.add_argument("--device-memory-gb", type=args.positive_float, default=None,
                      help="warn above this (default: the cluster's device memory, else 80)")
    plan.set_defaults(run=run_plan, parser=plan)
