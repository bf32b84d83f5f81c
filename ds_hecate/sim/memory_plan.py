"""Memory per rank before launch (``ds-hecate plan``), from the same budget formulas the runtime uses.

The replica budget and the scheduler's costs come from :mod:`ds_hecate.planning.cost_model` (as in the runtime:
``LayerBinding.replica_budget``, ``HecateRuntime.step_costs``), the Hecate domain (``hecate.ep_size``) from
:func:`ds_hecate.planning.groups.resolve_ep_size` (the runtime's rule), and the byte accounting from
:mod:`ds_hecate.sim.model_state`, which the simulator's memory column uses too. The expert accounting follows the
shard store's tensors: fp32 masters (``model_state.MASTER_BYTES_PER_PARAM``, ``LayerShard.set_masters``), fp32 gradient
accumulators (``LayerShard.accumulate``) and the optimizer state the expert optimizer class creates, probed by
stepping that class once on a tiny tensor (the same vector/scalar split re-sharding uses). So with one group the plan
and ``engine.hecate.memory_bytes()`` agree to the byte (tests/test_plan_cli.py checks it on a real 2-rank run). With
bf16/fp16 compute the resident compute-dtype weights are counted (``expert_weights``; with fp32 the masters are
them). With several groups the masters and optimizer state are partitioned over the expert-data-parallel peers under
ZeRO >= 1, and the resident full copy in the compute dtype is counted whatever the precision.

Dense parameters (everything DeepSpeed keeps) follow ZeRO's usual accounting (``dense_state_bytes``). Activations are
not counted (they depend on batch and routing; the paper's Fig. 13 leaves them out too).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..config import wire_dtype
from ..planning.cost_model import StepCostModel, scheduler_costs
from ..planning.replica_pool import ReplicaPool
from ..planning.groups import ExpertGroups, resolve_ep_size
from ..planning.heterogeneous import slots_per_rank
from ..planning.sharding import even_sharding
from .model_state import (OptimizerStateLayout, compute_bytes, dense_state_bytes, owned_expert_state,
                               transient_grad_bytes)

__all__ = ["MemoryPlan", "format_plan", "optimizer_layout_from_ds_config", "plan_memory", "probe_optimizer_state"]


# -- optimizer state ------------------------------------------------------------------------------------------------
_TORCH_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}


def probe_optimizer_state(optimizer_cls: Any, params: Optional[Mapping[str, Any]] = None) -> OptimizerStateLayout:
    """Step ``optimizer_cls`` once on a 3-element fp32 tensor and read what state it keeps (as the expert
    optimizer does on each fp32 master)."""
    import inspect

    import torch
    from torch import nn

    accepted = set(inspect.signature(optimizer_cls.__init__).parameters)
    kwargs = {k: v for k, v in dict(params or {}).items() if k in accepted}
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    p = nn.Parameter(torch.zeros(3, dtype=torch.float32))
    opt = optimizer_cls([p], **kwargs)
    p.grad = torch.ones_like(p)
    opt.step()
    vectors, scalars = [], 0
    for value in opt.state[p].values():
        if torch.is_tensor(value):
            if value.numel() == p.numel():
                vectors.append(value.element_size())
            else:
                scalars += value.numel() * value.element_size()
    return OptimizerStateLayout(optimizer_cls.__name__, tuple(vectors), scalars)


def optimizer_layout_from_ds_config(ds_config: Mapping[str, Any]) -> OptimizerStateLayout:
    """The state layout of the optimizer a DeepSpeed config names (``optimizer.type``), as torch.optim keeps it."""
    import torch

    from ..errors import HecateConfigError

    section = ds_config.get("optimizer") or {"type": "AdamW"}
    kind = str(section.get("type", "AdamW"))
    name = _TORCH_OPTIMIZERS.get(kind.lower())
    if name is None:
        raise HecateConfigError(f"ds-hecate plan: optimizer type {kind!r} is not one it can size; known: "
                                f"{sorted(_TORCH_OPTIMIZERS)}")
    return probe_optimizer_state(getattr(torch.optim, name), section.get("params") or {})


# -- the plan -------------------------------------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    """Bytes per rank, by component. ``expert_*`` entries use the names of ``engine.hecate.memory_bytes()``."""

    world_size: int
    ranks_per_node: int
    zero_stage: int
    precision: str
    optimizer: str
    dense_params: int
    expert_params_per_expert: int
    owned_experts: List[int]                     # per rank, all layers
    dense_param_bytes: int
    dense_grad_bytes: int
    dense_optimizer_bytes: int
    expert_master: List[int]
    expert_grad: List[int]
    expert_optimizer_state: List[int]
    materialize_budget: int
    replica_pool: ReplicaPool
    replica_bytes_per_expert: int
    overlap_degree: int
    overlap_source: str
    costs: StepCostModel
    ep_size: int = 0                             # the Hecate domain G (0: the whole world, for older callers)
    edp_size: int = 1                            # R = world / G expert-data-parallel peers
    expert_weights: List[int] = field(default_factory=list)   # resident compute-dtype copies (none: fp32 whole)
    notes: List[str] = field(default_factory=list)

    def weights(self, rank: int) -> int:
        return self.expert_weights[rank] if self.expert_weights else 0

    def rank_total(self, rank: int) -> int:
        return (self.dense_param_bytes + self.dense_grad_bytes + self.dense_optimizer_bytes + self.weights(rank)
                + self.expert_master[rank] + self.expert_grad[rank] + self.expert_optimizer_state[rank]
                + self.materialize_budget)

    @property
    def peak_rank(self) -> int:
        return max(range(self.world_size), key=lambda r: (self.rank_total(r), -r))

    def expert_memory_bytes(self, rank: int) -> Dict[str, int]:
        """The keys of ``HecateRuntime.memory_bytes()`` this plan predicts for ``rank`` (``expert_weights`` only
        where a resident copy exists besides the masters: bf16/fp16 compute or partitioned masters)."""
        out = {"expert_master": self.expert_master[rank], "expert_grad": self.expert_grad[rank],
               "expert_optimizer_state": self.expert_optimizer_state[rank],
               "materialize_budget": self.materialize_budget}
        if self.weights(rank):
            out["expert_weights"] = self.weights(rank)
        return out


def plan_memory(model: Any, hecate: Any, world_size: int, ranks_per_node: int, zero_stage: int, precision: str,
                optimizer: OptimizerStateLayout, cluster: Any = None,
                owners_per_layer: Optional[Sequence[Sequence[int]]] = None,
                ep_size: Optional[int] = None) -> MemoryPlan:
    """Memory per rank for ``model`` (:class:`ds_hecate.sim.presets.ModelShape`) under ``hecate`` (HecateConfig).

    The Hecate domain is ``ep_size`` if given, else the config's ``hecate.ep_size``, resolved by the runtime's rule
    (:func:`~ds_hecate.planning.groups.resolve_ep_size`). Expert shards follow the runtime's initial even sharding of
    every layer inside a group, the same in every group (``owners_per_layer``, local ranks of a group, overrides it,
    e.g. after heterogeneous re-sharding, which keeps the groups alike). ``cluster``
    (:class:`ds_hecate.sim.presets.Cluster`), when given, supplies the bandwidth and T_nonMoE estimate for the overlap
    degree where the config leaves them null.
    """
    compute_b = compute_bytes(precision)
    numel = model.expert_params
    ep_size, warning = resolve_ep_size(ep_size if ep_size is not None else hecate.ep_size, (), world_size, model.num_experts, ranks_per_node)
    groups = ExpertGroups(world_size, ep_size, ranks_per_node)
    owners = ([even_sharding(model.num_experts, ep_size) for _ in range(model.moe_layers)]
              if owners_per_layer is None else [tuple(o) for o in owners_per_layer])
    owned_local = [sum(list(o).count(r) for o in owners) for r in range(ep_size)]
    owned = [owned_local[groups.local_rank(r)] for r in range(world_size)]
    most_per_layer = max(list(o).count(r) for o in owners for r in range(ep_size))   # one layer, fullest rank
    transient = transient_grad_bytes(numel, most_per_layer, groups.edp_size, zero_stage)
    state = owned_expert_state(numel, groups.edp_size, zero_stage, precision, optimizer)
    reduce_b = 4 if wire_dtype(hecate.reduce_dtype, precision, "sparse_reduce_scatter") == "fp32" else 2
    expert_bytes_compute = numel * compute_b
    dense_p, dense_g, dense_o = dense_state_bytes(model.dense_params, world_size, zero_stage, precision,
                                                  optimizer.bytes_per_param)
    notes: List[str] = [warning] if warning else []
    measured: Dict[str, float] = {}
    overlap_source = "config"
    if cluster is not None:   # the planner of a group sees a world of its G ranks
        measured["link_gbps"] = cluster.intra_node_gbps
        if ep_size > ranks_per_node:
            measured["inter_node_gbps"] = cluster.inter_node_gbps_per_device
        tokens = model.tokens_per_rank
        measured["compute_s_per_pair"] = (cluster.compute_s_per_pair or
                                          6.0 * numel / (cluster.device_tflops * 1e12))
        measured["non_moe_time_s"] = (cluster.non_moe_time_s if cluster.non_moe_time_s is not None else
                                      model.non_moe_flops_per_layer(tokens) / 3.0 / (cluster.device_tflops * 1e12))
        overlap_source = f"cluster {cluster.name}"
    if hecate.non_moe_time_s is None and hecate.overlap_degree is None and cluster is None:
        notes.append("no non_moe_time_s/overlap_degree in the config and no cluster: t = 0 until the runtime "
                     "measures T_nonMoE at the first step")
    costs = scheduler_costs(hecate, measured, ep_size, ranks_per_node,
                            expert_bytes=numel * (compute_b + reduce_b), token_bytes=4 * model.hidden_size * compute_b,
                            overlaps_compute=cluster.overlaps_compute if cluster is not None else True,
                            reduce_bytes=numel * reduce_b)
    return MemoryPlan(
        world_size=world_size, ranks_per_node=ranks_per_node, zero_stage=zero_stage, precision=precision,
        optimizer=optimizer.name, dense_params=model.dense_params, expert_params_per_expert=numel,
        owned_experts=owned, dense_param_bytes=dense_p, dense_grad_bytes=dense_g, dense_optimizer_bytes=dense_o,
        expert_master=[n * state.expert_master for n in owned],
        expert_grad=[n * state.expert_grad + (transient if n else 0) for n in owned],
        expert_optimizer_state=[n * state.expert_optimizer_state for n in owned],
        expert_weights=[n * state.expert_weights for n in owned],
        materialize_budget=int(hecate.materialize_budget_mb * (1 << 20)),
        replica_pool=ReplicaPool.plan(hecate.materialize_budget_mb, [expert_bytes_compute] * model.moe_layers,
                                      [most_per_layer] * model.moe_layers, hecate.rematerialize),
        replica_bytes_per_expert=expert_bytes_compute,
        overlap_degree=min(costs.overlap_degree, model.num_experts), overlap_source=overlap_source, costs=costs,
        ep_size=ep_size, edp_size=groups.edp_size, notes=notes)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):9.2f} GiB"


def _domain_line(plan: MemoryPlan) -> str:
    ep_size = plan.ep_size or plan.world_size
    if plan.edp_size == 1:
        return f"Hecate domain: ep_size {ep_size} (one group: every expert has one copy in the job)"
    how = ("master weights and optimizer state partitioned over them (ZeRO stage >= 1), weights all-gathered"
           if plan.zero_stage >= 1 else "each holding the full expert state (ZeRO stage 0: all-reduce)")
    return (f"Hecate domain: ep_size {ep_size} ({plan.edp_size} groups of {ep_size} consecutive ranks; each expert has "
            f"{plan.edp_size} expert-data-parallel copies, {how})")


def format_plan(plan: MemoryPlan, model: Any, device_memory_gb: float) -> str:
    """Human-readable breakdown of the peak rank, with a warning when it does not fit ``device_memory_gb``."""
    r = plan.peak_rank
    partitioned = f" (1/{plan.edp_size})" if plan.weights(r) or (plan.edp_size > 1 and plan.zero_stage >= 1) else ""
    lines = [
        f"model {model.name}: {model.total_params / 1e9:.2f}B parameters ({plan.dense_params / 1e9:.2f}B dense, "
        f"{model.expert_params_total / 1e9:.2f}B in {model.moe_layers} x {model.num_experts} experts of "
        f"{plan.expert_params_per_expert:,})",
        f"world size {plan.world_size} ({max(1, plan.world_size // plan.ranks_per_node)} node(s) x "
        f"{min(plan.ranks_per_node, plan.world_size)}), ZeRO stage {plan.zero_stage}, {plan.precision}, "
        f"optimizer {plan.optimizer}",
        _domain_line(plan),
        f"memory per rank (rank {r}, the largest; activations not included):",
        f"  dense params                 {_gib(plan.dense_param_bytes)}",
        f"  dense grads                  {_gib(plan.dense_grad_bytes)}",
        f"  dense optimizer states       {_gib(plan.dense_optimizer_bytes)}",
        f"  expert shards: {plan.owned_experts[r]} experts owned (min {min(plan.owned_experts)}, max "
        f"{max(plan.owned_experts)} over ranks)",
    ]
    if plan.weights(r):
        lines.append(f"    weights ({plan.precision}, whole)      {_gib(plan.weights(r))}  ({plan.weights(r):,} B)")
    lines += [
        f"    master weights (fp32){partitioned:<6} {_gib(plan.expert_master[r])}  ({plan.expert_master[r]:,} B)",
        f"    gradients (fp32)           {_gib(plan.expert_grad[r])}  ({plan.expert_grad[r]:,} B)",
        f"    optimizer states{partitioned:<10} {_gib(plan.expert_optimizer_state[r])}  "
        f"({plan.expert_optimizer_state[r]:,} B)",
        f"  materialization budget       {_gib(plan.materialize_budget)}",
        f"  total                        {_gib(plan.rank_total(r))}",
        f"scheduler: memory cap: {plan.replica_pool.describe()} "
        f"({plan.replica_bytes_per_expert / (1 << 20):.1f} MiB each), "
        f"overlap degree t = {plan.overlap_degree} "
        f"(from {plan.overlap_source}: T_nonMoE {plan.costs.overlap_s * 1e3:.2f} ms, expert transfer "
        f"{plan.costs.slowest_expert_transfer_s * 1e3:.2f} ms)",
    ]
    if max(plan.owned_experts) - min(plan.owned_experts) > 1:
        balanced = max(slots_per_rank(sum(plan.owned_experts), plan.world_size))
        per_expert = (plan.expert_master[r] + plan.expert_grad[r]) / max(1, plan.owned_experts[r])
        lines.append(f"note: the initial even sharding of each layer leaves ranks with {min(plan.owned_experts)}.."
                     f"{max(plan.owned_experts)} experts; heterogeneous re-sharding (reshard_interval) balances them "
                     f"to {balanced} per rank ({balanced * per_expert / (1 << 30):.2f} GiB master+grad)")
    lines += [f"note: {n}" for n in plan.notes]
    limit = device_memory_gb * (1 << 30)
    if plan.rank_total(r) > limit:
        lines.append(f"WARNING: rank {r} needs {plan.rank_total(r) / (1 << 30):.2f} GiB before activations, more "
                     f"than the {device_memory_gb:g} GiB device memory: it will not fit (raise the world size, the "
                     f"ZeRO stage, or lower materialize_budget_mb)")
    else:
        lines.append(f"fits: {plan.rank_total(r) / (1 << 30):.2f} GiB of {device_memory_gb:g} GiB before activations")
    return "\n".join(lines)
