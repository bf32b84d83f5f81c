"""HecateEngine: DeepSpeed's engine with the expert update added, and nothing else changed.

Hooks, all narrow:
- ``backward``: completes the SparseReduceScatters issued asynchronously during backward.
- ``step``: after DeepSpeed's own step (which decides overflow, computes the global norm and advances the LR
  schedule) the expert optimizer steps the owned shards with the same unscale/clip factor and the LR that applied.
- the ZeRO optimizer's ``scaled_global_norm`` (on the instance): adds the expert gradients to the global norm, so
  clipping, overflow detection and ``get_global_grad_norm()`` cover every parameter.
"""
from __future__ import annotations

from typing import List

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import combine_grad_norm_groups

from .errors import HecateUnsupportedError
from .runtime import HecateRuntime


class HecateEngine(DeepSpeedEngine):
    """Class-swapped onto the engine ``deepspeed.initialize`` built; ``engine.hecate`` is the runtime."""

    hecate: HecateRuntime

    def backward(self, loss, *args, **kwargs):
        result = super().backward(loss, *args, **kwargs)
        self.hecate.flush_reductions()  # expert gradients complete on their owners at the end of every backward
        return result

    def step(self, lr_kwargs=None):
        if not self.is_gradient_accumulation_boundary():
            return super().step(lr_kwargs)
        runtime = self.hecate
        lrs: List[float] = runtime.optimizer.current_lrs() if runtime.optimizer is not None else []
        loss_scale = float(getattr(self.optimizer, "loss_scale", 1.0))
        result = super().step(lr_kwargs)
        runtime.apply_step(self.was_step_applied(), self.dp_world_size, loss_scale, self.gradient_clipping(), lrs)
        runtime.after_step(self.global_steps)
        return result


def install_norm_hook(engine: DeepSpeedEngine, runtime: HecateRuntime) -> None:
    """Make the ZeRO optimizer's global gradient norm include the expert gradients (all-reduced once)."""
    optimizer = engine.optimizer
    original = getattr(optimizer, "scaled_global_norm", None)
    if original is None:
        raise HecateUnsupportedError(
            f"Hecate cannot hook the gradient norm of {type(optimizer).__name__}; supported: ZeRO stage 1/2 "
            "(DeepSpeedZeroOptimizer). With bf16 and ZeRO stage 1, set data_types.grad_accum_dtype to 'bf16' or "
            "use stage 2 (DeepSpeed picks its BF16_Optimizer otherwise)")
    dp_world_size = engine.dp_world_size

    def scaled_global_norm(norm_type: int = 2) -> torch.Tensor:
        dense = original(norm_type)
        expert = runtime.expert_grad_norm(dp_world_size).to(device=dense.device, dtype=dense.dtype)
        total = combine_grad_norm_groups([dense, expert], norm_type=norm_type)
        runtime.last_total_norm = total
        return total

    optimizer.scaled_global_norm = scaled_global_norm
