"""Experts modules outside transformers' experts interface, registered by class name.

Hecate takes over every experts module of transformers' experts interface by itself, reading the layout the
``@use_experts_implementation`` decorator records (:mod:`ds_hecate.hf.interface`); nothing needs registering for
those. A registration is for an experts module *outside* the interface: a class of your own (or of a release that
predates the decorator's attributes) with fused 3-D parameters, ``forward(hidden_states, top_k_index,
top_k_weights)``, and the layout stated in :class:`~ds_hecate.hf.interface.ExpertsLayout`. Hecate then replaces that
module's forward with its own at take-over::

    from ds_hecate.hf import ExpertsLayout, MoEArchitecture, register_architecture
    register_architecture(MoEArchitecture(name="my_moe", experts_classes=("MyMoeExperts",)))
    register_architecture(MoEArchitecture("my_biased_moe", ("MyBiasedExperts",), layout=ExpertsLayout(bias=True)))

The entries below name interface classes for the docs and for DeepSpeed AutoEP's ``preset_model`` names
(``mixtral``, ``qwen3_moe``, ``deepseek_v3``); the interface finds them without the registry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from torch import nn

from ..errors import HecateModelError
from .interface import ExpertsLayout

DOCS = "docs/huggingface.md#adding-an-architecture"


@dataclass(frozen=True)
class MoEArchitecture:
    """How to find and read one experts module outside the interface.

    ``experts_classes``: class names of the experts module (matched on the class and its bases).
    ``gate_up`` / ``down``: names of the fused 3-D parameters (``up`` when the layout has no gate); biases are
    ``<name>_bias``. ``layout``: how they are stored and computed (default: gate rows then up rows, ``[E, out,
    in]``, no bias, ``act_fn(gate) * up``). ``model_types``: HF ``config.model_type`` values (documentation and
    AutoEP compatibility only).
    """

    name: str
    experts_classes: Tuple[str, ...]
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    model_types: Tuple[str, ...] = ()
    layout: ExpertsLayout = field(default_factory=ExpertsLayout)


ARCHITECTURES: Dict[str, MoEArchitecture] = {}


def register_architecture(arch: MoEArchitecture) -> MoEArchitecture:
    """Add (or replace, by name) an experts module Hecate can take over."""
    if not arch.experts_classes:
        raise HecateModelError(f"MoE architecture '{arch.name}' names no experts class")
    ARCHITECTURES[arch.name] = arch
    return arch


for _arch in (
        MoEArchitecture("mixtral", ("MixtralExperts",), model_types=("mixtral",)),
        MoEArchitecture("qwen3_moe", ("Qwen3MoeExperts",), model_types=("qwen3_moe",)),
        MoEArchitecture("qwen2_moe", ("Qwen2MoeExperts",), model_types=("qwen2_moe",)),
        MoEArchitecture("olmoe", ("OlmoeExperts",), model_types=("olmoe",)),
        # transformers 5.10 names the experts class DeepseekV3NaiveMoe; 5.24 renamed it DeepseekV3Experts
        MoEArchitecture("deepseek_v3", ("DeepseekV3NaiveMoe", "DeepseekV3Experts"), model_types=("deepseek_v3",)),
):
    register_architecture(_arch)


def architecture_of(module: nn.Module) -> Optional[MoEArchitecture]:
    """The registered architecture whose experts class ``module`` is (or derives from), else None."""
    names = {cls.__name__ for cls in type(module).__mro__}
    for arch in ARCHITECTURES.values():
        if names.intersection(arch.experts_classes):
            return arch
    return None
