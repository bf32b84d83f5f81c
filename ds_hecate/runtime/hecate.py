"""The Hecate runtime of one rank: its layers, the call order and prefetch, the expert update and statistics.

A layer call is :class:`~ds_hecate.runtime.layer.LayerBinding`'s, which reads of the runtime only what
:class:`~.host.LayerHost` names; this module holds what spans layers and steps: the setup every layer shares, the
call sequence and its prefetch, the queue of SparseReduceScatters, the gradient norm and the expert optimizer step,
cost profiling and re-shard triggers, consolidation.
With groups (``hecate.ep_size``) ``comm`` and ``rank`` are the rank's group's and ``ep_size`` its size (what its
layers plan and gather over) and :attr:`HecateRuntime.layout` holds the world and expert-data-parallel side (:mod:`.edp`).
Observers (step metrics, routing trace) are registered by whoever builds the runtime
(:func:`ds_hecate.deepspeed_glue.initialize.build_runtime`), not imported here.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..comm.collectives import CommCounters, Communicator
from ..config import HecateConfig, wire_dtype
from ..logging_utils import logger
from ..planning import Placement
from ..planning.cost_model import StepCostModel, scheduler_costs
from ..planning.replica_pool import LayerGrant, ReplicaPool
from ..planning.groups import data_parallel_ranks_per_node
from .call_monitor import CallMonitor
from .call_sequence import CallSequence
from .edp import GroupLayout, reduce_gradients, reduce_layer, refresh_weights, whole_masters
from .host import LayerSetup
from .interfaces import ExpertStepper
from .layer import LayerBinding, in_backward_pass
from .phases import PHASES
from .profiling import WARM_PROFILE_STEP, expert_work, measure_costs
from .reductions import ReductionQueue
from .shard_store import ExpertShardStore, LayerShard
from .stops import Stops


__all__ = ["HecateRuntime", "LayerBinding", "PHASES"]


def group_ranks_per_node(ep_size: int, ranks_per_node: int) -> int:
    """Ranks per node as a group's planner sees its ``ep_size`` consecutive ranks: the group itself when it fits
    in a node, whole nodes when it spans several; a group that splits nodes (accepted with a warning) plans with the
    largest common block."""
    if ranks_per_node % ep_size == 0:
        return ep_size
    if ep_size % ranks_per_node == 0:
        return ranks_per_node
    return math.gcd(ep_size, ranks_per_node)


class HecateRuntime:
    """Everything Hecate holds on one rank: process group, shards, plans, expert optimizer and statistics."""

    def __init__(self, config: HecateConfig, comm: Communicator, compute_dtype: torch.dtype,
                 ranks_per_node: int, layout: Optional[GroupLayout] = None) -> None:
        self.config = config
        self.comm = comm   # the rank's group (token and weight traffic of its layer calls)
        self.rank = comm.rank   # in the group
        self.ep_size = comm.world_size   # the group's size, hecate.ep_size
        self.layout = layout if layout is not None else GroupLayout.single(comm, ranks_per_node)
        self.stops = Stops(self.layout)   # bad gates: every rank of every group stops with the same error
        self.compute_dtype = compute_dtype
        compute = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute_dtype, "fp32")
        wire = {"bf16": torch.bfloat16, "fp32": torch.float32}
        self.reduce_dtype = wire[wire_dtype(config.reduce_dtype, compute, "sparse_reduce_scatter")]
        self.edp_reduce_dtype = wire[wire_dtype(config.reduce_dtype, compute, "expert_data_parallel")]
        self.global_ranks_per_node = ranks_per_node
        # the group's node layout (with tensor parallelism the group is one TP rank's data-parallel ranks)
        self.ranks_per_node = group_ranks_per_node(
            self.ep_size, data_parallel_ranks_per_node(ranks_per_node, self.layout.tensor_parallel_size))
        self.expert_group_name: Optional[str] = None   # its groups' name in DeepSpeed's registry (initialize sets it)
        self._reduced = False   # the EDP reduction of this accumulation window has run
        #: the backward in progress ends an accumulation window (set by the engine; reductions may go early)
        self.at_boundary = False
        self.device = comm.device   # the rank's working device: every tensor Hecate creates lives there
        self.store = ExpertShardStore(self.device)
        self.bindings: List[LayerBinding] = []
        self.layer_names: List[str] = []
        self.optimizer: Optional[ExpertStepper] = None
        self.layer_group: Dict[int, int] = {}  # layer id -> expert optimizer param group
        self.last_total_norm: Optional[torch.Tensor] = None
        self.steps_applied = 0
        self.steps_skipped = 0
        self.nonfinite_grad_steps = 0   # steps with a non-finite gradient in one of this rank's experts
        self.nonfinite_grad_steps_any_rank = 0   # steps with one in any rank's experts (where a norm decides)
        self.norm_from_optimizer = False  # set by the norm hook when DeepSpeed's optimizer computes the joint norm
        self.last_nonfinite_grads: Optional[dict] = None
        self.reshards = 0
        self.measured: Dict[str, float] = {}
        self._work_at_profile: Optional[Tuple[int, float]] = None   # expert_work() when costs were last measured
        self.overlaps_compute = torch.cuda.is_available()
        self.global_steps = 0  # optimizer steps done (engine.global_steps), for the trace's step numbers
        # held for whoever reads them, never called here (the builder installs them as observers):
        self.metrics: Optional[object] = None   # ds_hecate.deepspeed_glue.monitor.StepMetrics
        self.trace: Optional[object] = None     # ds_hecate.deepspeed_glue.monitor.TraceRecorder (rank 0, trace_file)
        self._pool: Optional[Tuple[tuple, ReplicaPool]] = None   # (its inputs, the pool)
        self._costs: Dict[int, Tuple[object, bool, StepCostModel]] = {}   # layer -> (measured, regather, costs)
        # What every layer reads of the runtime (runtime/host.py): the group's fixed setup, the call sequence, the
        # queue of SparseReduceScatters, the instruments (phases are timed until the cost model has its steady-state
        # figures, and throughout with hecate.profile).
        self.setup = LayerSetup(comm, self.rank, self.ep_size, self.ranks_per_node, self.device, compute_dtype,
                                self.reduce_dtype, config, self.layout.tensor_parallel, self.stops,
                                self.relays_stream_ordered)
        self.sequence: CallSequence[LayerBinding] = CallSequence(self.bindings)
        self.monitor = CallMonitor(self.device, profiling=True)
        self.reductions = ReductionQueue(eager=lambda: self.at_boundary and self.layout.partitioned,
                                         on_complete=lambda layer: reduce_layer(self, layer.shard),
                                         timed=lambda layer: layer.phases("reduce_wait"))

    # -- setup --------------------------------------------------------------------------------------------------
    def add_layer(self, name: str, shard: LayerShard, hidden_size: int) -> LayerBinding:
        self.store.add(shard)
        binding = LayerBinding(self, len(self.bindings), shard, hidden_size)
        self.bindings.append(binding)
        self.layer_names.append(name)
        return binding

    @property
    def pool(self) -> ReplicaPool:
        """Every layer's share of ``materialize_budget_mb`` (:mod:`ds_hecate.planning.replica_pool`), layers in
        registration order; planned once per set of layers and budget (a function of the config: every rank holds
        the same)."""
        key = (len(self.bindings), self.config.materialize_budget_mb, self.config.rematerialize)
        if self._pool is None or self._pool[0] != key:
            self._pool = (key, ReplicaPool.plan(self.config.materialize_budget_mb,
                                                [b.expert_bytes for b in self.bindings],
                                                [-(-b.shard.num_experts // self.ep_size) for b in self.bindings],
                                                self.config.rematerialize))
        return self._pool[1]

    @property
    def rematerialize(self) -> bool:
        """Whether any layer re-materializes (``hecate.rematerialize`` resolved per layer by the pool)."""
        return self.pool.rematerializes

    def grant(self, binding: LayerBinding) -> LayerGrant:
        """``binding``'s slots in the pool."""
        return self.pool.grants[binding.index]

    def take_experts(self, shard: LayerShard, sources: Sequence[int], local: Dict[int, torch.Tensor]) -> None:
        """Give ``shard`` its owned experts at take-over: expert ``e`` comes from global rank ``sources[e]`` (the
        rank whose copy DeepSpeed would have broadcast) to its owner in every group, then, partitioned, each peer
        keeps its slice. Collective over the world."""
        owners = self.layout.owners_everywhere(shard.owners)
        masters = self.layout.world.move_experts(sources, owners, local, shard.kernel.numel)
        shard.set_masters(masters, self.layout.partition_for(shard.kernel.numel), self.compute_dtype)

    def step_costs(self, binding: LayerBinding) -> StepCostModel:
        """Cost model for the scheduler: configured values, else measured ones (identical on all ranks); one
        object per layer until the measured figures change."""
        # One formula for the runtime, ``ds-hecate plan`` and the simulator (ds_hecate.planning.cost_model).
        regather = binding.rematerializes
        cached = self._costs.get(binding.index)
        if cached is not None and cached[0] is self.measured and cached[1] == regather:
            return cached[2]
        costs = scheduler_costs(self.config, self.measured, self.ep_size, self.ranks_per_node,
                                binding.cost.expert_bytes, binding.cost.token_bytes(1), self.overlaps_compute,
                                relays_stream_ordered=self.relays_stream_ordered,
                                reduce_bytes=binding.cost.reduce_bytes, regather=regather)
        self._costs[binding.index] = (self.measured, regather, costs)
        return costs

    @property
    def relays_stream_ordered(self) -> bool:
        """Whether the weight transport issues every relay level when a sparse collective starts (NCCL on CUDA):
        the relay trees are built (the tree of nodes, ``planning.fanout.node_fanout``) and priced as it runs them."""
        return bool(getattr(self.comm.weights, "stream_ordered", False))

    # -- call sequence and prefetch ---------------------------------------------------------------------------
    def on_model_forward(self) -> None:
        """Start of a model forward (a micro-step): forget the previous forward's plans, prefetch the first
        layer."""
        if in_backward_pass():
            return
        self.monitor.model_forward()
        for b in self.bindings:
            b.planner.model_forward()
        first = self.sequence.first()
        if first is not None and self.config.prefetch:
            first.start_prefetch()

    def drop_pending(self) -> None:
        """Complete and discard prefetches (before weights change); every rank holds the same pending set."""
        for b in self.bindings:
            b.gathers.drop_pending()

    @property
    def peak_replica_bytes(self) -> int:
        return self.monitor.memory.total.peak

    # -- gradient norm and step -------------------------------------------------------------------------------
    def flush_reductions(self, keep: int = 0) -> None:
        """Wait for the SparseReduceScatters issued in backward (in issue order, all but the ``keep`` newest) and
        accumulate the results (:class:`~.reductions.ReductionQueue`: at the accumulation boundary with partitioned
        expert state each completed layer goes on to its EDP reduction at once)."""
        self.reductions.flush(keep)

    def reduce_across_groups(self) -> None:
        """At the accumulation boundary, once: the group's reductions flushed, then the EDP reduction (sum over the
        groups: :func:`.edp.reduce_gradients`). Collective."""
        self.flush_reductions()
        if not self._reduced:
            reduce_gradients(self)
            self._reduced = True

    def expert_grad_norm(self, grad_divisor: float) -> torch.Tensor:
        """L2 norm over all ranks of the (averaged, still loss-scaled) expert gradients, each counted once: whole
        gradients of one group (unpartitioned, every group holds the same sums), or every peer's slice. Collective
        over the world."""
        self.reduce_across_groups()
        layout = self.layout
        counted = layout.edp_size == 1 or layout.partitioned or layout.edp_index == 0
        sq = self.store.grad_sq_sum() / (grad_divisor * grad_divisor)
        if not counted:
            sq = torch.zeros_like(sq)
        return layout.world.all_reduce(sq.reshape(1),
                                       collective="expert gradient-norm all-reduce").reshape(()).sqrt()

    def apply_step(self, applied: bool, dp_world_size: int, loss_scale: float, clip: float,
                   hyperparameters: Sequence[dict]) -> None:
        """Update expert masters after DeepSpeed's step decided (overflow) and computed the global norm.

        ``loss_scale`` is the factor DeepSpeed unscaled the dense gradients by in this step; ``hyperparameters``
        (scheduled lr/betas per expert group) are the values from before
        DeepSpeed's step, the ones that applied to it.

        A prefetch still in flight (a layer the last forward skipped) is completed first: on a stream-ordered
        transport its relayed SparseAllGather reads the owners' resident rows on a side stream, which the step and
        the refresh below are about to rewrite (a replica would receive torn weights).
        """
        self.drop_pending()
        self.reduce_across_groups()
        try:
            self._note_nonfinite_grads(applied)
            if not applied:
                self.steps_skipped += 1
                return
            combined = float(loss_scale)
            if clip > 0 and self.last_total_norm is not None:
                total = float(self.last_total_norm)
                if total == total and total != float("inf"):
                    combined *= max(1.0, (total / loss_scale + 1e-6) / clip)
            if self.optimizer is not None:
                self.optimizer.step(1.0 / (dp_world_size * combined), hyperparameters)
            refresh_weights(self)   # the resident compute copies from the updated masters, before the next call
            self.steps_applied += 1
        finally:
            self.store.zero_grads()
            self.last_total_norm = None
            self._reduced = False

    def _note_nonfinite_grads(self, applied: bool) -> None:
        """NaN/Inf in this rank's expert gradients: counted and named in the statistics (each rank its own experts).
        Whether the step is applied is DeepSpeed's decision (its overflow check sees them through the global norm,
        which includes the experts, or skips on the dense gradients before computing it). Skipped when this step's
        joint norm is known and finite; otherwise one host sync for all experts.

        Reported as DeepSpeed reports an overflow: one line per step, from global rank 0, with the count over all
        ranks (a one-number all-reduce, only on steps DeepSpeed skipped or whose joint norm is non-finite: both the
        same on every rank). Where a step is applied with no joint norm computed (ZeRO stage 0 in fp32 without
        clipping: nothing decides to skip), the ranks that hold a non-finite gradient warn themselves, as there is
        no collective to agree on."""
        total = self.last_total_norm
        known = total is not None
        if total is not None and 0 <= float(total) < float("inf"):
            return
        bad = self._nonfinite_experts()
        step = self.steps_applied + self.steps_skipped + 1
        if bad:
            self.nonfinite_grad_steps += 1
            self.last_nonfinite_grads = {"step": step, "experts": bad}
        if applied and not known:
            if bad:
                logger.warning(f"rank {self.layout.global_rank}: non-finite (NaN/Inf) gradients in {len(bad)} "
                               f"expert(s) at optimizer step {step}, applied (no loss scaling or clipping decides "
                               f"to skip it): {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}")
            return
        count = torch.tensor([float(len(bad))], dtype=torch.float32, device=self.device)
        everywhere = int(self.layout.world.all_reduce(count, collective="non-finite expert gradient count").item())
        if everywhere:
            self.nonfinite_grad_steps_any_rank += 1
            if self.layout.global_rank == 0:
                outcome = ("skipped (DeepSpeed's overflow check)" if not applied else
                           "applied (no loss scaling decides to skip it)")
                logger.info(f"optimizer step {step}: non-finite (NaN/Inf) gradients in {everywhere} expert(s) over "
                            f"the ranks, step {outcome}; each rank's experts: engine.hecate.stats()"
                            f"['last_nonfinite_grads']")

    def _nonfinite_experts(self) -> List[str]:
        """Names of this rank's owned experts whose gradient holds a NaN or Inf (one host sync for all)."""
        names, checks = [], []
        for binding in self.bindings:
            for e, param in binding.shard.masters.items():
                if param.grad is not None:
                    names.append(f"{binding.shard.name} expert {e}")
                    checks.append(torch.isfinite(param.grad).all())
        if not checks:
            return []
        return [name for name, ok in zip(names, torch.stack(checks).tolist()) if not ok]

    def after_step(self, global_steps: int) -> None:
        """Step-boundary work, identical on every rank: cost profiling once, periodic re-sharding."""
        self.global_steps = global_steps
        self.drop_pending()
        if global_steps == 1 and not self.measured:
            self.measure_costs()
        elif (global_steps == WARM_PROFILE_STEP and self._work_at_profile is not None
              and self.measured.get("profiled_at_step", 0.0) < WARM_PROFILE_STEP):
            self.measure_costs(since=self._work_at_profile)   # steady-state figures replace the cold first step's
        # phases are timed until the steady-state profile (the cost model's figures), then only with hecate.profile
        self.monitor.profiling = bool(self.config.profile) or global_steps < WARM_PROFILE_STEP
        interval = self.config.reshard_interval
        if interval and global_steps % interval == 0 and self.config.placement == "hecate":
            from .resharding import reshard
            if reshard(self):
                self.reshards += 1

    def measure_costs(self, since: Optional[Tuple[int, float]] = None) -> None:
        """Profile link bandwidth, expert compute per pair and T_nonMoE; agree on rank 0's numbers."""
        self.measured = measure_costs(self, since)
        self._work_at_profile = expert_work(self)

    # -- consolidation ------------------------------------------------------------------------------------------
    def full_expert_weights(self) -> Dict[str, torch.Tensor]:
        """Every expert of every layer as fp32 ``[num_experts, numel]`` on every rank. Collective.

        A SparseAllGather to the placement 'every rank has every expert'; for export, checks and tests, not for
        training (it materializes everything). Not counted as training traffic.
        """
        return {name: self.full_layer_weights(binding) for name, binding in zip(self.layer_names, self.bindings)}

    def full_layer_weights(self, binding: LayerBinding) -> torch.Tensor:
        """One layer's experts as fp32 ``[num_experts, numel]`` in expert order, on every rank. Collective (the
        EDP peers gather partitioned masters first; then each group gathers its owners' experts)."""
        shard = binding.shard
        everything = tuple(range(shard.num_experts))
        placement = Placement(shard.owners, (everything,) * self.ep_size)
        masters, _ = whole_masters(self, shard)
        flats = self.comm.start_sparse_all_gather(placement, masters, shard.kernel.numel, torch.float32,
                                                  CommCounters(), async_op=False).wait().flats()
        return torch.stack([flats[e] for e in everything])

    # -- introspection ----------------------------------------------------------------------------------------
    def materialized_bytes(self) -> int:
        return self.monitor.memory.total.live

    def memory_bytes(self) -> Dict[str, int]:
        return {"expert_master": self.store.master_bytes(), "expert_weights": self.store.weight_bytes(),
                "expert_optimizer_state": self.optimizer.state_bytes() if self.optimizer else 0,
                "expert_grad": self.store.grad_bytes(),
                "materialized": self.materialized_bytes(),
                "peak_materialized": self.peak_replica_bytes,
                "materialize_budget": int(self.config.materialize_budget_mb * (1 << 20))}

    def stats(self) -> dict:
        """JSON-serialisable statistics; see docs/stats.md."""
        total = CommCounters()
        for b in self.bindings:
            total.add(b.counters)
        layout = self.layout
        return {"world_size": layout.groups.world_size, "ranks_per_node": self.global_ranks_per_node,
                "nodes": layout.groups.world_size // self.global_ranks_per_node,
                "ep_size": self.ep_size, "expert_data_parallel_size": layout.edp_size,
                "group": layout.edp_index, "group_rank": self.rank,
                "tensor_parallel_size": layout.tensor_parallel_size,
                "expert_state_partitioned": layout.partitioned, "placement": self.config.placement,
                "rematerialize": self.rematerialize,
                "reduce_dtype": {"sparse_reduce_scatter": str(self.reduce_dtype).replace("torch.", ""),
                                 "expert_data_parallel": str(self.edp_reduce_dtype).replace("torch.", "")},
                "layers": [b.stats() for b in self.bindings], "comm": total.as_dict(),
                "memory": self.memory_bytes(), "steps_applied": self.steps_applied,
                "steps_skipped": self.steps_skipped, "reshards": self.reshards,
                "nonfinite_grad_steps": self.nonfinite_grad_steps,
                "nonfinite_grad_steps_any_rank": self.nonfinite_grad_steps_any_rank,
                "last_nonfinite_grads": self.last_nonfinite_grads,
                "measured_costs": dict(self.measured)}

    def summary(self) -> str:
        experts = sum(s.num_experts for s in self.store.layers)
        params = sum(s.num_experts * s.kernel.numel for s in self.store.layers)
        layout = self.layout
        world = layout.groups.world_size
        nodes = world // self.global_ranks_per_node
        tp = layout.tensor_parallel_size
        members = (f"data-parallel ranks of each of the {tp} tensor-parallel ranks (tokens shared 1/{tp} per "
                   f"tensor-parallel rank)" if tp > 1 else "consecutive ranks")
        groups = (f"; groups of {self.ep_size} {members} (hecate.ep_size) x {layout.edp_size} "
                  f"expert-data-parallel replicas, expert state "
                  f"{'partitioned over' if layout.partitioned else 'whole on'} each replica"
                  if layout.edp_size > 1 else "")
        return (f"Hecate took over {len(self.bindings)} MoE layer(s) with {experts} experts "
                f"({params:,} expert parameters) on {world} rank(s) in {nodes} node(s){groups}; "
                f"placement={self.config.placement}, compute dtype={str(self.compute_dtype).replace('torch.', '')}"
                f"{', rematerialize' if self.rematerialize else ''}")

    def __str__(self) -> str:
        return self.summary()
