"""Hecate inside groups, expert data parallelism (EDP) across them: the group communicators and the step-boundary
work that spans groups.

A rank's layer calls (count exchange, SparseAllGather, SparseReduceScatter, token all-to-all, re-sharding moves) run
on its group's communicators, with ranks numbered inside the group; no token leaves its group. Across groups the
ranks with the same local rank own the same experts (``ds_hecate.planning.groups.ExpertGroups``). At the gradient
accumulation boundary each owner's expert gradients, summed over its group by SparseReduceScatter, are summed over
its EDP peers (in ``hecate.reduce_dtype`` on the wire): ZeRO stage 0 all-reduces them and every peer steps the
whole expert; ZeRO stage 1 and above reduce-scatter them, each peer steps its ``1/R`` slice of the master and optimizer state, and the updated slices are
all-gathered into the whole weights before the next SparseAllGather (``LayerShard.partition``).

Everything here is collective over the EDP peers (or, where it says so, the world), called in the same order on
every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..comm.collectives import Communicator
from ..planning.groups import ExpertGroups
from .interfaces import RuntimeView
from .shard_store import LayerShard, Partition



@dataclass
class GroupLayout:
    """Where a rank stands: its groups, the communicator over the world and the one over its EDP peers.

    ``world`` carries what must agree across groups (the global gradient norm, the measured costs, checkpoint
    barriers, the first distribution of the experts); ``edp`` the gradient reduction and the weights' all-gather
    (None with one group); ``partitioned``: expert state split over the EDP peers (ZeRO stage >= 1, R > 1).
    ``ranks``: the global rank at each position of ``groups`` (None: the same; with a model-parallel unit the groups
    lie inside the data-parallel ranks of each tensor-parallel rank, ``ds_hecate.deepspeed_glue.model_parallel``);
    ``tensor_parallel``: the communicator over this rank's tensor-parallel peers, whose tokens are the same (None
    without tensor parallelism; :mod:`.tensor_parallel`).
    """

    groups: ExpertGroups
    global_rank: int
    world: Communicator
    edp: Optional[Communicator] = None
    partitioned: bool = False
    ranks: Optional[Tuple[int, ...]] = None
    tensor_parallel: Optional[Communicator] = None

    @staticmethod
    def single(comm: Communicator, ranks_per_node: int) -> "GroupLayout":
        """One group spanning the world (the default where the world is at most the number of experts)."""
        return GroupLayout(ExpertGroups(comm.world_size, comm.world_size, ranks_per_node), comm.rank, comm)

    @property
    def edp_size(self) -> int:
        return self.groups.edp_size

    @property
    def position(self) -> int:
        """This rank's position in ``groups`` (its global rank unless ``ranks`` reorders them)."""
        return self.global_rank if self.ranks is None else self.ranks.index(self.global_rank)

    def global_of(self, position: int) -> int:
        return position if self.ranks is None else self.ranks[position]

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.tensor_parallel is None else self.tensor_parallel.world_size

    @property
    def edp_index(self) -> int:
        """This rank's index among its EDP peers (its group)."""
        return self.groups.group_of(self.position)

    def partition_for(self, numel: int) -> Optional[Partition]:
        return Partition(self.edp_size, self.edp_index, numel) if self.partitioned else None

    def owners_everywhere(self, owners) -> List:
        """Per expert, the global ranks that own it: the group-local owner in every group (a tuple), or with one
        group the owner itself (an int: the collectives of a single group are today's)."""
        if self.edp_size == 1:
            return list(owners)
        return [tuple(self.global_of(self.groups.global_rank(g, o)) for g in range(self.groups.num_groups))
                for o in owners]


def reduce_gradients(rt: RuntimeView) -> None:
    """Sum every owner's expert gradients over its EDP peers (after the group's SparseReduceScatters are flushed):
    an all-reduce of the whole rows, or partitioned a reduce-scatter into this peer's slices. Collective over the
    EDP peers, one call per layer in layer order, except for the layers :func:`reduce_layer` already handed over in
    backward (the same layers on every peer); a no-op with one group."""
    if rt.layout.edp is None:
        return
    for binding in rt.bindings:
        shard = binding.shard
        if shard.grads is None and shard.slice_grads is not None:   # reduced early, in backward
            continue
        reduce_layer(rt, shard)


def reduce_layer(rt: RuntimeView, shard: LayerShard) -> None:
    """One layer's EDP reduction (see :func:`reduce_gradients`). Partitioned, the whole fp32 rows are released once
    their slices are taken (a layer reduced twice, say a layer called twice per forward, adds the second slices to
    the first). Collective over the EDP peers."""
    layout = rt.layout
    if layout.edp is None or not shard.owned:   # the same on every peer: peers own the same experts
        return
    rows = shard.grad_rows(rt.device)   # zeros if this window ran no backward through the layer
    wire = rt.edp_reduce_dtype   # hecate.reduce_dtype: bf16 halves the traffic, as DeepSpeed's bf16 reduction
    with layout.edp.during(f"the expert-data-parallel gradient reduction of MoE layer '{shard.name}'"):
        if shard.partition is None:
            sent = rows if wire == rows.dtype else rows.to(wire)
            layout.edp.all_reduce(sent, collective="expert-data-parallel gradient all-reduce")
            if sent is not rows:
                rows.copy_(sent)
            return
        part = shard.partition
        out = torch.empty(rows.shape[0], part.size, dtype=wire, device=rows.device)
        layout.edp.reduce_scatter(out, part.padded(rows.to(wire)).view(-1, part.size),
                                  collective="expert-data-parallel gradient reduce-scatter")
    slices = out if out.dtype == torch.float32 else out.float()
    if shard.slice_grads is not None:
        slices = shard.slice_grads.add_(slices)
    shard.set_slice_grads(slices)
    shard.grads = None   # the whole rows are this peer's slices now: freed before the next layer's arrive


def refresh_weights(rt: RuntimeView, shards: Optional[List[LayerShard]] = None) -> None:
    """The resident compute-dtype weights the layer calls compute from, after the masters changed: partitioned,
    every peer's (updated) master slices all-gathered into them (collective over the EDP peers, one call per
    partitioned layer in layer order); otherwise cast from the whole masters (:meth:`LayerShard.refresh`, nothing
    where the masters are the weights)."""
    layout = rt.layout
    for shard in shards if shards is not None else [b.shard for b in rt.bindings]:
        part = shard.partition
        if part is None:
            shard.refresh(rt.comm.weights.device_ops.pack)
            continue
        if not shard.owned:
            continue
        assert shard.weight_rows is not None   # laid out with the masters
        local = torch.stack([shard.masters[e].detach() for e in shard.owned]).to(shard.weight_rows.dtype)
        gathered = torch.empty((part.peers,) + tuple(local.shape), dtype=local.dtype, device=local.device)
        with layout.edp.during(f"the expert-data-parallel weight all-gather of MoE layer '{shard.name}'"):
            layout.edp.all_gather_into(gathered.view(-1, part.size), local,
                                       collective="expert-data-parallel weight all-gather")
        shard.weight_rows.copy_(part.whole(gathered))


def whole_masters(rt: RuntimeView, shard: LayerShard, with_state: bool = False):
    """This rank's owned experts as whole fp32 masters (and, with ``with_state``, whole optimizer-state vectors):
    the masters themselves, or partitioned their slices all-gathered over the EDP peers. Collective over the EDP
    peers when partitioned. Returns (expert -> master, expert -> state dict)."""
    part = shard.partition
    states = {e: (rt.optimizer.state_of(shard.masters[e]) if (with_state and rt.optimizer is not None) else {})
              for e in shard.owned}
    if part is None or not shard.owned:
        return {e: shard.masters[e].detach() for e in shard.owned}, states
    keys = sorted(k for k, v in next(iter(states.values())).items()
                  if torch.is_tensor(v) and v.numel() == part.size) if with_state else []
    local = torch.stack([torch.stack([shard.masters[e].detach().float()] + [states[e][k].float() for k in keys])
                         for e in shard.owned])                         # [n, 1 + vectors, size]
    gathered = torch.empty((part.peers,) + tuple(local.shape), dtype=local.dtype, device=local.device)
    rt.layout.edp.all_gather_into(gathered.view(-1, part.size), local.view(-1, part.size),
                                  collective="expert-data-parallel state gather")
    whole = gathered.permute(1, 2, 0, 3).reshape(len(shard.owned), 1 + len(keys), part.peers * part.size)
    whole = whole[..., :part.numel]
    masters = {e: whole[i, 0] for i, e in enumerate(shard.owned)}
    full_states = {}
    for i, e in enumerate(shard.owned):
        state = {k: v for k, v in states[e].items() if k not in keys}
        state.update({k: whole[i, 1 + j] for j, k in enumerate(keys)})
        full_states[e] = state
    return masters, full_states
