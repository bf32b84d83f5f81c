"""transformers' experts interface as Hecate reads it: which classes it decorates, and each one's layout.

``@use_experts_implementation`` (``transformers/integrations/moe.py``) wraps an experts class's ``__init__`` and
``forward``: the forward looks its compute up under ``config._experts_implementation``, and the ``__init__`` records
the layout on the instance (``is_concatenated``, ``is_transposed``, ``has_bias``, ``has_gate`` and, since
transformers 5.2x, ``has_post_expert_norm``). The class may define its own ``_apply_gate`` (the activation of the
gate/up product; the decorator adds the default ``act_fn(gate) * up`` otherwise). Hecate keys its take-over on
these, not on class names, so a class transformers adds next month is found the day it ships.
"""
from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from torch import nn

#: The layout attributes the decorator records, with the defaults of a release that does not record one.
LAYOUT_FLAGS: Dict[str, bool] = {"is_concatenated": True, "is_transposed": False, "has_bias": False,
                                 "has_gate": True, "has_post_expert_norm": False}
DECORATOR = "use_experts_implementation"


@dataclass(frozen=True)
class ExpertsLayout:
    """How one experts class stores and computes its experts (the decorator's flags, and whether ``_apply_gate``
    is the class's own)."""

    concatenated: bool = True
    transposed: bool = False
    bias: bool = False
    gate: bool = True
    post_expert_norm: bool = False
    own_gate: bool = False

    def describe(self) -> str:
        """A short text for tables and messages, e.g. ``interleaved, transposed, bias, own _apply_gate``."""
        parts = ["gate/up " + ("concatenated" if self.concatenated else "interleaved") if self.gate else "no gate"]
        parts += [name for name, on in (("transposed", self.transposed), ("bias", self.bias),
                                        ("post-expert norm", self.post_expert_norm),
                                        ("own _apply_gate", self.own_gate)) if on]
        return ", ".join(parts)


def _wrapper_cells(fn: Any) -> Optional[Dict[str, Any]]:
    """The closure of the decorator's ``__init__`` or ``forward`` wrapper (None for any other function)."""
    code = getattr(fn, "__code__", None)
    if code is None or DECORATOR not in getattr(code, "co_qualname", fn.__qualname__):
        return None
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))


def dispatches_through_interface(cls: type) -> bool:
    """Whether ``cls.forward`` is the decorator's wrapper (its compute is chosen by ``_experts_implementation``)."""
    return _wrapper_cells(getattr(cls, "forward", None)) is not None


def reaches_interface(cls: type) -> bool:
    """Whether a call of ``cls.forward`` reaches the decorated forward: it is the decorator's wrapper, or an
    override in a subclass that calls ``super()`` (Ergo's experts run the interface on one route per row, then
    their own per-expert norm). An override that never calls ``super`` would leave the interface unused."""
    forward = getattr(cls, "forward", None)
    if dispatches_through_interface(cls):
        return True
    code = getattr(forward, "__code__", None)
    return class_layout(cls) is not None and code is not None and "super" in code.co_names


def own_apply_gate(cls: type) -> bool:
    gate = getattr(cls, "_apply_gate", None)
    return gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate"


def class_layout(cls: type) -> Optional[ExpertsLayout]:
    """The layout a decorated class records, read from the decorator's closure (no instance needed); None for a
    class the decorator did not wrap."""
    for klass in cls.__mro__:
        cells = _wrapper_cells(klass.__dict__.get("__init__"))
        if cells is not None:
            flags = {k: bool(cells.get(k, default)) for k, default in LAYOUT_FLAGS.items()}
            return _layout(flags, own_apply_gate(cls))
    return None


def module_layout(module: nn.Module) -> Optional[ExpertsLayout]:
    """The layout an experts module carries (the decorator's attributes on the instance); None for a module
    without them."""
    if not all(hasattr(module, k) for k in ("is_concatenated", "is_transposed", "has_bias", "has_gate")):
        return None
    flags = {k: bool(getattr(module, k, default)) for k, default in LAYOUT_FLAGS.items()}
    return _layout(flags, own_apply_gate(type(module)))


def _layout(flags: Dict[str, bool], own_gate: bool) -> ExpertsLayout:
    return ExpertsLayout(concatenated=flags["is_concatenated"], transposed=flags["is_transposed"],
                         bias=flags["has_bias"], gate=flags["has_gate"],
                         post_expert_norm=flags["has_post_expert_norm"], own_gate=own_gate)


def _modeling_modules() -> Iterator[Tuple[str, str]]:
    """(model type, module name) of every modeling file of the installed transformers that uses the decorator
    (found by reading the files, so only those are imported)."""
    import transformers.models as models

    for info in pkgutil.iter_modules(models.__path__):
        if not info.ispkg:
            continue
        folder = os.path.join(models.__path__[0], info.name)
        for file in sorted(os.listdir(folder)):
            if not (file.startswith("modeling_") and file.endswith(".py")):
                continue
            with open(os.path.join(folder, file), encoding="utf-8") as f:
                if "@" + DECORATOR not in f.read():
                    continue
            yield info.name, f"transformers.models.{info.name}.{file[:-3]}"


def interface_model_types() -> List[str]:
    """The model folders of the installed transformers whose modeling files use the decorator (read from the
    files, nothing imported)."""
    return sorted({folder for folder, _ in _modeling_modules()})


@dataclass(frozen=True)
class InterfaceClass:
    """One experts class of the installed transformers' experts interface."""

    model_type: str     # the models/ folder it lives in (the config's model_type for all but a few)
    name: str
    cls: type
    layout: ExpertsLayout


def interface_classes() -> List[InterfaceClass]:
    """Every class the installed transformers decorates with ``@use_experts_implementation``, by model folder and
    class name. A modeling file that fails to import (a missing optional dependency) raises: the table must not
    silently leave a class out."""
    found = []
    for folder, module_name in _modeling_modules():
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if inspect.isclass(obj) and obj.__module__ == module_name and "__init__" in obj.__dict__:
                layout = class_layout(obj)
                if layout is not None and _wrapper_cells(obj.__dict__["__init__"]) is not None:
                    found.append(InterfaceClass(folder, name, obj, layout))
    return found
