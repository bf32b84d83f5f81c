"""Hugging Face integration: the Trainer (through DeepSpeed) trains transformers MoE models with Hecate.

Nothing to call: with ``import ds_hecate`` in the training script and a DeepSpeed config holding an enabled
``hecate`` section, ``deepspeed.initialize`` (reached by the Trainer through accelerate) converts the model's
routed experts (see :mod:`ds_hecate.hf.takeover`): every experts module of transformers' experts interface
(:mod:`ds_hecate.hf.interface`, its layout read by :mod:`ds_hecate.hf.layouts`), and registered ones outside it
(:mod:`ds_hecate.hf.registry`). This package registers the ``"hecate"`` experts implementation in transformers;
the export of a Hecate checkpoint to an HF checkpoint directory reads the DeepSpeed glue's checkpoints, so it
lives above both (:mod:`ds_hecate.tools.export_hf`, ``ds-hecate export-hf``), as does the table of the installed
transformers' experts classes (``ds-hecate models``). Tested with transformers 5.10.x and 5.25.
"""
from .experts import IMPLEMENTATION, hecate_experts_forward, register_experts_implementation
from .interface import ExpertsLayout
from .registry import ARCHITECTURES, MoEArchitecture, architecture_of, register_architecture
from ..moe_layer import num_parameters
from .takeover import HFTakeover, convert_hf_model, find_experts_modules, hecate_of

register_experts_implementation()
from .takeover import patch_trainer_param_count  # noqa: E402

patch_trainer_param_count()

__all__ = ["ARCHITECTURES", "ExpertsLayout", "HFTakeover", "IMPLEMENTATION", "MoEArchitecture", "architecture_of",
           "convert_hf_model", "find_experts_modules", "hecate_experts_forward", "hecate_of", "num_parameters",
           "register_architecture", "register_experts_implementation"]
