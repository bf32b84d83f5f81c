"""Taking MoE layers over: find them in a model, shard their experts, and prune expert parameters from whatever
optimizer or parameter groups the user passes to DeepSpeed (DeepSpeed would crash on parameters that left the
model, and must never see expert parameters again)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from deepspeed.moe.layer import MoE as DeepSpeedMoE

from ..errors import HecateModelError, HecateUnsupportedError
from .expert_optimizer import group_hyperparameters
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
    found = []
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
        return [int(getattr(m, "ep_size", 1) or 1) for _, m in layers], [int(m.num_experts) for _, m in layers]
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


def take_over_layer(name: str, layer: MoE, runtime: HecateRuntime) -> Set[int]:
    """Shard one layer's experts into the runtime; return the ids of the expert parameters that left the model.

    Experts built under ``deepspeed.zero.Init`` are partitioned: they are gathered first (one layer at a time).
    """
    experts = list(layer.experts)
    params = [p for expert in experts for p in expert.parameters()]
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return _take_over_gathered(name, layer, experts, runtime)
    return _take_over_gathered(name, layer, experts, runtime)


def _take_over_gathered(name: str, layer: MoE, experts: List[nn.Module], runtime: HecateRuntime) -> Set[int]:
    kernel = ExpertKernel(experts[0])
    for i, expert in enumerate(experts[1:], 1):
        layout = [(n, p.shape) for n, p in expert.named_parameters()]
        if layout != list(zip(kernel.names, kernel.shapes)):
            raise HecateModelError(f"MoE layer '{name}': expert {i} has a different parameter layout than expert 0; "
                                   "Hecate needs identical experts within a layer")
    expert_param_ids = {id(p) for expert in experts for p in expert.parameters()}
    local = {e: kernel.flatten(expert) for e, expert in zip(layer.local_expert_ids, experts)}
    local = {e: initial_master(flat, runtime.compute_dtype) for e, flat in local.items()}
    sources = _expert_sources(layer, runtime.layout.groups.world_size)
    owners = even_sharding(layer.num_experts, runtime.ep_size)   # inside the rank's group
    shard = LayerShard(layer_id=len(runtime.bindings), name=name, num_experts=layer.num_experts, kernel=kernel,
                       owners=owners, rank=runtime.rank)
    runtime.take_experts(shard, sources, local)
    layer.binding = runtime.add_layer(name, shard, layer.hidden_size)
    del layer.experts  # expert parameters leave the module: DeepSpeed never sees them
    layer.expert_kernel = kernel
    return expert_param_ids


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
    return ds_moe


def convert_model(model: nn.Module, runtime: HecateRuntime) -> Dict[int, Set[int]]:
    """Replace DeepSpeed MoE layers by ``ds_hecate.MoE`` in place and take every MoE layer over.

    Returns, per Hecate layer id, the ids of the expert parameters removed from the model.
    """
    layers = check_convertible(model)
    if not layers:
        from ..hf.takeover import convert_hf_model  # HF MoE models: routed experts through ExpertsInterface
        return convert_hf_model(model, runtime)
    removed: Dict[int, Set[int]] = {}
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


# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ExpertGroups:
    """Which user param group each layer's expert parameters came from (None: the optimizer's default group)."""

    source_group: Dict[int, Optional[Dict[str, Any]]] = field(default_factory=dict)  # layer_id -> group
    initial_lrs: Dict[int, Optional[float]] = field(default_factory=dict)  # id(group) -> lr at initialize


def _group_of_params(groups: List[Dict[str, Any]], layer_param_ids: Dict[int, Set[int]],
                     names: Dict[int, str]) -> Dict[int, Optional[Dict[str, Any]]]:
    result: Dict[int, Optional[Dict[str, Any]]] = {}
    for layer_id, ids in layer_param_ids.items():
        holders = [g for g in groups if any(id(p) in ids for p in g["params"])]
        if len(holders) > 1:
            settings = [group_hyperparameters(g) for g in holders]
            if any(s != settings[0] for s in settings[1:]):
                raise HecateUnsupportedError(
                    f"the expert parameters of MoE layer '{names[layer_id]}' are spread over optimizer param groups "
                    "with different settings; Hecate needs one setting per layer's experts (put them in one group)")
        result[layer_id] = holders[0] if holders else None
    return result


def prune_expert_params(optimizer: Any, model_parameters: Any, layer_param_ids: Dict[int, Set[int]],
                        names: Dict[int, str]) -> Tuple[Any, ExpertGroups]:
    """Remove expert parameters from a client optimizer and from ``model_parameters``.

    Returns the pruned ``model_parameters`` (a list, or None) and where each layer's experts came from.
    """
    all_ids = set().union(*layer_param_ids.values()) if layer_param_ids else set()
    info = ExpertGroups()
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = optimizer.param_groups
        info.source_group = _group_of_params(groups, layer_param_ids, names)
        for group in groups:
            info.initial_lrs[id(group)] = group.get("lr")
            kept = [p for p in group["params"] if id(p) not in all_ids]
            for p in group["params"]:
                if id(p) in all_ids:
                    optimizer.state.pop(p, None)
            group["params"] = kept
    if model_parameters is not None:
        items = list(model_parameters)
        if items and all(isinstance(i, dict) for i in items):
            if not info.source_group:
                info.source_group = _group_of_params(items, layer_param_ids, names)
            for group in items:
                info.initial_lrs.setdefault(id(group), group.get("lr"))
                group["params"] = [p for p in group["params"] if id(p) not in all_ids]
            model_parameters = items
        else:
            model_parameters = [p for p in items if id(p) not in all_ids]
    return model_parameters, info
