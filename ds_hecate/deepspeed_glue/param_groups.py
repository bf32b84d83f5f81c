"""Where each expert parameter's settings come from: the user's param groups, pruned of expert parameters, and kept
driven by the learning-rate schedule when pruning emptied them.

Expert parameters leave the model (``ds_hecate.deepspeed_glue.convert``) and must leave whatever optimizer or param
groups the user gives DeepSpeed. Each layer's experts remember, per parameter name (``0.weight``, ``0.bias``, ...),
the group its parameters sat in (:class:`ExpertSources`): Megatron's groups put biases apart from weights (no weight
decay), so one layer's experts may follow several groups.

A group that held only expert parameters (Megatron's and DeepSpeed's ``--create-moe-param-group`` /
``split_params_into_different_moe_groups_for_optimizer``) is empty after pruning, and DeepSpeed drops empty groups
from its optimizer: no schedule would reach it again, and warmup from lr 0 would leave the experts at 0 for ever.
:class:`EmptiedGroups` puts those groups back, at their original positions in the optimizer's list, while an LR
scheduler runs (its construction, every ``step``, ``load_state_dict``), and only then: DeepSpeed's optimizer wrappers
never see an empty group. Schedulers built before ``deepspeed.initialize`` (Megatron's, a torch scheduler over the
client optimizer) and inside it (the config's ``scheduler`` section) then see the list they were written for, and
set the emptied groups as they set every other: the experts read their settings there at every step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch

from ..errors import HecateUnsupportedError
from .expert_optimizer import Segment, group_hyperparameters

#: per layer id, the removed expert parameters: id -> the expert parameter name (DeepSpeed and ds_hecate MoE layers),
#: or a set of ids where names are not known (Hugging Face experts)
RemovedParams = Mapping[int, Union[Mapping[int, str], AbstractSet[int]]]

#: a layer's source groups: expert parameter name -> the group its parameters sat in; the key None stands for every
#: parameter of the layer (names not known); a group None is the optimizer's default group (DeepSpeed builds one
#: group from the model's parameters)
LayerSources = Dict[Optional[str], Optional[Dict[str, Any]]]


@dataclass
class ExpertSources:
    """Where each layer's expert parameters came from, and the param groups as DeepSpeed received them."""

    layers: Dict[int, LayerSources] = field(default_factory=dict)
    #: every group dict given to DeepSpeed, in order (empty when DeepSpeed builds the groups itself)
    groups: List[Dict[str, Any]] = field(default_factory=list)
    #: the groups pruning emptied (DeepSpeed drops them from its optimizer)
    emptied: List[Dict[str, Any]] = field(default_factory=list)

    def emptied_groups(self) -> "EmptiedGroups":
        return EmptiedGroups([(i, g) for i, g in enumerate(self.groups) if any(g is e for e in self.emptied)],
                             len(self.groups))


def _sources(groups: Sequence[Dict[str, Any]], removed: RemovedParams,
             names: Mapping[int, str]) -> Dict[int, LayerSources]:
    """Per layer, per expert parameter name, the one group its parameters sit in."""
    holders = {id(p): g for g in groups for p in g["params"]}
    return {layer: _sources_of_layer(holders, ids, names[layer]) for layer, ids in removed.items()}


def _sources_of_layer(holders: Mapping[int, Dict[str, Any]], removed: Union[Mapping[int, str], AbstractSet[int]],
                      layer: str) -> LayerSources:
    """Per expert parameter name, the one group its parameters sit in (groups with equal settings count as one)."""
    names: Dict[Optional[str], List[Dict[str, Any]]] = {}
    for pid in removed:
        name = removed[pid] if isinstance(removed, Mapping) else None
        holder = holders.get(pid)
        if holder is None:
            raise HecateUnsupportedError(
                f"an expert parameter{f' ({name})' if name else ''} of MoE layer '{layer}' is in none of the "
                "optimizer's param groups; Hecate steps every expert parameter (frozen expert parameters are not "
                "supported): give every expert parameter to the optimizer")
        if not any(holder is h for h in names.setdefault(name, [])):
            names[name].append(holder)
    out: LayerSources = {}
    for name, sources in names.items():
        settings = [group_hyperparameters(g) for g in sources]
        if any(s != settings[0] for s in settings[1:]):
            what = f"'{name}' parameters of the experts" if name is not None else "expert parameters"
            hint = ("each expert parameter name must sit in one group" if name is not None else
                    "Hugging Face experts: one group per layer's experts")
            raise HecateUnsupportedError(
                f"the {what} of MoE layer '{layer}' are spread over optimizer param groups with different settings "
                f"({', '.join(str(h.get('name', n)) for n, h in enumerate(sources))}); {hint}")
        out[name] = sources[0]
    return out


def prune_expert_params(optimizer: Any, model_parameters: Any, removed: RemovedParams,
                        names: Mapping[int, str]) -> Tuple[Any, ExpertSources]:
    """Remove expert parameters from a client optimizer and from ``model_parameters``; record where each layer's
    came from (``names``: layer id -> layer name, for messages).

    Returns the pruned ``model_parameters`` (a list, or None) and the :class:`ExpertSources`.
    """
    all_ids: Set[int] = set()
    for ids in removed.values():
        all_ids.update(ids)
    info = ExpertSources()
    if isinstance(optimizer, torch.optim.Optimizer):
        info.groups = list(optimizer.param_groups)
        info.layers = _sources(info.groups, removed, names)
        for group in info.groups:
            kept = [p for p in group["params"] if id(p) not in all_ids]
            for p in group["params"]:
                if id(p) in all_ids:
                    optimizer.state.pop(p, None)
            if group["params"] and not kept:
                info.emptied.append(group)
            group["params"] = kept
    if model_parameters is not None:
        items = list(model_parameters)
        if items and all(isinstance(i, dict) for i in items):
            given_here = not info.groups   # else the client optimizer's groups are the ones DeepSpeed steps
            for group in items:
                group["params"] = list(group["params"])
            if given_here:
                info.groups = items
                info.layers = _sources(items, removed, names)
            for group in items:
                kept = [p for p in group["params"] if id(p) not in all_ids]
                if given_here and group["params"] and not kept:
                    info.emptied.append(group)
                group["params"] = kept
            model_parameters = items
        else:
            model_parameters = [p for p in items if id(p) not in all_ids]
    if not info.groups:   # DeepSpeed builds one group of the model's parameters: the default group
        info.layers = {layer: {None: None} for layer in removed}
    return model_parameters, info


def layer_segments(sources: LayerSources, names: Sequence[str], numels: Sequence[int],
                   group_index: Mapping[int, int]) -> List[Segment]:
    """The columns of an expert vector (parameters ``names`` of ``numels`` elements, in layout order) as runs of one
    expert param group (``group_index``: id of a source group, or of None, -> its expert group)."""
    segments: List[Segment] = []
    lo = 0
    for name, numel in zip(names, numels):
        source = sources[name] if name in sources else sources[None]
        group = group_index[id(source)]
        if segments and segments[-1].group == group and segments[-1].hi == lo:
            segments[-1] = Segment(group, segments[-1].lo, lo + numel)
        else:
            segments.append(Segment(group, lo, lo + numel))
        lo += numel
    return segments


class EmptiedGroups:
    """Param groups pruning emptied, put back into an optimizer's group list while a scheduler runs.

    ``entries``: (position among all the groups the user gave, group dict); ``total``: how many there were."""

    def __init__(self, entries: Sequence[Tuple[int, Dict[str, Any]]], total: int) -> None:
        self.entries = list(entries)
        self.total = total
        self.optimizer: Any = None   # the optimizer whose list they go back into (bind)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def groups(self) -> List[Dict[str, Any]]:
        return [g for _, g in self.entries]

    def is_emptied(self, group: Any) -> bool:
        return any(group is g for _, g in self.entries)

    def bind(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    @contextlib.contextmanager
    def visible(self) -> Iterator[None]:
        """The optimizer's group list with the emptied groups back at their positions, for the duration."""
        if not self.entries or self.optimizer is None:
            yield
            return
        groups = self.optimizer.param_groups
        if any(self.is_emptied(g) for g in groups):   # nested: already there
            yield
            return
        live = list(groups)
        if len(live) + len(self.entries) != self.total:
            raise HecateUnsupportedError(
                f"the optimizer has {len(live)} param groups where {self.total - len(self.entries)} were expected "
                f"({self.total} given, {len(self.entries)} of them emptied by moving the experts to Hecate); "
                "Hecate cannot tell which group an LR schedule sets")
        at = dict(self.entries)
        rest = iter(live)
        groups[:] = [at[i] if i in at else next(rest) for i in range(self.total)]
        try:
            yield
        finally:
            current = self.optimizer.param_groups
            current[:] = [g for g in current if not self.is_emptied(g)]

    def drive_with(self, scheduler: Any) -> None:
        """Wrap ``scheduler``'s ``step`` and ``load_state_dict`` (on the instance) so they see the emptied groups."""
        if scheduler is None or not self.entries or getattr(scheduler, "_hecate_emptied_groups", None) is self:
            return
        for name in ("step", "load_state_dict"):
            original = getattr(scheduler, name, None)
            if original is None:
                continue

            def wrapped(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                with self.visible():
                    return _original(*args, **kwargs)
            setattr(scheduler, name, wrapped)
        scheduler._hecate_emptied_groups = self


#: the emptied groups of the engine ``ds_hecate.initialize`` is building (DeepSpeed's engine constructor configures
#: its LR scheduler; see patch_lr_scheduler_setup)
_BUILDING: List[EmptiedGroups] = []


@contextlib.contextmanager
def building_engine(emptied: EmptiedGroups) -> Iterator[None]:
    """While DeepSpeed builds the engine: its LR scheduler is configured with ``emptied`` visible."""
    _BUILDING.append(emptied)
    try:
        yield
    finally:
        _BUILDING.pop()


def patch_lr_scheduler_setup() -> None:
    """Wrap ``DeepSpeedEngine._configure_lr_scheduler`` (once): for an engine built by ``ds_hecate.initialize`` with
    emptied groups, the scheduler is built (or taken from the client) with them visible, and its ``step`` and
    ``load_state_dict`` see them from then on. Any other engine is left as DeepSpeed builds it."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_lr_scheduler
    if getattr(original, "_hecate_wrapped", False):
        return

    def _configure_lr_scheduler(self: Any, *args: Any, **kwargs: Any) -> Any:
        emptied = _BUILDING[-1] if _BUILDING else None
        if not emptied:
            return original(self, *args, **kwargs)
        emptied.bind(self.basic_optimizer)
        with emptied.visible():
            result = original(self, *args, **kwargs)
        emptied.drive_with(self.lr_scheduler)
        return result

    setattr(_configure_lr_scheduler, "_hecate_wrapped", True)
    DeepSpeedEngine._configure_lr_scheduler = _configure_lr_scheduler
