"""Consolidating a Hecate checkpoint into one fp32 state dict: DeepSpeed's ``zero_to_fp32`` for the dense part
plus every expert from ``<tag>/hecate``, under the parameter names of an unconverted model.

``layout="hecate"`` names experts as a ``ds_hecate.MoE`` holds them (``<layer>.experts.<e>.<param>``);
``layout="deepspeed"`` as ``deepspeed.moe.layer.MoE`` does (``<layer>.deepspeed_moe.experts.deepspeed_experts.<e>.
<param>``, gate under ``<layer>.deepspeed_moe.gate``), so the result loads into the model the user built.
"""
from __future__ import annotations

import contextlib
import io
import os
from typing import Dict, Optional

import torch

from . import checkpoint_integrity as integrity
from .checkpoint import SUBDIR, check_format, expert_file, expert_record, read_meta
from ..errors import HecateError

LAYOUTS = ("hecate", "deepspeed")


def resolve_tag(checkpoint_dir: str, tag: Optional[str]) -> str:
    if tag is not None:
        return tag
    latest = os.path.join(checkpoint_dir, "latest")
    if not os.path.isfile(latest):
        raise HecateError(f"{checkpoint_dir}: no 'latest' file; pass the checkpoint tag explicitly")
    with open(latest, encoding="utf-8") as f:
        return f.read().strip()


def consolidated_state_dict(checkpoint_dir: str, tag: Optional[str] = None,
                            layout: str = "hecate") -> Dict[str, torch.Tensor]:
    """Every parameter of the model, fp32, from a checkpoint written by a Hecate engine (any world size). A tag
    whose save did not complete, or an expert file that does not match its recorded digest, is refused by name."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if layout not in LAYOUTS:
        raise HecateError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    tag = resolve_tag(checkpoint_dir, tag)
    directory = os.path.join(checkpoint_dir, tag, SUBDIR)
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isfile(meta_path):
        raise HecateError(f"{os.path.join(checkpoint_dir, tag)} has no Hecate expert state ({meta_path} is missing)")
    meta = read_meta(meta_path)
    digests = check_format(meta, os.path.join(checkpoint_dir, tag))
    with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints progress
        dense = dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag))
    out: Dict[str, torch.Tensor] = {}
    layer_names = [layer["name"] for layer in meta["layers"]]
    for key, value in dense.items():
        layer = next((n for n in layer_names if key.startswith(n + ".gate.")), None)
        if layout == "deepspeed" and layer is not None:
            key = f"{layer}.deepspeed_moe.{key[len(layer) + 1:]}"
        out[key] = value.float()
    for layer_id, layer in enumerate(meta["layers"]):
        prefix = (f"{layer['name']}.experts" if layout == "hecate"
                  else f"{layer['name']}.deepspeed_moe.experts.deepspeed_experts")
        for e in range(layer["num_experts"]):
            name = expert_file(layer_id, e)
            path = os.path.join(directory, name)
            where = f"expert {e} of MoE layer '{layer['name']}'"
            try:
                data = integrity.read_verified(path, expert_record(digests, name, where), where)
                master = integrity.load_tensor_file(data)["master"]
            except HecateError:
                raise
            except Exception as exc:  # noqa: BLE001 - named by layer and expert
                raise HecateError(f"{where} cannot be read from {path}: {type(exc).__name__}: {exc}") from None
            offset = 0
            for name, shape in zip(layer["param_names"], layer["param_shapes"]):
                numel = int(torch.Size(shape).numel())
                out[f"{prefix}.{e}.{name}"] = master[offset:offset + numel].view(shape).clone()
                offset += numel
            if offset != master.numel():
                raise HecateError(f"expert {e} of MoE layer '{layer['name']}' in {path} has {master.numel()} "
                                  f"values, the layout needs {offset}")
    return out
