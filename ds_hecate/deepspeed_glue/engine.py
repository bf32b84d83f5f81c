"""HecateEngine: DeepSpeed's engine with the expert update added, and nothing else changed.

Hooks, all narrow:
- ``save_checkpoint`` / ``load_checkpoint``: add the experts (``ds_hecate.deepspeed_glue.checkpoint``) around DeepSpeed's own.
- ``clip_fp32_gradients`` (ZeRO stage 0): clips by the norm over dense and expert gradients.
- ``forward``: with groups, the world agrees on a bad gate any group saw (every rank raises the same error).
- ``backward``: completes the SparseReduceScatters issued asynchronously during backward.
- ``step``: after DeepSpeed's own step (which decides overflow, computes the global norm and advances the LR
  schedule) the expert optimizer steps the owned shards with the same unscale/clip factor and the LR that applied;
  then the step's per-layer metrics go to DeepSpeed's monitor (``ds_hecate.deepspeed_glue.monitor``).
- the ZeRO optimizer's ``scaled_global_norm`` / ``_get_norm_groups`` (on the instance): adds the expert gradients
  to the global norm, so clipping, overflow detection and ``get_global_grad_norm()`` cover every parameter.
"""
from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING, Any, cast

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.utils import combine_grad_norm_groups

from . import checkpoint
from . import monitor
from ..errors import HecateUnsupportedError
from ..runtime.hecate import HecateRuntime

if TYPE_CHECKING:   # the expert optimizer this glue installs (initialize.py): the runtime types it as an ExpertStepper
    from .expert_optimizer import ExpertOptimizer


class HecateEngine(DeepSpeedEngine):
    """Class-swapped onto the engine ``deepspeed.initialize`` built; ``engine.hecate`` is the runtime."""

    hecate: HecateRuntime

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint plus every expert (``<tag>/hecate``), written before DeepSpeed's files; then the
        completion mark (``<tag>/hecate/complete.json``) and ``latest``, so ``latest`` never points at a checkpoint
        whose files are incomplete, and a tag whose save did not complete is refused by name.

        ``latest`` is written here, once every rank has written its DeepSpeed files too: DeepSpeed's rank 0 writes
        it as soon as its own files are written, so a rank dying while it writes its optimizer state would leave
        ``latest`` naming a checkpoint that cannot be loaded."""
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        checkpoint.save(self.hecate, os.path.join(save_dir, tag))
        # DeepSpeed's model-state file records where the experts are: ds_to_universal copies that file into the
        # universal checkpoint, so a universal load finds them with no extra step.
        client_state = {**client_state, checkpoint.CLIENT_STATE_KEY: {"expert_tag": tag}}
        commit_here = save_latest and not self.checkpoint_engine.is_decoupled()
        result = super().save_checkpoint(save_dir, tag, client_state, save_latest and not commit_here,
                                         exclude_frozen_parameters)  # ends with a barrier: every rank's files are in
        if not self.checkpoint_engine.is_decoupled():   # a decoupled engine's files are complete at its commit
            checkpoint.mark_complete(self.hecate, os.path.join(save_dir, tag), tag)
        if commit_here:
            checkpoint.write_latest(self.hecate, save_dir, tag, self.global_rank == 0)
        return result

    def _commit_decoupled_checkpoint(self):
        """A decoupled checkpoint engine (DeepSpeed's asynchronous writers) persists the files at its commit: the
        completion mark goes after the commit and before ``latest``, as in a synchronous save."""
        info = self.checkpoint_engine.get_commit_info()
        if info is None:
            return
        self.checkpoint_engine.commit(info)
        checkpoint.mark_complete(self.hecate, os.path.join(info.save_dir, info.tag), info.tag)
        checkpoint.write_latest(self.hecate, info.save_dir, info.tag, self.global_rank == 0 and info.save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """Validates the expert state first (nothing is loaded if it is incomplete), then loads DeepSpeed's
        state, then installs the experts."""
        if tag is None:
            latest = os.path.join(load_dir, "latest_universal" if self.load_universal_checkpoint() else "latest")
            if not os.path.isfile(latest):
                return super().load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                               load_lr_scheduler_states, load_module_only, custom_load_fn)
            with open(latest, encoding="utf-8") as f:
                tag = f.read().strip()
        expert_dir = checkpoint.expert_checkpoint_dir(load_dir, str(tag), self.load_universal_checkpoint())
        install = checkpoint.prepare_load(self.hecate, expert_dir,
                                          load_optimizer_states and not load_module_only)
        dense_groups = list(self.basic_optimizer.param_groups) if self.hecate.optimizer is not None else []
        result = super().load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                         load_lr_scheduler_states, load_module_only, custom_load_fn)
        if self.hecate.optimizer is not None:  # the LR schedule now drives the loaded groups: experts follow them
            cast("ExpertOptimizer", self.hecate.optimizer).follow_replaced_groups(dense_groups,
                                                                                  self.basic_optimizer.param_groups)
        if result[0] is not None:
            install()
            if load_optimizer_states and not load_module_only and self.hecate.optimizer is not None:
                # the loaded state already holds DeepSpeed's
                cast("ExpertOptimizer", self.hecate.optimizer).add_initial_step(None)
            self.hecate.global_steps = self.global_steps  # trace step numbers continue from the checkpoint
        return result

    def forward(self, *inputs, **kwargs):
        """DeepSpeed's forward, then (with groups) the world's agreement on any bad gate a group saw, so every rank
        of every group stops here with the same error (``ds_hecate.runtime.stops``)."""
        result = super().forward(*inputs, **kwargs)
        self.hecate.stops.agree()
        return result

    def clip_fp32_gradients(self):
        """ZeRO stage 0 (fp32): clip dense and expert gradients by their joint norm, as DeepSpeed clips all
        parameters of a data-parallel model; the norm is also what ``get_global_grad_norm()`` reports."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        dense_sq = _dense_grad_sq(params, self.mpu)
        expert = self.hecate.expert_grad_norm(self.dp_world_size)
        total = torch.sqrt(dense_sq + expert.pow(2))
        self.hecate.last_total_norm = total
        coef = torch.clamp(self.gradient_clipping() / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.data.mul_(coef)
        self._global_grad_norm = total

    def backward(self, loss, *args, **kwargs):
        # the last micro-batch of a window: with groups and partitioned expert state the reductions over the
        # expert-data-parallel peers run during this backward, layer by layer (HecateRuntime.flush_reductions)
        self.hecate.at_boundary = self.is_gradient_accumulation_boundary()
        try:
            result = super().backward(loss, *args, **kwargs)
            self.hecate.flush_reductions()  # expert gradients complete on their owners at the end of every backward
        finally:
            self.hecate.at_boundary = False
        return result

    def step(self, lr_kwargs=None):
        if not self.is_gradient_accumulation_boundary():
            return super().step(lr_kwargs)
        runtime = self.hecate
        hyper = runtime.optimizer.current_hyperparameters() if runtime.optimizer is not None else []
        result = super().step(lr_kwargs)
        # The factor DeepSpeed's optimizer divided the dense gradients by in this step. ZeRO-1/2/3 update the loss
        # scale before unscaling, so on a step where the scale grows dense gradients are divided by the new scale;
        # the experts take the same factor, so dense and expert parameters step as in data-parallel training.
        loss_scale = float(getattr(self.optimizer, "loss_scale", 1.0))
        if runtime.norm_from_optimizer:  # BF16_Optimizer: the joint norm it computed
            norm = getattr(self.optimizer, "_global_grad_norm", None)
            runtime.last_total_norm = torch.as_tensor(float(norm)) if norm is not None else None
        runtime.apply_step(self.was_step_applied(), self.dp_world_size, loss_scale, self.gradient_clipping(), hyper)
        runtime.after_step(self.global_steps)
        monitor.end_step(self)  # per-layer events to DeepSpeed's monitor (rank 0, when one is configured)
        return result


def _dense_grad_sq(params: list, mpu: Any) -> torch.Tensor:
    """Squared L2 norm of the dense gradients, as DeepSpeed's ``clip_grad_norm_`` counts it: with a model-parallel
    unit, parameters replicated over the model-parallel ranks once (on model-parallel rank 0) and tensor-parallel
    ones on every rank, summed over the model-parallel group."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    counted = [p for p in params if mpu is None or mpu.get_model_parallel_rank() == 0
               or is_model_parallel_parameter(p)]
    dense_sq = (torch.stack([p.grad.detach().float().norm(2) for p in counted]).pow(2).sum() if counted
                else torch.zeros((), dtype=torch.float32, device=params[0].grad.device if params else None))
    if mpu is not None:
        import torch.distributed as dist
        dist.all_reduce(dense_sq, group=mpu.get_model_parallel_group())
    return dense_sq


# (runtime, dp world size) of the ZeRO stage-0 steps in progress (FP16_Optimizer, FP16_UnfusedOptimizer). Both
# combine their gradient norms with their module's function ``get_global_norm``, wrapped once per module to
# append the experts' norm while one of Hecate's steps runs.
_EXTRA_NORMS: list = []


def _wrap_global_norm(module: Any) -> None:
    """Once per process and module: ``module.get_global_norm`` appends the expert norm of the step in progress
    (if any) and records the joint norm (loss-scaled, as both optimizers' clip and overflow checks use it)."""
    if getattr(module.get_global_norm, "_hecate_wrapped", False):
        return
    original = module.get_global_norm

    def get_global_norm(norm_list):
        if not _EXTRA_NORMS:
            return original(norm_list)
        runtime, dp_world_size = _EXTRA_NORMS[-1]
        expert = float(runtime.expert_grad_norm(dp_world_size))
        # FP16_Optimizer's norm covers the experts (get_norm_with_moe_layers); FP16_UnfusedOptimizer's leaves them
        # out (its overflow check alone covers them), so there the experts only enter when non-finite.
        if module.__name__.endswith("unfused_optimizer") and math.isfinite(expert):
            total = original(norm_list)
        else:
            total = original(list(norm_list) + [expert])
        runtime.last_total_norm = torch.as_tensor(float(total))
        return total
    setattr(get_global_norm, "_hecate_wrapped", True)
    module.get_global_norm = get_global_norm


def install_norm_hook(engine: DeepSpeedEngine, runtime: HecateRuntime) -> None:
    """Make the ZeRO optimizer's global gradient norm include the expert gradients (all-reduced once).

    ZeRO-1/2 compute it in ``scaled_global_norm``, ZeRO-3 from the per-group norms of ``_get_norm_groups``; the
    hook adds the experts' norm in the same (loss-scaled, averaged) units and records the total for the expert
    clip factor.
    """
    optimizer = engine.optimizer
    dp_world_size = engine.dp_world_size

    def expert_norm_like(reference: torch.Tensor) -> torch.Tensor:
        return runtime.expert_grad_norm(dp_world_size).to(device=reference.device, dtype=reference.dtype)

    if hasattr(optimizer, "scaled_global_norm"):
        original = optimizer.scaled_global_norm

        def scaled_global_norm(norm_type: int = 2) -> torch.Tensor:
            dense = original(norm_type)
            total = combine_grad_norm_groups([dense, expert_norm_like(dense)], norm_type=norm_type)
            runtime.last_total_norm = total
            return total

        optimizer.scaled_global_norm = scaled_global_norm
    elif hasattr(optimizer, "_get_norm_groups"):
        original_groups = optimizer._get_norm_groups

        def _get_norm_groups():
            groups = list(original_groups())
            reference = next((g for g in groups if torch.is_tensor(g)), torch.zeros((), dtype=torch.float32))
            groups.append(expert_norm_like(reference))
            runtime.last_total_norm = combine_grad_norm_groups(groups)
            return groups

        optimizer._get_norm_groups = _get_norm_groups
    elif hasattr(optimizer, "get_grads_for_norm"):  # BF16_Optimizer (bf16 with ZeRO stage 0 or 1): full local grads
        original_grads = optimizer.get_grads_for_norm

        def get_grads_for_norm(for_clipping: bool = False):
            result = original_grads(for_clipping=for_clipping)
            if for_clipping:  # the clip factor reaches the experts through apply_step
                return result
            dense, expert_groups = result
            reference = dense[0] if dense else torch.zeros(1, dtype=torch.float32)
            # a one-element tensor whose norm is the experts' norm joins the dense tensors' norm
            dense = list(dense) + [expert_norm_like(reference).reshape(1)]
            return dense, expert_groups

        optimizer.get_grads_for_norm = get_grads_for_norm
        runtime.norm_from_optimizer = True
    elif isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        # ZeRO stage 0: fp16 (FP16_Optimizer over FusedAdam, FP16_UnfusedOptimizer over other optimizers) and bf16
        # (FP16_UnfusedOptimizer in bf16 mode). Their overflow check and clip factor read the joint norm, so an
        # expert overflow on any rank skips the step (and lowers the loss scale) on every rank.
        if getattr(optimizer, "fused_adam_legacy", False) or getattr(optimizer, "fused_lamb_legacy", False):
            raise HecateUnsupportedError(
                "Hecate cannot hook the gradient norm of DeepSpeed's legacy fused fp16 step (optimizer.legacy_fusion, "
                "or the Lamb optimizer with ZeRO stage 0); use ZeRO stage 1-3 or another optimizer")
        _wrap_global_norm(sys.modules[type(optimizer).__module__])
        original_step = optimizer.step

        def step(closure=None):
            _EXTRA_NORMS.append((runtime, dp_world_size))
            try:
                return original_step(closure)
            finally:
                _EXTRA_NORMS.pop()
        optimizer.step = step
    else:
        raise HecateUnsupportedError(
            f"Hecate cannot hook the gradient norm of {type(optimizer).__name__}; supported: ZeRO stage 1/2 "
            "(DeepSpeedZeroOptimizer) and 3 (DeepSpeedZeroOptimizer_Stage3). With bf16 and ZeRO stage 1, set "
            "data_types.grad_accum_dtype to 'bf16' or use stage 2 (DeepSpeed picks its BF16_Optimizer otherwise)")
