"""Heterogeneous re-sharding at a step boundary: new owners for experts, moving master weights and optimizer state
together, so no rank keeps a stale copy of either.

Owners come from :func:`ds_hecate.planning.heterogeneous.heterogeneous_sharding` on the load window summed over the
groups (one small all-reduce over the expert-data-parallel peers), identical on every rank of every group, so every
group keeps the same owners and the EDP peers stay regular. Each moved expert travels inside its group as one fp32
chunk ``[master | vector states | scalar states]`` (partitioned over the peers, each peer moves its slice to the
same-index peer of the new owner: the same group); the state layout (which optimizer-state keys are per-element
vectors and which are scalars) is agreed across ranks first.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from ..errors import HecateError
from ..planning.heterogeneous import heterogeneous_sharding
from ..comm.device import to_device
from .edp import refresh_weights

StateLayout = Tuple[Tuple[str, ...], Tuple[str, ...]]  # (vector keys, scalar keys)


def _local_layout(rt) -> StateLayout:
    if rt.optimizer is None:
        return (), ()
    for p in rt.store.parameters():   # masters: whole experts, or their slices
        state = rt.optimizer.state_of(p)
        if state:
            vectors = tuple(sorted(k for k, v in state.items() if torch.is_tensor(v) and v.numel() == p.numel()))
            scalars = tuple(sorted(k for k, v in state.items() if k not in vectors))
            return vectors, scalars
    return (), ()


def agree_state_layout(rt) -> StateLayout:
    gathered = rt.layout.world.all_gather_object(_local_layout(rt), "re-sharding layout exchange")
    layouts = [(tuple(vectors), tuple(scalars)) for vectors, scalars in gathered]
    known = {layout for layout in layouts if layout != ((), ())}
    if len(known) > 1:
        raise HecateError(f"expert optimizer states differ across ranks ({sorted(known)}); cannot re-shard")
    return known.pop() if known else ((), ())


def _pack(param: nn.Parameter, state: Dict, layout: StateLayout) -> torch.Tensor:
    """``[master | vector states | scalar states]`` on the master's device (torch.optim keeps ``step`` on the CPU)."""
    vectors, scalars = layout
    parts = [param.detach().reshape(-1).float()]
    for key in vectors:
        parts.append(state[key].detach().reshape(-1).float())
    if scalars:
        host = torch.tensor([float(state[key]) for key in scalars], dtype=torch.float32)
        parts.append(to_device(host, param.device))
    return torch.cat(parts)


def _unpack(chunk: torch.Tensor, numel: int, layout: StateLayout) -> Tuple[nn.Parameter, Dict]:
    vectors, scalars = layout
    param = nn.Parameter(chunk[:numel].clone(), requires_grad=False)
    state, offset = {}, numel
    for key in vectors:
        state[key] = chunk[offset:offset + numel].clone()
        offset += numel
    if scalars:
        host = chunk[offset:offset + len(scalars)].cpu()
        for i, key in enumerate(scalars):
            state[key] = host[i].clone()  # 0-d float32 on the CPU, as torch.optim keeps 'step'
    return param, state


def reshard(rt) -> bool:
    """Re-shard every layer if the heterogeneous plan changed; returns whether anything moved. Collective."""
    loads = [b.planner.predictor.expert_loads() or [0.0] * b.shard.num_experts for b in rt.bindings]
    if rt.layout.edp is not None:   # every group decides from the same loads: the sum over the groups
        summed = to_device(torch.tensor([x for layer in loads for x in layer], dtype=torch.float64), rt.device)
        rt.layout.edp.all_reduce(summed, collective="re-sharding load all-reduce")
        flat, loads = summed.tolist(), []
        for b in rt.bindings:
            loads.append(flat[:b.shard.num_experts])
            flat = flat[b.shard.num_experts:]
    degrees = [min(rt.step_costs(b).overlap_degree, b.shard.num_experts) for b in rt.bindings]
    new_owners = heterogeneous_sharding(loads, rt.ep_size, rt.ranks_per_node, degrees)
    changed = [i for i, b in enumerate(rt.bindings) if tuple(new_owners[i]) != tuple(b.shard.owners)]
    if not changed:
        return False
    layout = agree_state_layout(rt)
    chunk_numel_extra = len(layout[1])
    for i in changed:
        binding = rt.bindings[i]
        shard = binding.shard
        old, new = shard.owners, tuple(new_owners[i])
        numel = shard.master_numel   # the whole expert, or this rank's slice of it
        size = numel * (1 + len(layout[0])) + chunk_numel_extra
        sends: Dict[int, List[torch.Tensor]] = {}
        recvs: Dict[int, List[int]] = {}
        for e in range(shard.num_experts):
            if old[e] == new[e]:
                continue
            if old[e] == rt.rank:
                param = shard.masters[e]
                state = rt.optimizer.state_of(param) if rt.optimizer is not None else {}
                sends.setdefault(new[e], []).append(_pack(param, state, layout) if state else
                                                    torch.cat([param.detach().reshape(-1).float(),
                                                               param.new_zeros(size - numel)]))
            elif new[e] == rt.rank:
                recvs.setdefault(old[e], []).append(e)
        received = rt.comm.exchange_chunk_lists(sends, recvs, size, torch.float32, "re-sharding expert move")
        for e in range(shard.num_experts):
            if old[e] != new[e] and old[e] == rt.rank:
                param = shard.masters.pop(e)
                if rt.optimizer is not None:
                    rt.optimizer.remove(param)
        for src, experts in recvs.items():
            for e, chunk in zip(experts, received[src]):
                param, state = _unpack(chunk, numel, layout)
                shard.masters[e] = param
                if rt.optimizer is not None:
                    rt.optimizer.add(rt.layer_group[shard.layer_id], param, state)
        shard.owners = new
        # the resident weights and the accumulator laid out for the new owned experts (partitioned: their whole
        # weights gathered from the moved slices below)
        for old_param, new_param in shard.relayout(rt.device).items():   # shared masters: new views, same state
            if rt.optimizer is not None:
                state = rt.optimizer.state_of(old_param)
                rt.optimizer.remove(old_param)
                rt.optimizer.add(rt.layer_group[shard.layer_id], new_param, state)
        binding.gathers.pending = None
    refresh_weights(rt, [rt.bindings[i].shard for i in changed])
    return True
