"""One Hugging Face experts module's parameters as Hecate's flat experts, and back.

An experts module of transformers' experts interface holds ``E`` experts as 3-D parameters, in the layout its
class records (:mod:`ds_hecate.hf.interface`): a fused ``gate_up_proj`` (gate rows then up rows, or interleaved) or,
without a gate, an ``up_proj``; a ``down_proj``; optionally a bias per projection (``gate_up_proj_bias`` or
``up_proj_bias``, ``down_proj_bias``); each weight stored ``[E, out, in]`` or, transposed, ``[E, in, out]``.

Hecate keeps expert ``e`` as one flat vector: every weight of ``e`` as ``[out, in]`` (what ``F.linear`` and the grouped
GEMM read), then its biases. A transposed layout is converted here, once, when the experts are taken over, and
back when they are exported (``state_dict``, ``save_pretrained``, ``export-hf``, ``consolidate``): never per call.
Interleaved gate/up rows stay as stored (the gate activation reads them as strided views of the product).

:func:`plan_experts` reads a module's spec and refuses, at initialize and by name (module, class, feature), what
Hecate cannot take over exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..errors import HecateModelError
from ..experts import stack_as_stored
from .interface import ExpertsLayout, module_layout, reaches_interface

DOCS = "docs/huggingface.md#supported-models"
#: ``source_layout["kind"]`` of a Hugging Face experts module in a checkpoint's metadata
SOURCE_KIND = "hf_experts"


@dataclass(frozen=True)
class ExpertParam:
    """One parameter of the experts module: its attribute name, Hecate's per-expert shape (``[out, in]`` or
    ``[out]``) and whether the module stores it transposed (``[E, in, out]``)."""

    name: str
    shape: Tuple[int, ...]
    transposed: bool = False

    def stored_shape(self, experts: int) -> Tuple[int, ...]:
        return (experts,) + (tuple(reversed(self.shape)) if self.transposed else self.shape)


@dataclass(frozen=True)
class ExpertsSpec:
    """How one experts module's parameters make Hecate's flat experts (weights first, then biases)."""

    num_experts: int
    hidden: int
    ffn: int
    params: Tuple[ExpertParam, ...]   # first projection (gate/up or up), down, then their biases if any
    layout: ExpertsLayout

    @property
    def names(self) -> List[str]:
        return [p.name for p in self.params]

    @property
    def first(self) -> str:
        """The fused gate/up projection's name (the up projection's without a gate)."""
        return self.params[0].name

    @property
    def down(self) -> str:
        return self.params[1].name

    def bias_of(self, weight: str) -> Optional[str]:
        return weight + "_bias" if weight + "_bias" in self.names else None

    def expert_flat(self, tensors: Dict[str, torch.Tensor], expert: int) -> torch.Tensor:
        """Expert ``expert`` as one flat vector, from the module's full tensors (transposed ones converted)."""
        pieces = []
        for p in self.params:
            t = tensors[p.name][expert]
            pieces.append((t.t() if p.transposed else t).reshape(-1))
        return torch.cat(pieces)

    def to_module_layout(self, flats: torch.Tensor, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
        """``[E, numel]`` flat experts as the module's own tensors (transposed back where it stores them so), each
        with storage of its own."""
        return stack_as_stored(list(flats.split([_numel(p.shape) for p in self.params], dim=1)),
                               [(p.name, p.shape, p.transposed) for p in self.params], dtype)

    def source_layout(self, class_name: str) -> Dict[str, Any]:
        """What a checkpoint records so that ``consolidate`` gives the module's own layout without the model."""
        return {"kind": SOURCE_KIND, "class": class_name, "transposed": [p.name for p in self.params if p.transposed]}


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _refuse(name: str, module: nn.Module, feature: str) -> HecateModelError:
    return HecateModelError(f"experts module '{name}' ({type(module).__name__}): {feature}; Hecate cannot take it "
                            f"over (see {DOCS}); set hecate.enabled to false to train this model with plain DeepSpeed")


def _shape(param: Any) -> Tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))   # under zero.Init the full shape is ds_shape


def plan_experts(name: str, module: nn.Module, layout: Optional[ExpertsLayout] = None,
                 names: Optional[Tuple[str, str]] = None) -> ExpertsSpec:
    """The spec of the experts module ``name``: its layout (read from the decorator's attributes, or ``layout``
    for a registered module outside the interface, whose parameters ``names`` gives) checked against its
    parameters. Raises :class:`HecateModelError` naming the module, its class and the feature Hecate cannot take
    over."""
    if layout is None:
        layout = module_layout(module)
        if layout is None:
            raise _refuse(name, module, "it carries none of the experts interface's layout attributes")
        if not reaches_interface(type(module)):
            raise _refuse(name, module, f"its forward ({type(module).forward.__qualname__}) overrides the decorated "
                                        "one without calling it, so the experts interface never runs")
    first, down = names or ("gate_up_proj" if layout.gate else "up_proj", "down_proj")
    own = dict(module.named_parameters(recurse=False))
    for needed in (first, down):
        if needed not in own:
            raise _refuse(name, module, f"it has no parameter '{needed}' (has_gate={layout.gate})")
    first_shape, down_shape = _shape(own[first]), _shape(own[down])
    if len(first_shape) != 3 or len(down_shape) != 3 or first_shape[0] != down_shape[0]:
        raise _refuse(name, module, f"{first} {list(first_shape)} and {down} {list(down_shape)} are not 3-D "
                                    "tensors of the same experts")
    experts = first_shape[0]
    # Hecate's orientation [out, in]: (2F or F, H) and (H, F)
    first_oi = first_shape[1:][::-1] if layout.transposed else first_shape[1:]
    down_oi = down_shape[1:][::-1] if layout.transposed else down_shape[1:]
    hidden, ffn = first_oi[1], down_oi[1]
    if down_oi[0] != hidden or first_oi[0] != (2 * ffn if layout.gate else ffn):
        stored = "[E, in, out]" if layout.transposed else "[E, out, in]"
        raise _refuse(name, module, f"{first} {list(first_shape)} and {down} {list(down_shape)} do not fit "
                                    f"{'a fused gate/up' if layout.gate else 'an up'} and a down projection stored "
                                    f"{stored} (is_transposed={layout.transposed})")
    params = [ExpertParam(first, tuple(first_oi), layout.transposed),
              ExpertParam(down, tuple(down_oi), layout.transposed)]
    if layout.bias:
        for bias, size in ((first + "_bias", first_oi[0]), (down + "_bias", hidden)):
            if bias not in own or _shape(own[bias]) != (experts, size):
                got = list(_shape(own[bias])) if bias in own else "missing"
                raise _refuse(name, module, f"has_bias=True but its '{bias}' is {got}, not [{experts}, {size}]")
            params.append(ExpertParam(bias, (size,)))
    extra = sorted(set(own) - {p.name for p in params})
    if extra:
        raise _refuse(name, module, f"parameters outside the experts' projections ({', '.join(extra)})")
    _check_submodules(name, module, layout)
    return ExpertsSpec(experts, hidden, ffn, tuple(params), layout)


def _check_submodules(name: str, module: nn.Module, layout: ExpertsLayout) -> None:
    """What the kernel calls must hold no parameters or buffers: Hecate runs it per materialized expert, outside
    DeepSpeed's view, where a parameter would be one shared by every expert. That is the activation, a post-expert
    norm the decorator applies, and, for a class with its own ``_apply_gate`` (which may read any of them), every
    submodule. Other submodules (a subclass's own post-processing around the decorated forward) stay HF modules
    under DeepSpeed."""
    if layout.post_expert_norm and not isinstance(getattr(module, "post_expert_norm", None), nn.Module):
        raise _refuse(name, module, "has_post_expert_norm=True but it has no module 'post_expert_norm'")
    called = {"act_fn", "post_expert_norm"} if layout.post_expert_norm else {"act_fn"}
    for child_name, child in module.named_children():
        held = [n for n, _ in child.named_parameters()] + [n for n, _ in child.named_buffers()]
        if not held or (child_name not in called and not layout.own_gate):
            continue
        if child_name == "post_expert_norm" and layout.post_expert_norm:
            feature = (f"its post-expert norm '{child_name}' ({type(child).__name__}) holds parameters shared by "
                       f"every expert ({', '.join(held)})")
        else:
            feature = (f"its submodule '{child_name}' ({type(child).__name__}), which the experts' "
                       f"{'_apply_gate' if layout.own_gate else 'compute'} may call, holds parameters or buffers "
                       f"({', '.join(held)})")
        raise _refuse(name, module, feature)
