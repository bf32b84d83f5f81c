"""Hecate runtime: per-layer execution of one MoE call, and the per-step expert update.

One MoE layer call, on every rank, whatever its tokens:

1. exchange per-expert token counts (all-gather) and compute the plan (identical on every rank);
2. dispatch token rows to the ranks that process them (ragged all-to-all);
3. SparseAllGather the experts this rank materializes; backward runs SparseReduceScatter to the owners;
4. run each materialized expert on its rows; send results back (ragged all-to-all) and combine.

Steps 2-4 are autograd functions, so backward issues the mirror collectives in the mirror order on every rank.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Dict, List, Optional, Sequence

import torch

from .collectives import AllToAllTokens, Communicator
from .config import HecateConfig
from .expert_optimizer import ExpertOptimizer
from .planning import CommCostModel, LayerPlan, plan_layer
from .shard_store import ExpertShardStore, LayerShard


class _Materialize(torch.autograd.Function):
    """Forward: SparseAllGather of this layer's plan. Backward: SparseReduceScatter into the owners' accumulators.

    The received token rows pass through unchanged, so this node sits on every rank's backward path (even a rank
    that materializes nothing or receives no token), and its collective is issued on every rank. ``anchor`` is a
    tensor that always requires grad, so the node is recorded even when the tokens do not require grad (a rank
    whose micro-batch is empty, or whose rows came from nowhere).
    """

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, anchor: torch.Tensor, binding: "LayerBinding", plan: LayerPlan):
        ctx.binding, ctx.plan = binding, plan
        flats = binding.gather(plan)
        mine = plan.materialized[binding.runtime.rank]
        return (tokens.view_as(tokens),) + tuple(flats[e] for e in mine)

    @staticmethod
    def backward(ctx, grad_tokens: torch.Tensor, *grad_weights: torch.Tensor):
        binding, plan = ctx.binding, ctx.plan
        mine = plan.materialized[binding.runtime.rank]
        binding.reduce_scatter(plan, dict(zip(mine, grad_weights)))
        return grad_tokens, None, None, None


class LayerBinding:
    """Connects one ``ds_hecate.MoE`` module to the runtime and to its shard."""

    def __init__(self, runtime: "HecateRuntime", shard: LayerShard, cost: CommCostModel) -> None:
        self.runtime = runtime
        self.shard = shard
        self.cost = cost
        self.last_plan: Optional[LayerPlan] = None
        self._live_buffers: List[weakref.ref] = []

    # -- collectives ------------------------------------------------------------------------------------------
    def gather(self, plan: LayerPlan) -> Dict[int, torch.Tensor]:
        rt = self.runtime
        flats, buffers = rt.comm.sparse_all_gather(plan, self.shard.masters, self.shard.kernel.numel,
                                                   rt.compute_dtype)
        self._live_buffers = [weakref.ref(t) for t in buffers]
        return flats

    def reduce_scatter(self, plan: LayerPlan, grads: Dict[int, torch.Tensor]) -> None:
        rt = self.runtime
        totals = rt.comm.sparse_reduce_scatter(plan, grads, self.shard.kernel.numel, rt.reduce_dtype)
        self.shard.accumulate(totals)

    def materialized_bytes(self) -> int:
        """Bytes of materialized expert copies still alive (replicas and cast copies, not the masters)."""
        total = 0
        for ref in self._live_buffers:
            t = ref()
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    # -- one layer call ---------------------------------------------------------------------------------------
    def run(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Expert outputs for every (route, token) slot of ``indices`` ([k, S], -1 = dropped); zeros if dropped."""
        rt, shard = self.runtime, self.shard
        rank, num_experts = rt.rank, shard.num_experts
        num_tokens = x.shape[0]
        flat = indices.reshape(-1).long()
        valid_slots = torch.nonzero(flat >= 0).squeeze(1)
        experts_of_valid = flat.index_select(0, valid_slots)
        local_counts = torch.bincount(experts_of_valid, minlength=num_experts)
        counts = rt.comm.exchange_counts(local_counts)
        plan = rt.plan(self, counts)
        self.last_plan = plan

        # Send order: by destination, then expert, then slot; the receiver expects (src, expert) segments.
        by_expert = valid_slots.index_select(0, torch.argsort(experts_of_valid, stable=True))
        dsts = [dst for e in range(num_experts) for dst, n in plan.routes[rank][e] for _ in range(n)]
        dst_of_sorted = torch.tensor(dsts, dtype=torch.long, device=x.device)
        send_slots = by_expert.index_select(0, torch.argsort(dst_of_sorted, stable=True))
        send_rows = x.index_select(0, send_slots % max(num_tokens, 1))  # stays on the graph even when empty

        send_splits, recv_splits = plan.send_splits(rank), plan.recv_splits(rank)
        recv = AllToAllTokens.apply(send_rows, rt.comm, send_splits, recv_splits, "dispatch")
        recv, *weights = _Materialize.apply(recv, rt.autograd_anchor, self, plan)

        # Regroup received rows expert-major, run each materialized expert on its rows, restore the order.
        mine = plan.materialized[rank]
        order, sizes = _expert_major_order(plan, rank, mine)
        order_t = torch.tensor(order, dtype=torch.long, device=x.device)
        grouped = recv.index_select(0, order_t)
        outs = []
        offset = 0
        for weight, size in zip(weights, sizes):
            rows = grouped.narrow(0, offset, size)
            outs.append(shard.kernel(weight, rows))
            offset += size
        y_grouped = torch.cat(outs) if outs else grouped
        y_recv = y_grouped.index_select(0, torch.argsort(order_t))
        y_back = AllToAllTokens.apply(y_recv, rt.comm, recv_splits, send_splits, "combine")
        return y_back.new_zeros(flat.numel(), y_back.shape[-1]).index_copy(0, send_slots, y_back)


def _expert_major_order(plan: LayerPlan, rank: int, mine: Sequence[int]):
    """Permutation from received order (src-major, then expert) to expert-major order, and rows per expert."""
    tm = plan.token_matrix
    world = plan.world_size
    seg_start = {}
    offset = 0
    for src in range(world):
        for e in range(plan.num_experts):
            n = tm[src][rank][e]
            if n:
                seg_start[(src, e)] = (offset, n)
                offset += n
    order: List[int] = []
    sizes: List[int] = []
    for e in mine:
        size = 0
        for src in range(world):
            if (src, e) in seg_start:
                start, n = seg_start[(src, e)]
                order.extend(range(start, start + n))
                size += n
        sizes.append(size)
    return order, sizes


class HecateRuntime:
    """Everything Hecate holds on one rank: process group, shards, plans, expert optimizer and statistics."""

    def __init__(self, config: HecateConfig, comm: Communicator, compute_dtype: torch.dtype,
                 ranks_per_node: int) -> None:
        self.config = config
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.compute_dtype = compute_dtype
        self.reduce_dtype = torch.float32 if config.reduce_dtype == "fp32" else torch.bfloat16
        self.ranks_per_node = ranks_per_node
        self.store = ExpertShardStore()
        self.autograd_anchor = torch.empty(0, requires_grad=True)
        self.bindings: List[LayerBinding] = []
        self.layer_names: List[str] = []
        self.optimizer: Optional[ExpertOptimizer] = None
        self.last_total_norm: Optional[torch.Tensor] = None
        self.steps_applied = 0
        self.steps_skipped = 0

    # -- setup --------------------------------------------------------------------------------------------------
    def add_layer(self, name: str, shard: LayerShard, hidden_size: int) -> LayerBinding:
        self.store.add(shard)
        binding = LayerBinding(self, shard, self.cost_model(shard, hidden_size))
        self.bindings.append(binding)
        self.layer_names.append(name)
        return binding

    def cost_model(self, shard: LayerShard, hidden_size: int) -> CommCostModel:
        act = torch.empty((), dtype=self.compute_dtype).element_size()
        grad = torch.empty((), dtype=self.reduce_dtype).element_size()
        return CommCostModel(hidden_size=hidden_size, expert_numel=shard.kernel.numel, activation_bytes=act,
                             param_bytes=act, grad_bytes=grad)

    # -- planning -----------------------------------------------------------------------------------------------
    def plan(self, binding: LayerBinding, counts: Sequence[Sequence[int]]) -> LayerPlan:
        return plan_layer(counts, binding.shard.owners, self.config.placement, binding.cost, self.ranks_per_node)

    # -- gradient norm and step -------------------------------------------------------------------------------
    def expert_grad_norm(self, grad_divisor: float) -> torch.Tensor:
        """L2 norm over all ranks of the (averaged, still loss-scaled) expert gradients. Collective."""
        sq = self.store.grad_sq_sum() / (grad_divisor * grad_divisor)
        return self.comm.all_reduce_sum(sq.reshape(1)).reshape(()).sqrt()

    def apply_step(self, applied: bool, dp_world_size: int, loss_scale: float, clip: float,
                   lrs: Sequence[float]) -> None:
        """Update expert masters after DeepSpeed's step decided (overflow) and computed the global norm.

        ``loss_scale`` and ``lrs`` are the values from before DeepSpeed's step, the ones that applied to it.
        """
        try:
            if not applied:
                self.steps_skipped += 1
                return
            combined = float(loss_scale)
            if clip > 0 and self.last_total_norm is not None:
                total = float(self.last_total_norm)
                if math.isfinite(total):
                    combined *= max(1.0, (total / loss_scale + 1e-6) / clip)
            if self.optimizer is not None:
                self.optimizer.step(1.0 / (dp_world_size * combined), lrs)
            self.steps_applied += 1
        finally:
            self.store.zero_grads()
            self.last_total_norm = None

    # -- consolidation ------------------------------------------------------------------------------------------
    def full_expert_weights(self) -> Dict[str, torch.Tensor]:
        """Every expert of every layer as fp32 ``[num_experts, numel]`` on every rank. Collective.

        A SparseAllGather to the placement 'every rank has every expert'; for export, checks and tests, not for
        training (it materializes everything). Not counted as training traffic.
        """
        out = {}
        saved = dataclasses.replace(self.comm.counters, calls=dict(self.comm.counters.calls))
        for name, binding in zip(self.layer_names, self.bindings):
            shard = binding.shard
            everything = tuple(range(shard.num_experts))
            plan = LayerPlan(world_size=self.world_size, num_experts=shard.num_experts, owners=shard.owners,
                             materialized=(everything,) * self.world_size,
                             routes=(((),) * shard.num_experts,) * self.world_size)
            flats, _ = self.comm.sparse_all_gather(plan, shard.masters, shard.kernel.numel, torch.float32)
            out[name] = torch.stack([flats[e].clone() for e in everything])
        self.comm.counters = saved
        return out

    # -- introspection ----------------------------------------------------------------------------------------
    def materialized_bytes(self) -> int:
        return sum(b.materialized_bytes() for b in self.bindings)

    def memory_bytes(self) -> Dict[str, int]:
        return {"expert_master": self.store.master_bytes(),
                "expert_optimizer_state": self.optimizer.state_bytes() if self.optimizer else 0,
                "expert_grad": self.store.grad_bytes(),
                "materialized": self.materialized_bytes()}

    def stats(self) -> dict:
        layers = []
        for name, binding in zip(self.layer_names, self.bindings):
            plan = binding.last_plan
            layers.append({"name": name, "num_experts": binding.shard.num_experts,
                           "owned_experts": binding.shard.owned,
                           "replicas": plan.num_moved if plan else 0,
                           "lambda": (plan.num_moved / binding.shard.num_experts) if plan else 0.0})
        return {"world_size": self.world_size, "placement": self.config.placement, "layers": layers,
                "comm": self.comm.counters.as_dict(), "memory": self.memory_bytes(),
                "steps_applied": self.steps_applied, "steps_skipped": self.steps_skipped}

    def summary(self) -> str:
        experts = sum(s.num_experts for s in self.store.layers)
        params = sum(s.num_experts * s.kernel.numel for s in self.store.layers)
        return (f"Hecate took over {len(self.bindings)} MoE layer(s) with {experts} experts "
                f"({params:,} expert parameters) on {self.world_size} rank(s); placement={self.config.placement}, "
                f"compute dtype={str(self.compute_dtype).replace('torch.', '')}")

    def __str__(self) -> str:
        return self.summary()
