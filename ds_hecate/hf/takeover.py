"""Taking over a Hugging Face MoE model's routed experts, and keeping HF's save/count paths whole.

:func:`convert_hf_model` runs inside ``deepspeed.initialize`` (``ds_hecate.deepspeed_glue.convert.convert_model`` calls it for a
``transformers.PreTrainedModel`` without native MoE layers). For every experts module of a registered
architecture it shards the experts into Hecate (whole experts: expert ``e`` is ``gate_up_proj[e]`` then
``down_proj[e]`` as one flat vector), removes the 3-D parameters from the module (DeepSpeed and ZeRO never see
them) and switches the model's experts implementation to ``"hecate"``; HF's router, its aux loss, shared experts
and all other modules are untouched.

:class:`HFTakeover` (``model._hecate_hf``) then keeps the HF paths that read weights complete:

- ``model.state_dict()`` contains the full ``gate_up_proj`` / ``down_proj`` of every experts module again
  (gathered from their owners; **collective**: call it on every rank, as ``Trainer.save_model`` and
  ``accelerator.get_state_dict`` do). Inside ``engine.save_checkpoint`` the experts are left out (they are saved
  by Hecate as logical experts, and DeepSpeed writes the module state on one rank only).
- ``engine._zero3_consolidated_16bit_state_dict()`` (ZeRO-3 ``save_model``) adds the experts on rank 0.
- ``model.num_parameters()`` and the Trainer's "Number of trainable parameters" count the experts.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ..errors import HecateModelError
from ..planning import even_sharding
from ..runtime.shard_store import LayerShard, initial_master
from .experts import IMPLEMENTATION, fused_expert_kernel, register_experts_implementation
from .registry import ARCHITECTURES, DOCS, MoEArchitecture, architecture_of


def find_experts_modules(model: nn.Module) -> List[Tuple[str, nn.Module, MoEArchitecture]]:
    """(qualified name, experts module, architecture) of every routed-experts module Hecate supports."""
    found = []
    for name, module in model.named_modules():
        arch = architecture_of(module)
        if arch is not None:
            found.append((name, module, arch))
    return found


def no_moe_block_error(model: nn.Module) -> HecateModelError:
    known = ", ".join(f"{a.name} ({'/'.join(a.experts_classes)})" for a in ARCHITECTURES.values())
    return HecateModelError(
        f"hecate.enabled is true but {type(model).__name__} has no MoE block Hecate supports (known experts "
        f"classes: {known}); register the model's experts class as shown in {DOCS}, or set hecate.enabled to false")


def _check_layout(name: str, module: nn.Module, arch: MoEArchitecture) -> Tuple[nn.Parameter, nn.Parameter]:
    for flag, wanted in (("has_bias", False), ("is_transposed", False), ("has_gate", True)):
        if getattr(module, flag, wanted) != wanted:
            raise HecateModelError(f"experts module '{name}' ({type(module).__name__}) has {flag}="
                                   f"{getattr(module, flag)}; Hecate supports fused gate_up/down experts without "
                                   f"bias or transposition (see {DOCS})")
    gate_up, down = getattr(module, arch.gate_up, None), getattr(module, arch.down, None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        raise HecateModelError(f"experts module '{name}' ({type(module).__name__}) has no parameters "
                               f"'{arch.gate_up}' and '{arch.down}' (architecture '{arch.name}'; see {DOCS})")
    shape_gu = tuple(getattr(gate_up, "ds_shape", gate_up.shape))
    shape_d = tuple(getattr(down, "ds_shape", down.shape))
    if (len(shape_gu) != 3 or len(shape_d) != 3 or shape_gu[0] != shape_d[0] or shape_gu[2] != shape_d[1]
            or shape_gu[1] != 2 * shape_d[2]):
        raise HecateModelError(f"experts module '{name}': {arch.gate_up} {list(shape_gu)} and {arch.down} "
                               f"{list(shape_d)} are not [E, 2F, H] and [E, H, F]")
    if type(module)._apply_gate.__name__ != "_default_apply_gate":
        raise HecateModelError(f"experts module '{name}' ({type(module).__name__}) has its own gating "
                               f"(_apply_gate); Hecate supports the default act(gate) * up (see {DOCS})")
    return gate_up, down


def _take_over(name: str, module: nn.Module, arch: MoEArchitecture, runtime) -> Set[int]:
    gate_up, down = _check_layout(name, module, arch)
    if hasattr(gate_up, "ds_id") or hasattr(down, "ds_id"):  # built under zero.Init: partitioned
        import deepspeed
        with deepspeed.zero.GatheredParameters([gate_up, down], modifier_rank=None):
            full_gu, full_d = gate_up.detach().clone(), down.detach().clone()
    else:
        full_gu, full_d = gate_up.detach(), down.detach()
    num_experts = full_gu.shape[0]
    kernel = fused_expert_kernel(full_gu.shape[1:], full_d.shape[1:], module.act_fn,
                                 f"experts module '{name}' ({type(module).__name__})")
    local = {e: initial_master(torch.cat([full_gu[e].reshape(-1), full_d[e].reshape(-1)]), runtime.compute_dtype)
             for e in range(num_experts)}
    owners = even_sharding(num_experts, runtime.ep_size)   # inside the rank's group
    shard = LayerShard(layer_id=len(runtime.bindings), name=name, num_experts=num_experts, kernel=kernel,
                       owners=owners, rank=runtime.rank)
    # Rank 0's weights, as DeepSpeed's broadcast at initialize gives every dense parameter.
    runtime.take_experts(shard, (0,) * num_experts, local)
    binding = runtime.add_layer(name, shard, full_gu.shape[2])
    removed = {id(gate_up), id(down)}
    del module._parameters[arch.gate_up]
    del module._parameters[arch.down]
    module.__dict__["_hecate_binding"] = binding
    module.__dict__["_hecate_param_names"] = (arch.gate_up, arch.down)
    return removed


def convert_hf_model(model: nn.Module, runtime) -> Dict[int, Set[int]]:
    """Take over every supported experts module of ``model``; per Hecate layer id, the ids of removed params."""
    register_experts_implementation()
    found = find_experts_modules(model)
    if not found:
        raise no_moe_block_error(model)
    removed: Dict[int, Set[int]] = {}
    for name, module, arch in found:
        if "_hecate_binding" in module.__dict__:
            raise HecateModelError(f"experts module '{name}' is already taken over by Hecate (initialize called "
                                   "twice?)")
        layer_id = len(runtime.bindings)
        removed[layer_id] = _take_over(name, module, arch, runtime)
    for name, module, _ in found:
        if getattr(module, "config", None) is None:
            raise HecateModelError(f"experts module '{name}' ({type(module).__name__}) has no config; Hecate selects "
                                   "its compute through config._experts_implementation (@use_experts_implementation)")
    configs = {id(m.config): m.config for _, m, _ in found}
    for config in configs.values():
        config._experts_implementation = IMPLEMENTATION
    takeover = HFTakeover(model, runtime, [(n, m) for n, m, _ in found])
    model.__dict__["_hecate_hf"] = takeover
    return removed


class HFTakeover:
    """Keeps a converted HF model's state dict, 16-bit consolidation and parameter counts whole."""

    def __init__(self, model: nn.Module, runtime, modules: List[Tuple[str, nn.Module]]) -> None:
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
            model.num_parameters = num_parameters

    # -- counts ---------------------------------------------------------------------------------------------
    def expert_parameter_count(self) -> int:
        return sum(b.shard.num_experts * b.shard.kernel.numel for b in self.runtime.bindings
                   if any(m.__dict__.get("_hecate_binding") is b for _, m in self.modules))

    # -- full expert tensors ----------------------------------------------------------------------------------
    def _fused(self, layer_id: int, flats: torch.Tensor, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
        """``[E, numel]`` flat experts of one layer as HF's fused ``{gate_up_proj: [E,2F,H], down_proj: [E,H,F]}``."""
        _, module = self.modules[layer_id]
        kernel = module.__dict__["_hecate_binding"].shard.kernel
        names = module.__dict__["_hecate_param_names"]
        out, offset = {}, 0
        for hf_name, shape, numel in zip(names, kernel.shapes, kernel.numels):
            piece = flats[:, offset:offset + numel].reshape((flats.shape[0],) + tuple(shape))
            out[hf_name] = piece.to(dtype).clone(memory_format=torch.contiguous_format)  # own storage each
            offset += numel
        return out

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

    get_model_param_count._hecate = True
    trainer_module.get_model_param_count = get_model_param_count
