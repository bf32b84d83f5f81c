"""Optimizer for the expert shards: DeepSpeed's own optimizer class, stepping the owned masters with the settings
of the param groups their parameters came from.

A layer's experts are whole flat vectors (``ds_hecate.runtime.shard_store``), but their parameters may sit in
several of the user's param groups: Megatron puts biases in a no-weight-decay group and weights in a weight-decay
group, and ``--create-moe-param-group`` splits both again for the experts. Each layer therefore has a
:class:`Segment` per run of columns whose parameters share a source group, and each owned master is stepped as
*pieces*: one ``nn.Parameter`` per segment (a view of the master's columns, so the update lands in the master),
in the expert param group that follows that source group. Partitioned masters (a peer's slice of the padded vector)
are cut the same way, at the slice's columns.

Every setting of an expert group (``lr``, ``weight_decay``, ``betas``, ``eps``, ...) is read from its source group
at every step (:meth:`ExpertOptimizer.current_hyperparameters`), so any schedule that drives the source group
(DeepSpeed's, Megatron's, a torch scheduler) drives the experts: the source group is the very dict the user built,
kept driven even when pruning emptied it (``ds_hecate.deepspeed_glue.param_groups``).

Outside this module a master is the unit: :meth:`ExpertOptimizer.state_of` returns a master's state as whole
vectors (the pieces' states put together), :meth:`ExpertOptimizer.add` cuts one back into pieces, so re-sharding and
checkpoints move and store whole experts, whatever the grouping.

Step counts are kept on the host, one per group (every group steps once per optimizer step, as DeepSpeed's flat
groups do): after each step every piece's ``step`` is set to its group's count without reading any of them, so a
step counter that lives on the device (fused or capturable Adam) costs no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..errors import HecateUnsupportedError


@dataclass(frozen=True)
class Segment:
    """Columns ``[lo, hi)`` of a layer's expert vectors whose parameters come from expert param group ``group``."""

    group: int
    lo: int
    hi: int


@dataclass
class _Piece:
    """One segment of one master as the wrapped optimizer sees it: ``param`` views the master's columns
    ``[lo, hi)`` (columns of the master tensor: a slice's own columns when partitioned)."""

    group: int
    lo: int
    hi: int
    param: nn.Parameter


#: Optimizer attributes (not param-group entries) the expert optimizer copies from DeepSpeed's.
INSTANCE_SETTINGS = ("adam_w_mode",)

#: Param-group entries that are not settings: the parameters, and a group-level step counter (DeepSpeed's FusedAdam
#: keeps one), which belongs to the group's own parameters.
NOT_SETTINGS = ("params", "step")


def group_settings(group: Mapping[str, Any]) -> Dict[str, Any]:
    """Every setting of a param group (what its optimizer honours and what schedulers keep there), without its
    parameters and step counter."""
    return {k: v for k, v in group.items() if k not in NOT_SETTINGS}


def group_hyperparameters(group: Mapping[str, Any]) -> Dict[str, Any]:
    """A param group's settings without its parameters and scheduler bookkeeping: what two groups must share for
    their parameters to be stepped alike."""
    return {k: v for k, v in group_settings(group).items() if k != "initial_lr"}


class ExpertOptimizer:
    """Wraps ``optimizer_cls`` over the pieces of the owned expert masters, one param group per source group.

    ``sources`` are the param-group dicts the expert groups follow (same order as the expert groups); layers are
    registered with their segments (:meth:`register_layer`) before their masters are added."""

    def __init__(self, optimizer_cls: type, sources: Sequence[Dict[str, Any]],
                 like: Optional[torch.optim.Optimizer] = None, device: Optional[torch.device] = None):
        if not sources:
            raise ValueError("the expert optimizer needs at least one source param group")
        self.sources: List[Dict[str, Any]] = list(sources)
        self._initial_step: Optional[List[Dict[str, Any]]] = None  # see add_initial_step
        # A group may own no expert on this rank (now, or after re-sharding); a zero-size placeholder keeps it, on
        # the working device (a fused CUDA optimizer refuses a CPU tensor among its params).
        groups = [{**group_settings(s), "params": [nn.Parameter(torch.zeros(0, device=device))]} for s in sources]
        try:
            self.optimizer = optimizer_cls(groups)
        except TypeError as exc:
            raise HecateUnsupportedError(
                f"cannot build the expert optimizer as {optimizer_cls.__name__}(param_groups): {exc}; "
                "use the DeepSpeed 'optimizer' section (Adam/AdamW) or a torch.optim optimizer") from None
        # Settings some optimizers keep outside their param groups: DeepSpeed's FusedAdam holds adam_w_mode
        # ("Adam" with adam_w_mode false is L2-regularized Adam), which the experts must follow too.
        for key in INSTANCE_SETTINGS:
            if like is not None and hasattr(like, key) and hasattr(self.optimizer, key):
                setattr(self.optimizer, key, getattr(like, key))
        self._layers: Dict[int, Tuple[Tuple[Segment, ...], int]] = {}   # key -> (segments, offset of the masters)
        self._pieces: Dict[nn.Parameter, List[_Piece]] = {}   # master -> its pieces
        #: per group, the steps its parameters have taken (None: not known yet, no state in the group)
        self._steps: List[Optional[int]] = [None] * len(sources)
        #: the groups whose source pruning emptied: in no optimizer of DeepSpeed's, so their settings are saved
        #: with the experts (``ds_hecate.deepspeed_glue.checkpoint``)
        self.emptied: List[int] = []

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    # -- layers and masters --------------------------------------------------------------------------------------
    def register_layer(self, key: int, segments: Sequence[Segment], offset: int = 0) -> None:
        """How layer ``key``'s masters split into groups; ``offset``: the column of the whole expert vector where
        this rank's masters start (partitioned: its slice's first column)."""
        for seg in segments:
            if not 0 <= seg.group < len(self.sources):
                raise ValueError(f"segment {seg} names no expert param group (there are {len(self.sources)})")
        self._layers[key] = (tuple(segments), offset)

    def add(self, key: int, param: nn.Parameter, state: Dict[str, Any]) -> None:
        """Step ``param`` (a master of layer ``key``) from now on, with ``state`` (whole vectors, as
        :meth:`state_of` gives them; empty: fresh)."""
        segments, offset = self._layers[key]
        numel = param.numel()
        flat = param.detach().reshape(-1)
        pieces = []
        for seg in segments:
            lo, hi = max(seg.lo - offset, 0), min(seg.hi - offset, numel)
            if hi <= lo:
                continue
            piece = _Piece(seg.group, lo, hi, nn.Parameter(flat[lo:hi], requires_grad=False))
            self.optimizer.param_groups[seg.group]["params"].append(piece.param)
            if state:
                self.optimizer.state[piece.param] = self._cut(state, numel, lo, hi, seg.group)
            pieces.append(piece)
        self._pieces[param] = pieces

    def _cut(self, state: Mapping[str, Any], numel: int, lo: int, hi: int, group: int) -> Dict[str, Any]:
        """A piece's state from a master's: its columns of the per-element vectors and the scalars, copied (the
        optimizer updates them in place; the caller's tensors stay its own), ``step`` at the group's count once that
        is known."""
        out: Dict[str, Any] = {}
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == numel:
                out[k] = v[lo:hi].clone()
            else:
                out[k] = v.clone() if torch.is_tensor(v) else v
        if "step" in out:
            count = self._steps[group]
            if count is None:   # the first state of this group (a checkpoint, a re-shard): its count is the group's
                self._steps[group] = _host_count(out["step"])
            else:
                _set_counts([out], count)
        return out

    def remove(self, param: nn.Parameter) -> None:
        """Stop stepping master ``param`` (it left this rank); its pieces' state goes with it."""
        pieces = self._pieces.pop(param, [])
        for piece in pieces:
            group = self.optimizer.param_groups[piece.group]
            group["params"] = [p for p in group["params"] if p is not piece.param]
            self.optimizer.state.pop(piece.param, None)

    def state_of(self, param: nn.Parameter) -> Dict[str, Any]:
        """Master ``param``'s optimizer state as whole vectors (its pieces' states put together; columns no
        parameter covers, the padding of a partitioned slice, are zero) and scalars; empty before its first step."""
        pieces = [p for p in self._pieces.get(param, []) if self.optimizer.state.get(p.param)]
        if not pieces:
            return {}
        numel = param.numel()
        out: Dict[str, Any] = {}
        for piece in pieces:
            for k, v in self.optimizer.state[piece.param].items():
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == piece.hi - piece.lo:
                    if k not in out:
                        out[k] = v.new_zeros(numel)
                    out[k][piece.lo:piece.hi] = v
                elif k not in out:
                    out[k] = v.clone() if torch.is_tensor(v) else v
        return out

    def state_bytes(self) -> int:
        total = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total

    # -- settings ------------------------------------------------------------------------------------------------
    def current_hyperparameters(self) -> List[Dict[str, Any]]:
        """What each expert group gets now: its source group's settings (read before DeepSpeed's step advances the
        schedule, so the values that apply to this step)."""
        return [group_settings(source) for source in self.sources]

    def follow_replaced_groups(self, before: Sequence[Dict[str, Any]], after: Sequence[Dict[str, Any]]) -> None:
        """Loading a checkpoint replaces the dense optimizer's param-group dicts (``torch.optim``'s
        ``load_state_dict`` builds new ones, which LR schedules drive from then on): each expert group whose source
        was one of ``before`` follows the new dict at its position."""
        for i, source in enumerate(self.sources):
            index = next((j for j, g in enumerate(before) if g is source), None)
            if index is not None and index < len(after):
                self.sources[i] = after[index]

    def add_initial_step(self, hyperparameters: Optional[Sequence[Dict[str, Any]]]) -> None:
        """Take, right before the first applied step, the step with zero gradients that DeepSpeed's ZeRO stage-0
        wrappers (FP16_Optimizer, FP16_UnfusedOptimizer: fp16, and bf16 at stage 0) take on the dense parameters
        when built (``initialize_optimizer_states``): Adam's step counter then starts at 1 and decoupled weight
        decay is applied once to the masters. Without it the experts' first bias correction differs (their first
        update is 1/0.74 of DeepSpeed's with Adam's default betas). Deferred because DeepSpeed's model weights keep
        their undecayed values until its first applied step copies the masters back."""
        self._initial_step = None if hyperparameters is None else [dict(h) for h in hyperparameters]

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self, grad_scale: float, hyperparameters: Sequence[Dict[str, Any]]) -> None:
        """Multiply accumulated gradients by ``grad_scale`` (averaging, unscale, clip), set each group's settings
        (``hyperparameters``, one dict per group, as :meth:`current_hyperparameters` read them), and step."""
        if self._initial_step is not None:
            initial, self._initial_step = self._initial_step, None
            self._step_with(initial, zero_grads=True)
        for master in self._pieces:
            if master.grad is not None:
                master.grad.mul_(grad_scale)
        self._step_with(hyperparameters, zero_grads=False)

    def _step_with(self, hyperparameters: Sequence[Dict[str, Any]], zero_grads: bool) -> None:
        """One step of the wrapped optimizer under ``hyperparameters``: each piece's gradient views its master's
        (or is zero), the settings in force before are restored afterwards for the initial zero-gradient step, and
        every piece's step count is set to its group's."""
        groups = self.optimizer.param_groups
        saved = [{k: g[k] for k in hyper if k in g} for g, hyper in zip(groups, hyperparameters)] if zero_grads \
            else None
        for group, hyper in zip(groups, hyperparameters):
            group.update(hyper)
        for master, pieces in self._pieces.items():
            grad = master.grad
            for piece in pieces:
                if zero_grads:
                    piece.param.grad = torch.zeros_like(piece.param)
                else:
                    piece.param.grad = None if grad is None else grad.reshape(-1)[piece.lo:piece.hi]
        try:
            self.optimizer.step()
        finally:
            for pieces in self._pieces.values():
                for piece in pieces:
                    piece.param.grad = None   # the views would keep the gradient rows alive
            if saved is not None:
                for group, before in zip(groups, saved):
                    group.update(before)
        self._align_steps()

    def _align_steps(self) -> None:
        """One step count per group, as in DeepSpeed's flat groups: every group took one more step (a rank owning
        none of its experts too: the count is the world's). DeepSpeed's FusedAdam increments only the state of the
        last parameter of a group and uses that count for the whole group, and a parameter that had no gradient was
        not stepped at all: every piece is set to the group's count, from the host (never read back)."""
        states_by_group: List[List[Dict[str, Any]]] = [[] for _ in self._steps]
        for pieces in self._pieces.values():
            for piece in pieces:
                state = self.optimizer.state.get(piece.param)
                if state and "step" in state:
                    states_by_group[piece.group].append(state)
        for g, states in enumerate(states_by_group):
            count = (self._steps[g] or 0) + 1
            self._steps[g] = count
            _set_counts(states, count)


def _host_count(value: Any) -> int:
    """A step count as a host integer. Only for a state arriving from outside (a checkpoint or a re-shard, kept on
    the CPU there), never per step: on a device tensor this is a sync."""
    return int(value.item()) if torch.is_tensor(value) else int(value)


def _set_counts(states: Sequence[Dict[str, Any]], count: int) -> None:
    """Every state's ``step`` set to ``count`` without reading it: plain numbers replaced, tensors set in place on
    the device they live on (two fused launches for all of them, no sync)."""
    tensors = []
    for state in states:
        step = state["step"]
        if torch.is_tensor(step):
            tensors.append(step)
        else:
            state["step"] = type(step)(count)
    if tensors:
        torch._foreach_zero_(tensors)
        torch._foreach_add_(tensors, count)


def whole_segments(numel: int) -> List[Segment]:
    """One group for all of an expert's columns."""
    return [Segment(0, 0, numel)]


def attach_expert_optimizer(runtime: Any, optimizer_cls: type, sources: Sequence[Dict[str, Any]],
                            layer_segments: Optional[Mapping[int, Sequence[Segment]]] = None,
                            like: Optional[torch.optim.Optimizer] = None) -> ExpertOptimizer:
    """Build the expert optimizer over every layer's owned masters of ``runtime`` and install it
    (``runtime.optimizer``; ``runtime.layer_group[layer]`` is the layer's key in it). ``layer_segments``: per layer
    id, its segments; missing layers put every column in the first group."""
    optimizer = ExpertOptimizer(optimizer_cls, sources, like=like, device=runtime.device)
    for shard in runtime.store.layers:
        segments = (layer_segments or {}).get(shard.layer_id) or whole_segments(shard.kernel.numel)
        part = shard.partition
        optimizer.register_layer(shard.layer_id, segments, 0 if part is None else part.index * part.size)
        for e in shard.owned:
            optimizer.add(shard.layer_id, shard.masters[e], {})
        runtime.layer_group[shard.layer_id] = shard.layer_id
    runtime.optimizer = optimizer
    return optimizer
