"""Consolidating a Hecate checkpoint into one fp32 state dict: DeepSpeed's ``zero_to_fp32`` for the dense part
plus every expert from ``<tag>/hecate``, under the parameter names of an unconverted model.

``layout="hecate"`` names experts as a ``ds_hecate.MoE`` holds them (``<layer>.experts.<e>.<param>``);
``layout="deepspeed"`` as ``deepspeed.moe.layer.MoE`` does (``<layer>.deepspeed_moe.experts.deepspeed_experts.<e>.
<param>``, gate under ``<layer>.deepspeed_moe.gate``); ``layout="hf"`` as a Hugging Face experts module does
(``<layer>.gate_up_proj`` ``[E, ...]`` and the rest, in the module's own layout: transposed where the class stores
its weights transposed, biases as ``<param>_bias``), read from the layout the checkpoint records for each layer.
``layout=None`` picks ``"hf"`` for a checkpoint of a Hugging Face model, ``"hecate"`` otherwise. The result loads
into the model the user built.
"""
from __future__ import annotations

import contextlib
import io
import os
from typing import Any, Dict, Optional

import torch

from . import checkpoint_integrity as integrity
from .checkpoint import SUBDIR, check_format, expert_file, expert_record, read_meta
from ..errors import HecateError
from ..experts import stack_as_stored

LAYOUTS = ("hecate", "deepspeed", "hf")
#: the parameter names of a Hugging Face experts module (checkpoints written before layers recorded their layout)
HF_NAMES = {"gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias"}


def hf_source_layout(layer: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The layout a layer's experts came in, when they came from a Hugging Face experts module (recorded by the
    checkpoint; a checkpoint from before that holds only untransposed HF experts, known by their names)."""
    recorded = layer.get("source_layout")
    if recorded is not None:
        return recorded if recorded.get("kind") == "hf_experts" else None
    if layer["param_names"] and set(layer["param_names"]) <= HF_NAMES:
        return {"kind": "hf_experts", "transposed": []}
    return None


def resolve_tag(checkpoint_dir: str, tag: Optional[str]) -> str:
    if tag is not None:
        return tag
    latest = os.path.join(checkpoint_dir, "latest")
    if not os.path.isfile(latest):
        raise HecateError(f"{checkpoint_dir}: no 'latest' file; pass the checkpoint tag explicitly")
    with open(latest, encoding="utf-8") as f:
        return f.read().strip()


def consolidated_state_dict(checkpoint_dir: str, tag: Optional[str] = None,
                            layout: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Every parameter of the model, fp32, from a checkpoint written by a Hecate engine (any world size). A tag
    whose save did not complete, or an expert file that does not match its recorded digest, is refused by name."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if layout is not None and layout not in LAYOUTS:
        raise HecateError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    tag = resolve_tag(checkpoint_dir, tag)
    directory = os.path.join(checkpoint_dir, tag, SUBDIR)
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isfile(meta_path):
        raise HecateError(f"{os.path.join(checkpoint_dir, tag)} has no Hecate expert state ({meta_path} is missing)")
    meta = read_meta(meta_path)
    digests = check_format(meta, os.path.join(checkpoint_dir, tag))
    hf_layouts = [hf_source_layout(layer) for layer in meta["layers"]]
    if layout is None:
        layout = "hf" if hf_layouts and all(hf_layouts) else "hecate"
    if layout == "hf" and not all(hf_layouts):
        names = [layer["name"] for layer, hf in zip(meta["layers"], hf_layouts) if not hf]
        raise HecateError(f"--layout hf: MoE layer(s) {names} of {checkpoint_dir} did not come from a Hugging Face "
                          "experts module; choose --layout hecate or deepspeed")
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
        masters = [_expert_master(directory, digests, layer_id, layer, e) for e in range(layer["num_experts"])]
        numels = [int(torch.Size(shape).numel()) for shape in layer["param_shapes"]]
        hf_layout = hf_layouts[layer_id]
        if layout == "hf" and hf_layout is not None:   # every expert's pieces stacked, as the module stores them
            params = [(n, tuple(shape), n in hf_layout["transposed"])
                      for n, shape in zip(layer["param_names"], layer["param_shapes"])]
            stacked = stack_as_stored(list(torch.stack(masters).split(numels, dim=1)), params)
            out.update({f"{layer['name']}.{n}": t for n, t in stacked.items()})
            continue
        prefix = (f"{layer['name']}.experts" if layout == "hecate"
                  else f"{layer['name']}.deepspeed_moe.experts.deepspeed_experts")
        for e, master in enumerate(masters):
            for name, piece, shape in zip(layer["param_names"], master.split(numels), layer["param_shapes"]):
                out[f"{prefix}.{e}.{name}"] = piece.view(shape).clone()
    return out


def _expert_master(directory: str, digests: Any, layer_id: int, layer: Dict[str, Any], e: int) -> torch.Tensor:
    """Expert ``e``'s fp32 master vector of one layer, verified against its recorded digest and size."""
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
    needed = sum(int(torch.Size(shape).numel()) for shape in layer["param_shapes"])
    if master.numel() != needed:
        raise HecateError(f"expert {e} of MoE layer '{layer['name']}' in {path} has {master.numel()} values, the "
                          f"layout needs {needed}")
    return master.float()
