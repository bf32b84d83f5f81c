"""DeepSpeed MoE layers built under ``deepspeed.zero.Init``: expert copies that keep their values.

DeepSpeed's ``Experts`` makes a layer's local experts with ``copy.deepcopy(expert)``. Under ``zero.Init`` (Megatron
builds its model inside one with ``--zero-stage 3``) the template expert is already partitioned: its parameters hold
an empty tensor and their ZeRO attributes, and ``torch.nn.Parameter.__deepcopy__`` copies the data without the
attributes. The copies are then plain parameters of size 0: every expert's values are gone before anything else
sees the model (plain DeepSpeed refuses MoE at ZeRO-3 at ``initialize``, so it never noticed).

:func:`patch_experts` makes each copy from the gathered template, one copy at a time, and partitions it as
``zero.Init`` partitions every parameter it creates (broadcast from rank 0, then sharded), so the model holds each
expert once, partitioned, with the template's values, as it would without ``zero.Init``; Hecate's conversion then
gathers one expert at a time (:func:`ds_hecate.deepspeed_glue.convert.take_over_layer`). Layers built outside
``zero.Init`` are left as DeepSpeed builds them.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from torch import nn


def patch_experts() -> None:
    """Wrap ``deepspeed.moe.experts.Experts.__init__`` (once) as the module docstring says."""
    from deepspeed.moe import experts as ds_experts

    original = ds_experts.Experts.__init__
    if getattr(original, "_hecate_wrapped", False):
        return

    def __init__(self: Any, expert: nn.Module, num_local_experts: int = 1,
                 expert_group_name: Optional[str] = None) -> None:
        context = _active_zero_init(expert)
        if context is None:
            return original(self, expert, num_local_experts, expert_group_name)
        import deepspeed

        original(self, expert, 0, expert_group_name)   # the module itself, with no copy yet
        params = list(expert.parameters())
        copies = []
        for _ in range(num_local_experts):
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                made = copy.deepcopy(expert)   # whole values, plain parameters
            context._convert_to_zero_parameters(list(made.parameters()))   # partitioned, as zero.Init does
            for param in made.parameters():   # DeepSpeed's expert tags, as its __init__ sets them on each copy
                setattr(param, "allreduce", False)
                setattr(param, "group_name", expert_group_name)
            copies.append(made)
        self.deepspeed_experts = nn.ModuleList(copies)
        self.num_local_experts = num_local_experts

    setattr(__init__, "_hecate_wrapped", True)
    ds_experts.Experts.__init__ = __init__


def _active_zero_init(expert: nn.Module) -> Any:
    """The active ``zero.Init`` context when ``expert``'s parameters are partitioned by it, else None."""
    from deepspeed.runtime.zero import partition_parameters

    params = list(expert.parameters())
    context = partition_parameters.top_level_context
    if context is None or not params or not all(partition_parameters.is_zero_param(p) for p in params):
        return None
    if not hasattr(context, "_convert_to_zero_parameters"):   # another DeepSpeed: leave its behaviour as it is
        return None
    return context
