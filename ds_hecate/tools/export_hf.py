"""Export a Hecate checkpoint of a Hugging Face MoE model as a normal HF checkpoint directory (safetensors).

Dense weights come from DeepSpeed's ``zero_to_fp32``, experts from ``<tag>/hecate``
(``ds_hecate.deepspeed_glue.consolidate``, layout ``"hf"``): each experts module's per-expert vectors are stacked
back into the module's own tensors (``gate_up_proj`` or ``up_proj``, ``down_proj``, their biases; transposed where
the class stores them so). The model is rebuilt from its config, loaded strictly (every weight must be present,
nothing extra), and written with ``save_pretrained``, so ``from_pretrained(output_dir)`` gives the trained model,
every expert included.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch

from ..deepspeed_glue.consolidate import consolidated_state_dict, resolve_tag
from ..deepspeed_glue.checkpoint import SUBDIR
from ..errors import HecateError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model_class(config):
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def hf_state_dict(checkpoint_dir: str, model, tag: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The full fp32 state dict of ``model``'s architecture from a Hecate checkpoint, HF parameter names and the
    experts modules' own layouts."""
    from ..hf.takeover import find_experts_modules

    tag = resolve_tag(checkpoint_dir, tag)
    with open(os.path.join(checkpoint_dir, tag, SUBDIR, "meta.json"), encoding="utf-8") as f:
        layers = sorted(layer["name"] for layer in json.load(f)["layers"])
    modules = sorted(name for name, _, _ in find_experts_modules(model))
    if modules != layers:
        raise HecateError(f"{checkpoint_dir}: the checkpoint's MoE layers {layers} do not match the experts "
                          f"modules of {type(model).__name__} built from the model config {modules}")
    return consolidated_state_dict(checkpoint_dir, tag, layout="hf")


def export_hf(checkpoint_dir: str, output_dir: str, model_config: Optional[str] = None, tag: Optional[str] = None,
              dtype: str = "fp32") -> Dict[str, int]:
    """Write ``output_dir`` (config + safetensors) from a Hecate checkpoint; returns tensor/parameter counts.

    ``model_config``: a directory with ``config.json`` or the file itself; default: ``checkpoint_dir`` (the HF
    Trainer writes ``config.json`` into each ``checkpoint-N``).
    """
    import transformers

    from ..hf.takeover import find_experts_modules

    if dtype not in DTYPES:
        raise HecateError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    source = model_config or checkpoint_dir
    config_dir = os.path.dirname(source) if os.path.isfile(source) else source
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise HecateError(f"no HF model config at {source} (pass --model-config DIR_OR_config.json)")
    config = transformers.AutoConfig.from_pretrained(config_dir)
    model = _model_class(config)._from_config(config, dtype=torch.float32)
    state = hf_state_dict(checkpoint_dir, model, tag)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise HecateError(f"{checkpoint_dir} does not match {type(model).__name__} from {source}: missing "
                          f"{sorted(result.missing_keys)[:8]}, unexpected {sorted(result.unexpected_keys)[:8]}")
    expert_keys = {f"{name}.{p}" for name, _, spec in find_experts_modules(model) for p in spec.names}
    model = model.to(DTYPES[dtype])
    model.save_pretrained(output_dir)
    experts = sum(v.numel() for k, v in state.items() if k in expert_keys)
    return {"tensors": len(state), "parameters": sum(v.numel() for v in state.values()), "expert_parameters": experts}
