"""Taking MoE layers over: find them in a model and shard their experts into the runtime (the expert parameters
leave the model; :mod:`.param_groups` then prunes them from whatever optimizer or param groups the user passes to
DeepSpeed, which would crash on parameters that left the model and must never see expert parameters again)."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple, cast

import torch
from torch import nn
from deepspeed.moe.layer import MoE as DeepSpeedMoE

from ..errors import HecateModelError
from .param_groups import RemovedParams
from ..experts import ExpertKernel
from ..moe_layer import MoE
from ..planning import even_sharding
from ..runtime.hecate import HecateRuntime
from ..runtime.shard_store import LayerShard, initial_master


def _replace_child(model: nn.Module, qualified_name: str, new: nn.Module) -> None:
    parent_name, _, child = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, (nn.ModuleList, nn.Sequential)) and child.isdigit():
        parent[int(child)] = new
    else:
        setattr(parent, child, new)


def find_moe_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(qualified name, module) of every DeepSpeed or ds_hecate MoE layer, outermost first; no nesting."""
    found: List[Tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, (DeepSpeedMoE, MoE)):
            if any(name.startswith(prev + ".") for prev, _ in found):
                raise HecateModelError(f"nested MoE layers are not supported: {name}")
            found.append((name, module))
    return found


def moe_layer_shapes(model: nn.Module) -> Tuple[List[int], List[int]]:
    """(the ``ep_size`` each MoE layer was built with, the expert count of each) before anything is taken over:
    what the group rule (``hecate.ep_size``'s default) reads. Hugging Face experts carry no ``ep_size``."""
    layers = find_moe_layers(model)
    if layers:
        return ([int(getattr(m, "ep_size", 1) or 1) for _, m in layers],
                [int(cast(Any, m).num_experts) for _, m in layers])
    if _is_transformers_model(model):
        from ..hf.takeover import experts_counts
        return [], experts_counts(model)
    return [], []


def _expert_sources(layer: MoE, world_size: int) -> Tuple[int, ...]:
    """Rank to take each expert's initial weights from, matching DeepSpeed's broadcast at initialize.

    Replicated experts (ep_size 1) come from rank 0. With ep_size > 1 DeepSpeed's legacy layout gives rank r the
    experts [ (r % ep) * n_local, ... ); DeepSpeed broadcasts each from the first rank of its expert-data-parallel
    group, which is rank (e // n_local).
    """
    num_local = len(layer.experts)
    if num_local == layer.num_experts:
        return tuple(0 for _ in range(layer.num_experts))
    if layer.ep_size * num_local != layer.num_experts or world_size % layer.ep_size:
        raise HecateModelError(f"MoE layer with ep_size={layer.ep_size} and {num_local} local experts cannot be "
                               f"taken over on {world_size} ranks (world size must be a multiple of ep_size)")
    return tuple(e // num_local for e in range(layer.num_experts))


def take_over_layer(name: str, layer: MoE, runtime: HecateRuntime) -> Dict[int, str]:
    """Shard one layer's experts into the runtime; return the expert parameters that left the model (id -> their
    name inside an expert, ``0.weight``, ``2.bias``, ...).

    Experts built under ``deepspeed.zero.Init`` are partitioned: each is gathered on its own and only its owners
    keep it (:func:`_take_over_partitioned`), so the whole layer is never materialized on one rank."""
    experts = list(layer.experts)
    params = [p for expert in experts for p in expert.parameters()]
    removed = {id(p): n for expert in experts for n, p in expert.named_parameters()}
    if any(hasattr(p, "ds_id") for p in params):
        _take_over_partitioned(name, layer, experts, runtime)
    else:
        if any(p.numel() == 0 for p in params):
            raise HecateModelError(
                f"MoE layer '{name}': its experts' parameters are empty (shapes "
                f"{sorted({tuple(p.shape) for p in params})}), as DeepSpeed's Experts leaves them when it deep-copies "
                "an expert built under deepspeed.zero.Init; import ds_hecate (or install it, for its automatic "
                "activation) before building the model, so the copies keep the expert's values")
        _take_over_gathered(name, layer, experts, runtime)
    return removed


def _check_layout(name: str, kernel: ExpertKernel, experts: List[nn.Module]) -> None:
    for i, expert in enumerate(experts[1:], 1):
        layout = [(n, tuple(getattr(p, "ds_shape", p.shape))) for n, p in expert.named_parameters()]
        if layout != [(n, tuple(s)) for n, s in zip(kernel.names, kernel.shapes)]:
            raise HecateModelError(f"MoE layer '{name}': expert {i} has a different parameter layout than expert 0; "
                                   "Hecate needs identical experts within a layer")


def _new_shard(name: str, layer: MoE, kernel: ExpertKernel, runtime: HecateRuntime) -> LayerShard:
    return LayerShard(layer_id=len(runtime.bindings), name=name, num_experts=layer.num_experts, kernel=kernel,
                      owners=even_sharding(layer.num_experts, runtime.ep_size),   # inside the rank's group
                      rank=runtime.rank)


def _bind(name: str, layer: MoE, kernel: ExpertKernel, shard: LayerShard, runtime: HecateRuntime) -> None:
    layer.binding = runtime.add_layer(name, shard, layer.hidden_size)
    del layer.experts  # expert parameters leave the module: DeepSpeed never sees them
    layer.expert_kernel = kernel


def _take_over_gathered(name: str, layer: MoE, experts: List[nn.Module], runtime: HecateRuntime) -> None:
    kernel = ExpertKernel(experts[0])
    _check_layout(name, kernel, experts)
    local = {e: kernel.flatten(expert) for e, expert in zip(layer.local_expert_ids, experts)}
    local = {e: initial_master(flat, runtime.compute_dtype) for e, flat in local.items()}
    sources = _expert_sources(layer, runtime.layout.groups.world_size)
    shard = _new_shard(name, layer, kernel, runtime)
    runtime.take_experts(shard, sources, local)
    _bind(name, layer, kernel, shard, runtime)


def _take_over_partitioned(name: str, layer: MoE, experts: List[nn.Module], runtime: HecateRuntime) -> None:
    """Experts partitioned by ZeRO-3 (built under ``deepspeed.zero.Init``): every rank gathers one local expert at
    a time (collective over ZeRO's partition group, the same order everywhere) and keeps the experts it owns.

    ZeRO-3 holds one value per parameter for the whole data-parallel world, so local expert ``i`` is the same on
    every rank: with DeepSpeed's expert-parallel layout (``ep_size`` > 1, each rank holding ``num_experts /
    ep_size`` local experts) global expert ``e`` is local expert ``e mod num_local`` of its ranks, whose values these
    are (DeepSpeed's broadcast at initialize would give the same)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(experts[0].parameters()), modifier_rank=None):
        kernel = ExpertKernel(experts[0])
    _check_layout(name, kernel, experts)
    shard = _new_shard(name, layer, kernel, runtime)
    num_local = len(experts)
    if layer.num_experts % num_local:
        raise HecateModelError(f"MoE layer '{name}': {num_local} local experts do not divide its "
                               f"{layer.num_experts} experts")
    owned: Dict[int, torch.Tensor] = {}
    for i, expert in enumerate(experts):
        with deepspeed.zero.GatheredParameters(list(expert.parameters()), modifier_rank=None):
            flat = initial_master(kernel.flatten(expert), runtime.compute_dtype)
        for e in range(i, layer.num_experts, num_local):
            if shard.owners[e] == runtime.rank:
                owned[e] = flat.to(runtime.device).clone()
    shard.set_masters(owned, runtime.layout.partition_for(kernel.numel), runtime.compute_dtype)
    _bind(name, layer, kernel, shard, runtime)


def _is_transformers_model(model: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (checked without importing transformers when it is not in use)."""
    import sys
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def check_convertible(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The model's MoE layers (``find_moe_layers``), checked before anything is set up: raises if there is none and
    the model is not a Hugging Face MoE model (those are found by :mod:`ds_hecate.hf` at conversion)."""
    layers = find_moe_layers(model)
    if not layers and not _is_transformers_model(model):
        raise HecateModelError(
            f"hecate.enabled is true but the model ({type(model).__name__}) has no MoE layer Hecate can take over: "
            "build MoE layers with deepspeed.moe.layer.MoE or ds_hecate.MoE (Hugging Face models: see "
            "docs/huggingface.md), or set hecate.enabled to false")
    return layers


def _convert_in_place(ds_moe: nn.Module) -> MoE:
    """Turn a ``deepspeed.moe.layer.MoE`` object itself into the equivalent ``ds_hecate.MoE`` (same gate and expert
    modules): for a layer that is the whole model, which has no parent to replace it in and is the object the
    caller and DeepSpeed's engine hold. Hooks registered on it stay."""
    converted = MoE.from_deepspeed(ds_moe)
    kept = {k: v for k, v in vars(ds_moe).items()
            if k.startswith("_") and k not in ("_parameters", "_buffers", "_modules") and k in vars(converted)}
    state = {**vars(converted), **kept, "training": ds_moe.training}
    vars(ds_moe).clear()
    vars(ds_moe).update(state)
    ds_moe.__class__ = MoE
    return cast(MoE, ds_moe)


def convert_model(model: nn.Module, runtime: HecateRuntime) -> RemovedParams:
    """Replace DeepSpeed MoE layers by ``ds_hecate.MoE`` in place and take every MoE layer over.

    Returns, per Hecate layer id, the expert parameters removed from the model (id -> name inside the expert; Hugging
    Face layers: their ids).
    """
    layers = check_convertible(model)
    if not layers:
        from ..hf.takeover import convert_hf_model  # HF MoE models: routed experts through ExpertsInterface
        return convert_hf_model(model, runtime)
    removed: Dict[int, Dict[int, str]] = {}
    for name, module in layers:
        if isinstance(module, DeepSpeedMoE):
            if name == "":   # the model is the layer itself
                module = _convert_in_place(module)
            else:
                module = MoE.from_deepspeed(module)
                _replace_child(model, name, module)
        if module.binding is not None:
            raise HecateModelError(f"MoE layer '{name}' is already taken over by Hecate (initialize called twice?)")
        layer_id = len(runtime.bindings)
        removed[layer_id] = take_over_layer(name, module, runtime)
        module.expert_group_name = runtime.expert_group_name   # DeepSpeed's registry name of Hecate's groups
    return removed
