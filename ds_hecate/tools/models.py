"""``ds-hecate models``: every experts class of the installed transformers' experts interface, its layout, and
whether Hecate takes it over (and why not).

Each class is built on the meta device (no memory) with its model type's default config, or the first of its
sub-configs it accepts (a multimodal type's ``text_config``), and planned exactly as ``deepspeed.initialize`` plans
it (:func:`ds_hecate.hf.layouts.plan_experts`), so the table says what a run would do. The output is the Markdown
table docs/huggingface.md shows for each tested transformers version.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import torch

from ..errors import HecateModelError


@dataclass(frozen=True)
class ModelRow:
    model_type: str
    class_name: str
    layout: str
    status: str   # "taken over ...", or "refused: <why>"

    @property
    def taken_over(self) -> bool:
        return self.status.startswith("taken over")


def _configs(config: Any) -> Iterator[Any]:
    """``config`` and its sub-configs, breadth first."""
    from transformers import PretrainedConfig

    queue = [config]
    while queue:
        current = queue.pop(0)
        yield current
        queue.extend(v for v in vars(current).values() if isinstance(v, PretrainedConfig))


def _config_candidates(model_type: str) -> Iterator[Any]:
    """Default configs of the model folder: the folder's own model type first, then every registered config class
    defined in the folder, each with its sub-configs."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    folder = f"transformers.models.{model_type}."
    names = [model_type] if model_type in CONFIG_MAPPING_NAMES else []
    names += [name for name in CONFIG_MAPPING_NAMES if name != model_type
              and CONFIG_MAPPING[name].__module__.startswith(folder)]
    for name in names:
        try:
            config = CONFIG_MAPPING[name]()
        except Exception:  # noqa: BLE001 - a config that needs arguments: try the next
            continue
        yield from _configs(config)


def _instance(cls: type, model_type: str) -> Optional[Any]:
    """An instance of the experts class ``cls`` on the meta device: built with the first (sub-)config of its model
    type that it accepts, else found in a model of the type built from its default config (a block that builds its
    experts with arguments of its own); None when neither works (the default config has no MoE layer)."""
    for config in _config_candidates(model_type):
        try:
            with torch.device("meta"):
                return cls(config)
        except Exception:  # noqa: BLE001 - the wrong (sub-)config for this class: try the next
            continue
    import transformers

    for config in _config_candidates(model_type):
        for auto in ("AutoModelForCausalLM", "AutoModel"):
            model_cls = getattr(transformers, auto)._model_mapping.get(type(config), None)
            if model_cls is None:
                continue
            try:
                with torch.device("meta"):
                    model = model_cls._from_config(config)
            except Exception:  # noqa: BLE001 - try the next
                continue
            found = next((m for m in model.modules() if isinstance(m, cls)), None)
            if found is not None:
                return found
    return None


def model_rows() -> List[ModelRow]:
    """One row per experts class of the installed transformers' experts interface."""
    from ..hf.interface import interface_classes
    from ..hf.layouts import plan_experts

    rows = []
    for entry in interface_classes():
        module = _instance(entry.cls, entry.model_type)
        if module is None:   # the layout alone says it is taken over; no instance to check its parameters on
            status = "taken over (by its layout: the default config of its model type builds none)"
        else:
            try:
                plan_experts(entry.name, module)
                status = "taken over"
            except HecateModelError as exc:
                status = "refused: " + str(exc).split("): ", 1)[-1].split("; Hecate cannot", 1)[0]
        rows.append(ModelRow(entry.model_type, entry.name, entry.layout.describe(), status))
    return rows


def models_markdown(rows: List[ModelRow]) -> str:
    """The table, with a first line counting classes, model types and take-overs."""
    import transformers

    types = {r.model_type for r in rows}
    taken = [r for r in rows if r.taken_over]
    lines = [f"transformers {transformers.__version__}: {len(rows)} experts classes in {len(types)} model types, "
             f"{len(taken)} taken over by Hecate ({len({r.model_type for r in taken})} model types)", "",
             "| model type | experts class | layout | Hecate |", "|---|---|---|---|"]
    lines += [f"| `{r.model_type}` | `{r.class_name}` | {r.layout} | {r.status} |" for r in rows]
    return "\n".join(lines)
