"""Which Hugging Face MoE architectures Hecate takes over, found by the class of their experts module.

transformers (5.x) keeps a model's routed experts in one module per MoE block (``MixtralExperts``,
``Qwen3MoeExperts``, ...) holding fused 3-D parameters, ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]``,
decorated with ``@use_experts_implementation`` so its compute can be swapped through transformers'
``ExpertsInterface``. Hecate keys on those classes: the router, shared experts and everything else stay HF
modules under DeepSpeed; only the routed experts' storage and compute move to Hecate.

Architecture names follow DeepSpeed AutoEP's ``preset_model`` names where both know the model (``mixtral``,
``qwen3_moe``, ``deepseek_v3``). Another architecture with the same fused layout is one call away::

    from ds_hecate.hf import MoEArchitecture, register_architecture
    register_architecture(MoEArchitecture(name="my_moe", experts_classes=("MyMoeExperts",)))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from torch import nn

from ..errors import HecateModelError

DOCS = "docs/huggingface.md#adding-an-architecture"


@dataclass(frozen=True)
class MoEArchitecture:
    """How to find and read one architecture's routed-experts module.

    ``experts_classes``: class names of the experts module (matched on the class and its bases).
    ``gate_up`` / ``down``: names of the fused 3-D parameters, ``[E, 2F, H]`` (gate rows first, then up) and
    ``[E, H, F]``; the expert computes ``down @ (act(gate @ x) * (up @ x))`` with the module's ``act_fn``.
    ``model_types``: HF ``config.model_type`` values (documentation and AutoEP compatibility only).
    """

    name: str
    experts_classes: Tuple[str, ...]
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    model_types: Tuple[str, ...] = ()


ARCHITECTURES: Dict[str, MoEArchitecture] = {}


def register_architecture(arch: MoEArchitecture) -> MoEArchitecture:
    """Add (or replace, by name) an architecture Hecate can take over."""
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
