"""The simulator's entry point: per step and MoE layer, each system's placement (from the real planner or the baseline's own
rule), the planner's dispatch of the step's token counts, and a link/compute time model.

Time of one MoE layer (forward + backward), with ``x_r`` per rank and ``max`` over ranks because every all-to-all
is a collective:

    max exposed gather (forward)  +  4 x max all-to-all pass  +  max expert compute  +  max exposed reduce (backward)

- expert compute: pairs processed x ``compute_s_per_pair`` (6 x expert params / device FLOP/s, or measured);
- an all-to-all pass: the larger of the rank's intra-node bytes over its NVLink share and its node's inter-node
  bytes over the node's NICs, plus one latency; four passes (dispatch and combine, forward and backward);
- expert collectives (SparseAllGather / broadcasts of replicas, gradient reduction), same link model, hidden behind
  the non-MoE compute of the block where the system overlaps them (forward: T_nonMoE; backward: 2 x T_nonMoE) and
  the cluster overlaps communication with compute.

Every system but the ideal runs in groups of ``ep_size`` consecutive ranks (``hecate.ep_size``, resolved by the
runtime's rule :func:`~ds_hecate.planning.groups.resolve_ep_size`): all of the above stays inside a group, a layer
waits for its slowest group, and once per step each layer adds the exposed reduction of its expert gradients over
the ``world / ep_size`` expert-data-parallel peers (:func:`~ds_hecate.sim.machine.edp_reduction_time`).

A step adds the non-MoE compute of every block (3 x T_nonMoE forward), dense blocks, embeddings and the fixed
per-step time of the cluster, and the rearrangement (migration) time of SmartMoE/FlexMoE on the steps they move
experts. Activations and dense-gradient all-reduce are left out (identical for every system).
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..config import HecateConfig, wire_dtype
from ..errors import HecateError
from ..planning.balance import force_uniform_steps
from ..planning.groups import resolve_ep_size
from ..trace import read_trace
from .context import SimContext
from .model_state import (ADAM, dense_state_bytes, ep_expert_state_bytes, owned_expert_state,
                          transient_grad_bytes)
from .presets import Cluster, ModelShape, resolve_cluster, resolve_model
from .settings import SimSettings
from .systems import SYSTEMS, make_system, replica_pool
from .workloads import WORKLOADS, routing_counts

__all__ = ["ADAM", "SYSTEMS", "SimResult", "SimSettings", "SystemResult", "format_table", "simulate"]

#: ``simulate``'s settings when none are given: 30 steps, hecate defaults, ZeRO-1, bf16
DEFAULT_SETTINGS = SimSettings()


@dataclass
class SystemResult:
    system: str
    step_times_s: List[float]
    step_time_s: float                  # mean over the measured steps (after warm-up)
    peak_memory_bytes: int              # model states + replicas/reserved slots of the largest rank
    imbalance: float                    # mean over layers/steps of max/mean expert compute per rank
    replicas_per_layer: float           # mean (expert, rank) replicas beyond the sharded placement
    breakdown_s: Dict[str, float]       # per step: compute, all_to_all, exposed_comm, edp_reduce, non_moe, rearrange
    speedup_vs_ep: float = float("nan")
    fraction_of_ideal: float = float("nan")
    force_balanced_step_s: float = float("nan")     # the same system on the routing forced uniform
    force_balanced_fraction: float = float("nan")   # force_balanced_step_s / step_time_s (UltraEP's metric)


@dataclass
class SimResult:
    cluster: Cluster
    model: ModelShape
    workload: str
    world_size: int
    steps: int
    warmup: int
    systems: Dict[str, SystemResult]
    wall_s: float
    notes: List[str] = field(default_factory=list)
    ep_size: int = 0                    # G, the group size every system but the ideal ran in
    edp_size: int = 1                   # world / G expert-data-parallel copies of each expert
    call_overhead: str = ""             # what charged the per-call overhead (Cluster.call_overhead_note)


# ---------------------------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------------------------
def _workload_counts(workload: str, model: ModelShape, world: int, steps: int, tokens: int,
                     seed: int) -> Tuple[List[List[np.ndarray]], List[str]]:
    """counts[step][layer] as [world, experts] arrays, from a named workload or a trace file."""
    notes: List[str] = []
    if workload in WORKLOADS:
        per_step = [np.asarray(routing_counts(workload, s, world, model.num_experts, tokens, model.top_k, seed),
                               dtype=np.float64) for s in range(steps)]
        return [[c] * model.moe_layers for c in per_step], notes
    trace = read_trace(workload)
    if trace.world_size != world:
        raise HecateError(f"trace {workload} was recorded on {trace.world_size} ranks; simulate it with "
                          f"--world-size {trace.world_size} (got {world})")
    for i, layer in enumerate(trace.layers):
        if layer.num_experts != model.num_experts:
            raise HecateError(f"trace {workload} layer {i} has {layer.num_experts} experts, model {model.name} has "
                              f"{model.num_experts}; pass --model with the trace's sizes")
    groups = list(trace.by_step())
    if not groups:
        raise HecateError(f"trace {workload} has no records")
    out = []
    for s in range(steps):
        records = groups[s % len(groups)]
        by_layer: Dict[int, np.ndarray] = {}
        for r in records:
            by_layer.setdefault(r.layer, np.asarray(r.counts, dtype=np.float64))
        layers = [by_layer.get(l % len(trace.layers), next(iter(by_layer.values()))) for l in range(model.moe_layers)]
        out.append(layers)
    if steps > len(groups):
        notes.append(f"trace has {len(groups)} steps; replayed cyclically for {steps}")
    if len(trace.layers) != model.moe_layers:
        notes.append(f"trace has {len(trace.layers)} MoE layer(s), model {model.moe_layers}: layers reuse the trace's "
                     "layers cyclically")
    return out, notes


def _explicit_counts(counts: Sequence[Sequence[Any]], model: ModelShape, world: int,
                     steps: int) -> List[List[np.ndarray]]:
    """Validate ``counts[step][layer]`` ([world, experts] each) and convert to arrays; layers of a step with equal
    counts share one array, so the simulator's layer classes (identical routing at every step) still form."""
    if len(counts) != steps:
        raise HecateError(f"simulate: counts has {len(counts)} step(s), expected steps={steps}")
    out: List[List[np.ndarray]] = []
    for s, layers in enumerate(counts):
        if len(layers) != model.moe_layers:
            raise HecateError(f"simulate: counts[{s}] has {len(layers)} layer(s), model {model.name} has "
                              f"{model.moe_layers} MoE layers")
        row: List[np.ndarray] = []
        for layer, c in enumerate(layers):
            arr = np.asarray(c, dtype=np.float64)
            if arr.shape != (world, model.num_experts) or (arr < 0).any():
                raise HecateError(f"simulate: counts[{s}][{layer}] must be a non-negative [world={world}, "
                                  f"experts={model.num_experts}] matrix, got shape {arr.shape}")
            same = next((prev for prev in row if np.array_equal(prev, arr)), None)
            row.append(same if same is not None else arr)
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------------------
def _memory(system: str, ctx: SimContext, replicas_per_layer: List[Tuple[bool, np.ndarray]], flex_slots: int) -> int:
    """Model-state bytes of the largest rank: dense under ZeRO, owned experts (Hecate's shard store, or DeepSpeed's
    ZeRO partitioning over the expert-data-parallel group for the EP family), replicas or reserved slots
    (:mod:`ds_hecate.sim.model_state`)."""
    dense = sum(dense_state_bytes(ctx.model.dense_params, ctx.world, ctx.zero_stage, ctx.precision,
                                  ctx.optimizer.bytes_per_param))
    layers = ctx.model.moe_layers
    owned = ctx.owned_per_rank * layers
    if system in ("hecate", "hecate-rm", "ideal"):
        experts = (owned * owned_expert_state(ctx.numel, ctx.edp_size, ctx.zero_stage, ctx.precision,
                                              ctx.optimizer).total
                   + transient_grad_bytes(ctx.numel, ctx.owned_per_rank, ctx.edp_size, ctx.zero_stage))
    else:
        experts = ep_expert_state_bytes(owned * ctx.numel, ctx.edp_size, ctx.zero_stage, ctx.precision, ctx.optimizer)
    extra = 0.0
    if replicas_per_layer:
        reps = np.stack([r for _, r in replicas_per_layer])          # [layers, world], max over steps per layer
        rm = np.array([m for m, _ in replicas_per_layer])            # layers that re-materialize
        param, grad = ctx.numel * ctx.compute_b, ctx.numel * ctx.grad_b
        if system in ("hecate", "hecate-rm"):
            # every resident layer's replicas at once, one re-materializing layer's while it runs, and one layer's
            # replica gradients at a time (each layer's go with its SparseReduceScatter)
            resident = reps[~rm].sum(axis=0) if (~rm).any() else np.zeros(reps.shape[1])
            transient = reps[rm].max(axis=0) if rm.any() else np.zeros(reps.shape[1])
            extra = float((resident * param + transient * param + reps.max(axis=0) * grad).max())
        elif system == "fastermoe":
            extra = float((reps.sum(axis=0) * (param + grad)).max())
    if system == "flexmoe":   # reserved slots keep a full optimizer state each
        extra = flex_slots * layers * ctx.numel * ctx.state_bytes_per_param
    return int(dense + experts + extra)


# ---------------------------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------------------------
def simulate(cluster: Union[str, Cluster], model: Union[str, ModelShape], workload: str,
             settings: SimSettings = DEFAULT_SETTINGS, *, systems: Sequence[str] = SYSTEMS,
             counts: Optional[Sequence[Sequence[Any]]] = None) -> SimResult:
    """Simulate ``settings.steps`` training steps of ``model`` on ``cluster`` under ``workload`` for each of
    ``systems`` (the rest of the setting: :class:`~ds_hecate.sim.settings.SimSettings`).

    ``workload``: W0..W7 or a trace file (ds_hecate.trace). Returns per-system results; speedups are against ``ep``
    and fractions against ``ideal`` when those are among ``systems``.

    ``counts``: explicit routing to replay instead of generating it from ``workload`` (then only a label):
    ``counts[step][layer]`` is a ``[world, experts]`` matrix of token-expert pairs, for every one of ``steps`` steps
    and ``model.moe_layers`` layers. What the benchmark's calibration passes (:mod:`.calibration`), so the
    simulator replays exactly the counts a measured run forced, trace rescaling included.

    Groups that split a node are not modelled (an error). Host planning is charged as the runtime runs it:
    :func:`~ds_hecate.planning.search.critical_path.plan_after_gate` for one rank, and the prediction-driven search,
    counted by its work models (:mod:`~ds_hecate.planning.search.call_work`,
    :class:`~ds_hecate.planning.search.work.SearchWork`) unless ``settings.planning_clock`` is ``thread``.
    """
    start_wall = time.perf_counter()
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise HecateError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    cl = resolve_cluster(cluster)
    if settings.call_overhead_fit is not None:
        cl = cl.charged_by(settings.call_overhead_fit)
    mdl = resolve_model(model)
    if settings.world_size is not None:
        cl = cl.with_world_size(settings.world_size)
    s = settings
    tokens = s.tokens_per_rank or mdl.tokens_per_rank
    hecate = _hecate_config(s, cl)
    ep_size = _ep_size(cl, mdl, s.ep_size if s.ep_size is not None else hecate.ep_size)
    ctx = _context(cl, mdl, tokens, hecate, s, ep_size)
    if counts is None:
        counts, notes = _workload_counts(workload, mdl, cl.world_size, s.steps, tokens, s.seed)
    else:
        counts, notes = _explicit_counts(counts, mdl, cl.world_size, s.steps), []
    # Layers whose routing is identical at every step behave identically (the planner is deterministic):
    # simulate one of each class and weight it by the class size.
    classes: Dict[Tuple[int, ...], List[int]] = {}
    for layer in range(mdl.moe_layers):   # layers sharing the same count arrays at every step
        classes.setdefault(tuple(id(counts[step][layer]) for step in range(s.steps)), []).append(layer)
    fixed = _fixed_step_s(ctx)
    layer_classes = [(layers, _group_classes(counts, layers[0], ctx)) for layers in classes.values()]
    results = {system: _simulate_system(system, ctx, counts, layer_classes, s.steps, s.warmup, fixed, notes)
               for system in systems}
    for r in results.values():
        if "ep" in results:
            r.speedup_vs_ep = results["ep"].step_time_s / r.step_time_s
        if "ideal" in results:
            r.fraction_of_ideal = results["ideal"].step_time_s / r.step_time_s
    if s.force_balanced:
        # the same setting, resolved, on the routing forced uniform
        resolved = replace(s, world_size=None, tokens_per_rank=tokens, hecate=hecate, materialize_budget_mb=None,
                           force_balanced=False, ep_size=ep_size)
        _add_force_balanced(results, counts, lambda forced: simulate(cl, mdl, workload, resolved, systems=systems,
                                                                     counts=forced))
    return SimResult(cluster=cl, model=mdl, workload=workload, world_size=cl.world_size, steps=s.steps,
                     warmup=s.warmup, systems=results, wall_s=time.perf_counter() - start_wall, notes=notes,
                     ep_size=ep_size, edp_size=ctx.edp_size, call_overhead=call_overhead_note(cl, s))


def call_overhead_note(cluster: Cluster, settings: SimSettings) -> str:
    """``per-call overhead: ...``: which fit charged the cluster, from what and how old on today's date, or that
    none was charged."""
    if not settings.charge_call_overhead:
        return f"per-call overhead: not charged ({cluster.name}, --no-call-overhead)"
    return "per-call overhead: " + cluster.call_overhead_note(datetime.datetime.now(datetime.timezone.utc).date())


def _hecate_config(settings: SimSettings, cl: Cluster) -> HecateConfig:
    """The ``hecate`` config the Hecate systems plan with: the given one (its replica memory replaced by
    ``materialize_budget_mb`` if that is given), else defaults with ``materialize_budget_mb`` or 10% of device
    memory."""
    budget = settings.materialize_budget_mb
    if settings.hecate is None:
        return HecateConfig(enabled=True, materialize_budget_mb=float(
            budget if budget is not None else 0.1 * cl.device_memory_gb * 1024.0))
    if budget is not None:
        return settings.hecate.model_copy(update={"materialize_budget_mb": float(budget)})
    return settings.hecate


def _add_force_balanced(results: Dict[str, SystemResult], counts, run: Callable[[Any], SimResult]) -> None:
    """Every system's step on the same routing forced uniform (:func:`~ds_hecate.planning.balance.force_uniform`:
    same pairs per rank, spread evenly over the experts, simulated by ``run``) and that step's fraction of its
    own."""
    forced = force_uniform_steps(counts)
    # routing that is already uniform is its own force-balanced run (re-simulating it would only add noise)
    same = all(np.array_equal(f, c) for fs, cs in zip(forced, counts) for f, c in zip(fs, cs))
    uniform = None if same else run(forced)
    for name, r in results.items():
        r.force_balanced_step_s = r.step_time_s if uniform is None else uniform.systems[name].step_time_s
        r.force_balanced_fraction = r.force_balanced_step_s / r.step_time_s


def _ep_size(cl: Cluster, mdl: ModelShape, explicit: Optional[int]) -> int:
    """The runtime's rule for the group size ``ep_size``; groups the time model cannot place on whole nodes are
    refused."""
    rpn = cl.devices_per_node
    ep_size, _ = resolve_ep_size(explicit, (), cl.world_size, mdl.num_experts, rpn)
    if ep_size % rpn and rpn % ep_size:
        raise HecateError(f"simulate: expert-parallel groups of {ep_size} ranks do not align with nodes of {rpn}")
    return ep_size


def _group_classes(counts, layer: int, ctx: SimContext) -> List[List[int]]:
    """Groups of one layer whose counts are equal at every step (planned once: the planner is deterministic)."""
    size = ctx.ep_size
    by_history: Dict[Tuple[bytes, ...], List[int]] = {}
    for g in range(ctx.world // size):
        history = tuple(np.ascontiguousarray(step[layer][g * size:(g + 1) * size]).tobytes() for step in counts)
        by_history.setdefault(history, []).append(g)
    return list(by_history.values())


def _wire_bytes(hecate: HecateConfig, precision: str, stage: str) -> int:
    return 4 if wire_dtype(hecate.reduce_dtype, precision, stage) == "fp32" else 2


def _context(cl: Cluster, mdl: ModelShape, tokens: int, hecate: HecateConfig, settings: SimSettings,
             ep_size: int) -> SimContext:
    """The simulated setting: unit costs from the cluster's FLOP rate unless it carries measured ones."""
    flops = cl.device_tflops * 1e12
    s = settings
    return SimContext(cluster=cl, model=mdl, world=cl.world_size, rpn=cl.devices_per_node, tokens=tokens,
                      compute_b=4 if s.precision == "fp32" else 2,
                      grad_b=_wire_bytes(hecate, s.precision, "sparse_reduce_scatter"),
                      edp_grad_b=_wire_bytes(hecate, s.precision, "expert_data_parallel"),
                      s_per_pair=cl.compute_s_per_pair or 6.0 * mdl.expert_params / flops,
                      t_fwd=(cl.non_moe_time_s if cl.non_moe_time_s is not None
                             else mdl.non_moe_flops_per_layer(tokens) / 3.0 / flops),
                      hecate=hecate, optimizer=s.optimizer, zero_stage=s.zero_stage, precision=s.precision,
                      ep_size=ep_size, spag=s.spag,
                      planner_costs=(None if s.planner_costs is None
                                     else {k: float(v) for k, v in s.planner_costs.items()}),
                      charge_planning=s.charge_planning, planning_clock=s.planning_clock,
                      charge_call_overhead=s.charge_call_overhead,
                      planner_token_price=float(s.planner_token_price))


def _fixed_step_s(ctx: SimContext) -> float:
    """Per-step time outside the MoE layers' expert work: non-MoE compute of every block, dense blocks,
    embeddings and the cluster's fixed time (identical for every system)."""
    cl, mdl, tokens = ctx.cluster, ctx.model, ctx.tokens
    flops = cl.device_tflops * 1e12
    if cl.non_moe_time_s is not None and cl.compute_s_per_pair is not None:
        # calibrated: the measured T_nonMoE already holds everything between MoE layers
        return 3 * ctx.t_fwd * mdl.moe_layers + cl.fixed_step_s
    return (3 * ctx.t_fwd * mdl.moe_layers
            + (6.0 * (mdl.attention_params_per_layer + 3 * mdl.hidden_size * mdl.dense_ffn_size) * tokens
               + 12.0 * mdl.seq_len * mdl.hidden_size * tokens) * mdl.dense_layers / flops
            + 6.0 * mdl.vocab_size * mdl.hidden_size * tokens / flops
            + cl.fixed_step_s)


def _pool_classes(system: str, ctx: SimContext, classes: List[Tuple[List[int], List[List[int]]]]):
    """``classes`` split by the replica pool's grant (Hecate systems: identically routed layers plan alike only
    with the same slots; the rolling share gives layers one of two sizes), as (layers, group classes, grant or
    None)."""
    if system not in ("hecate", "hecate-rm"):
        return [(layers, groups, None) for layers, groups in classes]
    grants = replica_pool(ctx, system).grants
    out: List[Tuple[List[int], List[List[int]], Any]] = []
    for layers, groups in classes:
        by_grant: Dict[Any, List[int]] = {}
        for layer in layers:
            by_grant.setdefault(grants[layer], []).append(layer)
        out.extend((members, groups, grant) for grant, members in by_grant.items())
    return out


def _simulate_system(system: str, ctx: SimContext, counts, classes: List[Tuple[List[int], List[List[int]]]],
                     steps: int, warmup: int, fixed: float, notes: List[str]) -> SystemResult:
    """One system through every step, one simulated layer per class of identically routed layers (each with its
    classes of identically routed groups)."""
    world, mdl = ctx.world, ctx.model
    totals = np.zeros(steps)
    parts = {k: np.zeros(steps) for k in ("compute", "all_to_all", "exposed_comm", "edp_reduce", "rearrange",
                                          "host_planning", "call_overhead")}
    imbalance, reps_sum, reps_n = [], 0.0, 0
    replicas_by_layer: List[Tuple[bool, np.ndarray]] = []
    for layers, group_classes, grant in _pool_classes(system, ctx, classes):
        sim = make_system(system, ctx, group_classes, grant)
        note = getattr(sim, "note", "")
        if note and note not in notes:
            notes.append(note)
        weight = len(layers)
        peak_reps = np.zeros(world)
        for s in range(steps):
            lt, rearrange = sim.step(s, counts[s][layers[0]])
            overhead = (ctx.cluster.layer_overhead_s if system != "ideal" else 0.0) + call_overhead_s(system, ctx, lt)
            planning = getattr(sim, "planning_s", 0.0)
            totals[s] += weight * (lt.total + rearrange + overhead + planning + sim.edp_reduce_s)
            parts["host_planning"][s] += weight * planning
            parts["edp_reduce"][s] += weight * sim.edp_reduce_s
            parts["compute"][s] += weight * lt.compute
            parts["all_to_all"][s] += weight * lt.a2a
            parts["exposed_comm"][s] += weight * lt.exposed
            parts["rearrange"][s] += weight * rearrange
            parts["call_overhead"][s] += weight * overhead
            if s >= warmup:
                imbalance.append(lt.imbalance)
                reps_sum += float(lt.replicas.sum()) * weight
                reps_n += weight
                peak_reps = np.maximum(peak_reps, lt.replicas)
        replicas_by_layer.extend([(grant is not None and grant.rematerialize, peak_reps)] * weight)
    totals += fixed
    measured = totals[warmup:]
    return SystemResult(
        system=system, step_times_s=[float(t) for t in totals], step_time_s=float(measured.mean()),
        peak_memory_bytes=_memory(system, ctx, replicas_by_layer, max(1, mdl.num_experts // ctx.ep_size)),
        imbalance=float(np.mean(imbalance)) if imbalance else 1.0,
        replicas_per_layer=reps_sum / reps_n if reps_n else 0.0,
        breakdown_s={**{k: float(v[warmup:].mean()) for k, v in parts.items()}, "non_moe": fixed})


def call_overhead_s(system: str, ctx: SimContext, lt) -> float:
    """The layer call's runtime overhead over the plain grouped-GEMM layer (:mod:`.overhead`), for the slowest
    rank: its token-expert pairs and the experts it owns (a group's ranks own ``num_experts / ep_size`` each)."""
    model = ctx.cluster.call_overheads().for_system(system)
    if lt.processed is None or not ctx.charge_call_overhead:
        return 0.0
    owned_bytes = ctx.owned_per_rank * ctx.numel * ctx.compute_b
    return float(model.seconds(np.asarray(lt.processed, dtype=float), ctx.row_bytes, owned_bytes).max())


def format_table(result: SimResult) -> str:
    """The table ``ds-hecate simulate`` prints."""
    cl, mdl = result.cluster, result.model
    ep_size = result.ep_size or result.world_size
    head = (f"cluster {cl.name}: {result.world_size} devices ({cl.nodes} node(s) x {cl.devices_per_node}); model "
            f"{mdl.name}: {mdl.moe_layers} MoE layers x {mdl.num_experts} experts, top-{mdl.top_k}; workload "
            f"{result.workload}; {result.steps} steps ({result.warmup} warm-up not averaged); ep_size {ep_size} "
            + ("(one group)" if result.edp_size == 1 else
               f"({result.edp_size} groups, expert-data-parallel across them)"))
    cols = ("system", "step ms", "vs EP", "of ideal", "of force-balanced", "peak GiB/rank", "imbalance",
            "replicas/layer", "compute ms", "a2a ms", "exposed ms", "edp ms", "rearr ms", "call ms")
    rows = [cols]
    for r in result.systems.values():
        b = r.breakdown_s
        rows.append((r.system, f"{r.step_time_s * 1e3:.2f}", f"{r.speedup_vs_ep:.2f}x",
                     f"{r.fraction_of_ideal * 100:.1f}%", f"{r.force_balanced_fraction * 100:.1f}%",
                     f"{r.peak_memory_bytes / (1 << 30):.2f}",
                     f"{r.imbalance:.2f}", f"{r.replicas_per_layer:.1f}", f"{b['compute'] * 1e3:.2f}",
                     f"{b['all_to_all'] * 1e3:.2f}", f"{b['exposed_comm'] * 1e3:.2f}",
                     f"{b.get('edp_reduce', 0.0) * 1e3:.2f}", f"{b['rearrange'] * 1e3:.2f}",
                     f"{b.get('call_overhead', 0.0) * 1e3:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = [head, ""]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"simulated in {result.wall_s:.1f} s wall time")
    lines.append(result.call_overhead)
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)
