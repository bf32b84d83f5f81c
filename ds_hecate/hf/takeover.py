"""Taking over a Hugging Face MoE model's routed experts, and keeping HF's save/count paths whole.

:func:`convert_hf_model` runs inside ``deepspeed.initialize`` (``ds_hecate.deepspeed_glue.convert.convert_model``
calls it for a ``transformers.PreTrainedModel`` without native MoE layers). Every experts module of transformers'
experts interface (any class decorated with ``@use_experts_implementation``, found by the layout attributes the
decorator records, whatever its class name) and every registered one outside it (:mod:`ds_hecate.hf.registry`)
is planned first (:func:`ds_hecate.hf.layouts.plan_experts`: what cannot be taken over is refused before anything
changes), then sharded into Hecate (whole experts, one flat vector each, transposed layouts converted once), its
3-D parameters and biases removed from the module (DeepSpeed and ZeRO never see them), and its compute switched to
``"hecate"``; HF's router, its aux loss, shared experts, dense layers and all other modules are untouched.

:class:`HFTakeover` (``model._hecate_hf``) then keeps the HF paths that read weights complete:

- ``model.state_dict()`` contains the full expert tensors of every experts module again, in the module's own
  layout (gathered from their owners; **collective**: call it on every rank, as ``Trainer.save_model`` and
  ``accelerator.get_state_dict`` do). Inside ``engine.save_checkpoint`` the experts are left out (they are saved
  by Hecate as logical experts, and DeepSpeed writes the module state on one rank only).
- ``engine._zero3_consolidated_16bit_state_dict()`` (ZeRO-3 ``save_model``) adds the experts on rank 0.
- ``model.num_parameters()`` and the Trainer's "Number of trainable parameters" count the experts.
"""
from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ..errors import HecateModelError
from ..planning import even_sharding
from ..runtime.shard_store import LayerShard, initial_master
from .experts import IMPLEMENTATION, experts_kernel, hecate_experts_forward, register_experts_implementation
from .interface import module_layout
from .layouts import ExpertsSpec, plan_experts
from .registry import ARCHITECTURES, DOCS, architecture_of

if TYPE_CHECKING:
    from ..runtime.hecate import HecateRuntime


def find_experts_modules(model: nn.Module) -> List[Tuple[str, nn.Module, ExpertsSpec]]:
    """(qualified name, experts module, spec) of every routed-experts module of ``model``: those of the experts
    interface, and registered ones outside it. Raises, naming the module, where one cannot be taken over."""
    found = []
    for name, module in model.named_modules():
        if "_hecate_binding" in module.__dict__:
            raise HecateModelError(f"experts module '{name}' is already taken over by Hecate (initialize called "
                                   "twice?)")
        if module_layout(module) is not None:
            found.append((name, module, plan_experts(name, module)))
            continue
        arch = architecture_of(module)
        if arch is not None:
            # without a gate the first projection is the up projection (``up_proj`` unless named otherwise)
            first = arch.gate_up if arch.layout.gate or arch.gate_up != "gate_up_proj" else "up_proj"
            found.append((name, module, plan_experts(name, module, arch.layout, (first, arch.down))))
    return found


def experts_counts(model: nn.Module) -> List[int]:
    """The expert count of every experts module Hecate would take over (before anything is taken over)."""
    return [spec.num_experts for _, _, spec in find_experts_modules(model)]


def no_moe_block_error(model: nn.Module) -> HecateModelError:
    known = ", ".join(f"{a.name} ({'/'.join(a.experts_classes)})" for a in ARCHITECTURES.values())
    return HecateModelError(
        f"hecate.enabled is true but {type(model).__name__} has no MoE block Hecate supports: no module of "
        f"transformers' experts interface (@use_experts_implementation) and no registered experts class (known: "
        f"{known}); register the model's experts class as shown in {DOCS}, or set hecate.enabled to false")


def _full_tensors(module: nn.Module, spec: ExpertsSpec) -> Dict[str, torch.Tensor]:
    """The module's expert tensors, whole (gathered once from their ZeRO-3 partitions under ``zero.Init``)."""
    params = [getattr(module, n) for n in spec.names]
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().clone() for n, p in zip(spec.names, params)}
    return {n: p.detach() for n, p in zip(spec.names, params)}


def _take_over(name: str, module: nn.Module, spec: ExpertsSpec, runtime) -> Set[int]:
    tensors = _full_tensors(module, spec)
    kernel = experts_kernel(spec, module, f"experts module '{name}' ({type(module).__name__})")
    local = {e: initial_master(spec.expert_flat(tensors, e), runtime.compute_dtype) for e in range(spec.num_experts)}
    owners = even_sharding(spec.num_experts, runtime.ep_size)   # inside the rank's group
    shard = LayerShard(layer_id=len(runtime.bindings), name=name, num_experts=spec.num_experts, kernel=kernel,
                       owners=owners, rank=runtime.rank)
    # Rank 0's weights, as DeepSpeed's broadcast at initialize gives every dense parameter.
    runtime.take_experts(shard, (0,) * spec.num_experts, local)
    binding = runtime.add_layer(name, shard, spec.hidden)
    removed = {id(module._parameters[n]) for n in spec.names}
    for n in spec.names:
        del module._parameters[n]
    module.__dict__["_hecate_binding"] = binding
    module.__dict__["_hecate_spec"] = spec
    return removed


def convert_hf_model(model: nn.Module, runtime) -> Dict[int, Set[int]]:
    """Take over every experts module of ``model``; per Hecate layer id, the ids of removed params. Every module
    is checked before the first is taken over, so a refusal leaves the model as it was."""
    register_experts_implementation()
    found = find_experts_modules(model)
    if not found:
        raise no_moe_block_error(model)
    for name, module, _ in found:
        if module_layout(module) is not None and getattr(module, "config", None) is None:
            raise HecateModelError(f"experts module '{name}' ({type(module).__name__}) has no config; Hecate selects "
                                   "its compute through config._experts_implementation (@use_experts_implementation)")
    removed: Dict[int, Set[int]] = {}
    for name, module, spec in found:
        layer_id = len(runtime.bindings)
        removed[layer_id] = _take_over(name, module, spec, runtime)
    configs: Dict[int, Any] = {}   # id -> the experts' (transformers) config
    for _, module, _ in found:
        if module_layout(module) is not None:
            configs[id(module.config)] = module.config
        else:   # outside the interface: the module's own forward becomes Hecate's
            module.forward = functools.partial(hecate_experts_forward, module)
    for config in configs.values():
        config._experts_implementation = IMPLEMENTATION
    takeover = HFTakeover(model, runtime, [(n, m) for n, m, _ in found])
    model.__dict__["_hecate_hf"] = takeover
    return removed


class HFTakeover:
    """Keeps a converted HF model's state dict, 16-bit consolidation and parameter counts whole."""

    def __init__(self, model: nn.Module, runtime: HecateRuntime, modules: List[Tuple[str, nn.Module]]) -> None:
        self.model = model
        self.runtime = runtime
        self.modules = modules
        self.export_enabled = True
        self.engine: Any = None
        for layer_id, (_, module) in enumerate(modules):
            module._register_state_dict_hook(functools.partial(self._state_dict_hook, layer_id))
        original = getattr(model, "num_parameters", None)
        if original is not None:
            @functools.wraps(original)
            def num_parameters(only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
                return original(only_trainable=only_trainable, exclude_embeddings=exclude_embeddings) + \
                    self.expert_parameter_count()
            setattr(model, "num_parameters", num_parameters)
        self._stored_shapes = {f"{name}.{p.name}" if name else p.name: p.stored_shape(spec.num_experts)
                               for name, module in modules
                               for spec in [module.__dict__["_hecate_spec"]] for p in spec.params}
        get_parameter = model.get_parameter

        @functools.wraps(get_parameter)
        def get_parameter_or_expert(target: str) -> nn.Parameter:
            """A taken-over expert tensor's name gives a meta placeholder of its full shape: what transformers'
            save path reads (``save_pretrained`` reverting a family's weight conversion asks for the shape of
            ``...experts.down_proj`` to decide whether to transpose it, e.g. Qwen3-VL-MoE)."""
            shape = self._stored_shapes.get(target)
            if shape is None:
                return get_parameter(target)
            return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
        setattr(model, "get_parameter", get_parameter_or_expert)

    # -- counts ---------------------------------------------------------------------------------------------
    def expert_parameter_count(self) -> int:
        return sum(b.shard.num_experts * b.shard.kernel.numel for b in self.runtime.bindings
                   if any(m.__dict__.get("_hecate_binding") is b for _, m in self.modules))

    # -- full expert tensors ----------------------------------------------------------------------------------
    def _fused(self, layer_id: int, flats: torch.Tensor, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
        """``[E, numel]`` flat experts of one layer as the module's own tensors (``gate_up_proj`` ``[E, 2F, H]``,
        or transposed, biases, ...), each with storage of its own."""
        _, module = self.modules[layer_id]
        return module.__dict__["_hecate_spec"].to_module_layout(flats, dtype)

    def layer_experts(self, layer_id: int) -> Dict[str, torch.Tensor]:
        """One experts module's fused tensors on every rank (compute dtype): a SparseAllGather to "every rank
        holds every expert" of that layer only. Collective."""
        rt = self.runtime
        rt.drop_pending()
        binding = self.modules[layer_id][1].__dict__["_hecate_binding"]
        return self._fused(layer_id, rt.full_layer_weights(binding), rt.compute_dtype)

    def full_experts(self) -> List[Dict[str, torch.Tensor]]:
        """Every experts module's fused tensors, on every rank (compute dtype). Collective."""
        return [self.layer_experts(i) for i in range(len(self.modules))]

    def _state_dict_hook(self, layer_id: int, module: nn.Module, state_dict: Dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
        if self.export_enabled:
            state_dict.update({prefix + key: value for key, value in self.layer_experts(layer_id).items()})

    # -- engine glue ------------------------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        """Called by ``ds_hecate.initialize`` once the engine exists."""
        self.engine = engine
        takeover = self
        save_checkpoint = engine.save_checkpoint
        consolidated = engine._zero3_consolidated_16bit_state_dict

        @functools.wraps(save_checkpoint)
        def save_without_expert_keys(*args, **kwargs):
            takeover.export_enabled = False
            try:
                return save_checkpoint(*args, **kwargs)
            finally:
                takeover.export_enabled = True

        @functools.wraps(consolidated)
        def consolidated_with_experts(*args, **kwargs):
            takeover.export_enabled = False
            try:
                state = consolidated(*args, **kwargs)
            finally:
                takeover.export_enabled = True
            rank0 = takeover.runtime.layout.global_rank == 0
            names = {id(m): n for n, m in engine.module.named_modules()}
            for layer_id, fused in enumerate(takeover.full_experts()):
                if rank0:
                    prefix = names[id(takeover.modules[layer_id][1])]
                    for key, value in fused.items():
                        state[f"{prefix}.{key}" if prefix else key] = value.cpu()
            return state

        engine.save_checkpoint = save_without_expert_keys
        engine._zero3_consolidated_16bit_state_dict = consolidated_with_experts


def hecate_of(model: nn.Module) -> Optional[HFTakeover]:
    """The takeover record of a converted HF model (unwraps a DeepSpeed engine), else None."""
    inner = getattr(model, "module", model)
    return inner.__dict__.get("_hecate_hf") if isinstance(inner, nn.Module) else None


def patch_trainer_param_count() -> None:
    """Make the Trainer's "Number of trainable parameters" log count Hecate's experts (idempotent).

    ``transformers.trainer.get_model_param_count`` sums ``model.parameters()``, which no longer hold the experts;
    the wrapper adds them for converted models and is the original for every other model.
    """
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None:  # the Trainer is not in use
        return
    original = getattr(trainer_module, "get_model_param_count", None)
    if original is None or getattr(original, "_hecate", False):
        return

    @functools.wraps(original)
    def get_model_param_count(model, trainable_only=False):
        takeover = hecate_of(model)
        extra = takeover.expert_parameter_count() if takeover is not None else 0
        return original(model, trainable_only=trainable_only) + extra

    setattr(get_model_param_count, "_hecate", True)
    setattr(trainer_module, "get_model_param_count", get_model_param_count)
