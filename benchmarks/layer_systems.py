"""The MoE layers ``python -m benchmarks.layer`` puts side by side, from one set of weights, fed one routing.

Every system computes the same function: a bias-free router (fp32 logits, softmax, top-k, gates renormalized),
SwiGLU experts and each token's gate-weighted sum, from :func:`benchmarks.step_systems.canonical_weights`; no
DeepSpeed engine (its buckets and optimizer belong to the step). Each one-rank system has an N-rank twin
(:data:`N_RANK_TWIN`): the same layer on the branches every rank of an N-rank run takes, its collectives through the
one-rank process group (ds_hecate: the communicator's one-rank shortcuts off; DeepSpeed's layers:
:class:`NRankBranches`; the plain layer: the all-to-all floor, :class:`PlainAllToAllMoE`). ``--hf``'s systems:
:func:`build_hf`.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_hecate.ops.permute import Permute
from ds_hecate.planning.segments import segment_permutation


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer as one rank sees it: ``experts`` SwiGLU experts ``hidden -> ffn -> hidden``, ``tokens`` routed
    top-``top_k``."""

    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens: int


SHAPES: Dict[str, LayerShape] = {
    # CPU: few tokens per expert (per-call work on the expert weights shows), many small launches, large GEMMs
    "weight-bound": LayerShape(hidden=256, ffn=256, experts=128, top_k=2, tokens=512),
    "launch-bound": LayerShape(hidden=64, ffn=64, experts=128, top_k=8, tokens=4096),
    "compute-bound": LayerShape(hidden=256, ffn=512, experts=16, top_k=2, tokens=2048),
    # each system's fixed work per call: the GEMMs shrink to almost nothing
    "host-bound": LayerShape(hidden=64, ffn=64, experts=128, top_k=8, tokens=64),
    "host-bound-8": LayerShape(hidden=32, ffn=32, experts=8, top_k=2, tokens=64),
    # CUDA: Qwen3-30B-A3B (128 experts of 768, top-8); DeepSeek-V3 (32 of its 256 experts: one of 8 EP ranks)
    "qwen3-30b-a3b": LayerShape(hidden=2048, ffn=768, experts=128, top_k=8, tokens=4096),
    "deepseek-v3": LayerShape(hidden=7168, ffn=2048, experts=32, top_k=8, tokens=4096),
    "quick": LayerShape(hidden=32, ffn=32, experts=16, top_k=2, tokens=128),
}
DESCRIPTIONS = {
    "plain": "a grouped-GEMM MoE layer from torch ops (router, sort, F.grouped_mm, weighted un-permute): the floor",
    "ds_hecate": "ds_hecate.MoE (DeepSpeed's gate) on a 1-rank Hecate runtime built as deepspeed.initialize builds it",
    "ds_hecate-call": "ds_hecate's layer call (the Hugging Face path) behind the plain layer's router, same runtime",
    "ds_hecate-ops": "the layer call's ops alone, no runtime around them (HecateOpsMoE): the floor of its host glue",
    "autoep": "DeepSpeed AutoEP layer (autoep_size 1, grouped GEMM)",
    "deepspeed-moe": "DeepSpeed's deepspeed.moe.layer.MoE (ep_size 1, drop_tokens=False)",
}
#: each one-rank system's N-rank twin: the same bits, its collectives through the process group
N_RANK_TWIN = {"plain": "plain-all-to-all", "ds_hecate": "ds_hecate-no-shortcuts",
               "ds_hecate-call": "ds_hecate-call-no-shortcuts", "autoep": "autoep-no-shortcuts",
               "deepspeed-moe": "deepspeed-moe-no-shortcuts"}
ONE_RANK_TWIN = {twin: one for one, twin in N_RANK_TWIN.items()}
#: the ops floor's parts in the order its variants take them back to the plain layer's code: the variant's name
#: suffix, the :class:`HecateOpsMoE` class flag set False, and what the variant then runs
FLOOR_STEPS = (("-no-flags", "health_flags", "counts without the health flags"),
               ("-plain-combine", "own_combine", "the plain layer's combine"),
               ("-experts", "own_experts", "the plain layer's experts on autograd"),
               ("-no-read", "host_counts", "the group ends from the device, no host read"))


def _floor_variants() -> Dict[str, Tuple[Dict[str, bool], str]]:
    """Each variant of the ops floor, one more part taken back than the one before: name -> (its class flags, its
    description), names accumulating the suffixes (``ds_hecate-ops-no-flags-plain-combine``)."""
    out: Dict[str, Tuple[Dict[str, bool], str]] = {}
    name, flags, texts = "ds_hecate-ops", cast(Dict[str, bool], {}), cast(List[str], [])
    for suffix, flag, text in FLOOR_STEPS:
        name, flags, texts = name + suffix, {**flags, flag: False}, texts + [text]
        out[name] = (flags, "ds_hecate-ops with " + ", ".join(texts))
    return out


#: the floor's variants (asked for by name only): the system -> the :class:`HecateOpsMoE` class flags it sets False
FLOOR_PARTS: Dict[str, Dict[str, bool]] = {name: flags for name, (flags, _) in _floor_variants().items()}
#: the floor's variants' descriptions
FLOOR_DESCRIPTIONS: Dict[str, str] = {name: text for name, (_, text) in _floor_variants().items()}
SYSTEMS = tuple(DESCRIPTIONS) + tuple(N_RANK_TWIN.values())
#: every system ``--systems`` may name: :data:`SYSTEMS` (a default run's) and the floor's variants
NAMED_SYSTEMS = SYSTEMS + tuple(FLOOR_DESCRIPTIONS)


#: the input ``x`` ``[S, H]``, the router weight ``[E, H]`` and the output gradient ``[S, H]``
RoutedInputs = NamedTuple("RoutedInputs", [("x", torch.Tensor), ("router", torch.Tensor), ("grad", torch.Tensor)])


def routed_inputs(shape: LayerShape, dtype: torch.dtype, device: torch.device, seed: int = 1) -> RoutedInputs:
    """Inputs every system routes alike whatever precision its router computes in (AutoEP's bf16, DeepSpeed's fp32):
    each expert's router row is one +-1 on one of the first ``m = ceil(E/2)`` features, and those features of a token
    are a permutation of ``1..m`` scaled by a power of two, with random signs, so every logit is exact in bf16 and no
    two of a token's tie. The routing is uniform at random; the rest is standard normal."""
    m = math.ceil(shape.experts / 2)
    if shape.hidden < m or shape.top_k > m:
        raise ValueError(f"routed_inputs needs hidden >= ceil(experts / 2) >= top_k, got {shape}")
    gen = torch.Generator().manual_seed(seed)
    v = torch.argsort(torch.rand(shape.tokens, m, generator=gen), dim=1).float() + 1.0
    signs = torch.where(torch.rand(shape.tokens, m, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen)
    x[:, :m] = v * signs * 2.0 ** math.floor(math.log2(4.0 / m))
    router = torch.zeros(shape.experts, shape.hidden)
    for e in range(shape.experts):
        router[e, e % m] = 1.0 if e < m else -1.0
    grad = torch.randn(shape.tokens, shape.hidden, generator=gen)
    return RoutedInputs(x.to(device, dtype), router.to(device, dtype), grad.to(device, dtype))


# -- the floors --------------------------------------------------------------------------------------------------
class PlainGroupedMoE(nn.Module):
    """The floor, as a user would write it around ``F.grouped_mm``: route, sort the routes by expert, gather their
    rows, ``[w1; w3]`` and ``w2`` as two grouped GEMMs, back to route order, each token's weighted sum in fp32."""

    def __init__(self, router: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                 top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Parameter(router.clone())
        self.gate_up = nn.Parameter(torch.cat([w1, w3], dim=1).contiguous())   # [E, 2F, H]
        self.down = nn.Parameter(w2.clone().contiguous())                    # [E, H, F]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates, order, counts = self.route(x)
        rows = x.index_select(0, order // self.top_k)
        return self.combine(self.experts(rows, counts.cumsum(0).to(torch.int32)), order, gates, x)

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gates ``[S, k]``, the routes sorted by expert, routes per expert ``[E]``)."""
        top, expert = F.linear(x.float(), self.router.float()).softmax(dim=-1).topk(self.top_k, dim=-1)
        flat = expert.reshape(-1)
        counts = torch.zeros(self.router.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        return top / top.sum(dim=-1, keepdim=True), torch.argsort(flat, stable=True), counts

    def experts(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        g, u = F.grouped_mm(rows, self.gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(g) * u, self.down.transpose(1, 2), offs=offs)

    def combine(self, y: torch.Tensor, order: torch.Tensor, gates: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y_routes = torch.index_copy(torch.empty_like(y), 0, order, y)
        return (y_routes.view(x.shape[0], self.top_k, -1) * gates.unsqueeze(-1)).sum(dim=1).to(x.dtype)


class Exchange(torch.autograd.Function):
    """``all_to_all_single`` of rows; backward the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: List[int], recv: List[int]) -> torch.Tensor:
        ctx.splits = (send, recv)
        out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send, recv = ctx.splits
        out = grad.new_empty((sum(send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send, recv)
        return out, None, None


def expert_major(received: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(perm, inverse) from ``received`` ``[sources, local experts]`` (rows per source and expert, source-major as
    the exchange delivers them): ``perm`` takes the rows expert-major, ``inverse`` puts them back."""
    lengths = received.reshape(-1)
    starts = (np.cumsum(lengths) - lengths).reshape(received.shape)
    return segment_permutation(starts.T.reshape(-1), received.T.reshape(-1))


class PlainAllToAllMoE(PlainGroupedMoE):
    """The all-to-all floor: the plain layer plus what every rank of an N-rank all-to-all layer (AutoEP, Megatron-Core's
    and torchtitan's dispatchers, ds_hecate's per-rank path) does at least: the count exchange with its host read, the
    token exchange each way, and the receive-side permutation each way (rows arrive source-major, the grouped GEMM
    needs them expert-major). Expert ``e`` lives on rank ``e // (E / N)`` of the default process group."""

    def __init__(self, router: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                 top_k: int) -> None:
        local = router.shape[0] // dist.get_world_size()
        mine = slice(dist.get_rank() * local, (dist.get_rank() + 1) * local)
        super().__init__(router, w1[mine], w3[mine], w2[mine], top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ranks = dist.get_world_size()
        gates, order, counts = self.route(x)                                 # by expert: by destination too
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)
        sent, got = (np.asarray(c, dtype=np.int64) for c in torch.stack((counts, received)).tolist())
        by_source = got.reshape(ranks, -1)
        perm, inverse = (torch.from_numpy(a).to(x.device) for a in expert_major(by_source))
        offs = torch.from_numpy(np.cumsum(by_source.sum(axis=0)).astype(np.int32)).to(x.device)
        send, recv = sent.reshape(ranks, -1).sum(axis=1).tolist(), by_source.sum(axis=1).tolist()
        rows = Exchange.apply(x.index_select(0, order // self.top_k), send, recv)
        y = self.experts(Permute.apply(rows, perm, inverse), offs)
        return self.combine(Exchange.apply(Permute.apply(y, inverse, perm), recv, send), order, gates, x)


class _ExpertsToAccumulators(torch.autograd.Function):
    """The experts of :class:`HecateOpsMoE`: GroupedFFN's arithmetic (ds_hecate.ops.grouped_ffn) written out with
    no runtime around it, the weight gradients written into fp32 accumulators."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, layer: "HecateOpsMoE") -> torch.Tensor:
        x = x.contiguous()
        gate, up = F.grouped_mm(x, layer.gate_up.detach().transpose(1, 2), offs=offs).chunk(2, dim=-1)
        act = F.silu(gate)
        hidden = act * up
        ctx.save_for_backward(x, gate, up, act, hidden, offs)
        ctx.layer = layer
        return F.grouped_mm(hidden, layer.down.detach().transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, gate, up, act, hidden, offs = ctx.saved_tensors
        layer: HecateOpsMoE = ctx.layer
        grad = grad.contiguous()
        d_hidden = F.grouped_mm(grad, layer.down.detach(), offs=offs)
        assert layer.accumulators is not None   # made by the forward
        gate_up_grad, down_grad = layer.accumulators
        down_grad.copy_(F.grouped_mm(grad.t(), hidden, offs=offs))
        d_both = torch.cat([torch.ops.aten.silu_backward(d_hidden * up, gate), d_hidden * act], dim=-1)
        gate_up_grad.copy_(F.grouped_mm(d_both.t(), x, offs=offs))
        return F.grouped_mm(d_both, layer.gate_up.detach(), offs=offs), None, None


class HecateOpsMoE(PlainGroupedMoE):
    """ds_hecate's one-rank layer call reduced to its ops, with nothing of the runtime around them: the plain
    router, the count row with its health flags and its one host read (``slot_histogram``), the expert-major sort
    of the slots, one autograd node for the experts whose written-out backward writes fp32 accumulators, the
    weighted un-permute (``ds_hecate.ops.combine``). What the call would cost if its host glue (planning, layout,
    bookkeeping, the Python between the ops) were free: the floor the runtime's own work is measured against.

    Each class flag below False takes that part back to the plain layer's code (:data:`FLOOR_PARTS`: what each of
    the floor's parts costs, docs/perf/layer-call-2026-12-07.md)."""

    #: the count row's health flags (out-of-range ids, non-finite gates), else the plain layer's counts
    health_flags = True
    #: the host read of the counts (the group ends from the host), else the group ends from the device
    host_counts = True
    #: the written-out experts node into fp32 accumulators, else the plain layer's experts on autograd
    own_experts = True
    #: the weighted un-permute of ds_hecate.ops.combine, else the plain layer's combine
    own_combine = True

    def __init__(self, router: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                 top_k: int) -> None:
        super().__init__(router, w1, w3, w2, top_k)
        #: the fp32 accumulators of the weights' gradients (gate/up, down), made at the first call on its device
        self.accumulators: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ds_hecate.ops.combine import weighted_unpermute
        from ds_hecate.runtime.dispatcher import slot_histogram
        experts = self.router.shape[0]
        top, expert = F.linear(x.float(), self.router.float()).softmax(dim=-1).topk(self.top_k, dim=-1)
        gates, flat = (top / top.sum(dim=-1, keepdim=True)).t(), expert.t().reshape(-1)
        if self.health_flags:
            row = slot_histogram(flat, gates, experts)
        else:
            row = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        if self.host_counts:
            counts = row.cpu().numpy()
            if np.count_nonzero(counts[experts:]):
                raise RuntimeError("a route out of range or a gate not finite")
            offs = torch.from_numpy(np.cumsum(counts[:experts]).astype(np.int32)).to(x.device)
        else:
            offs = row[:experts].cumsum(0).to(torch.int32)
        if self.accumulators is None:
            self.accumulators = (torch.empty(self.gate_up.shape, dtype=torch.float32, device=x.device),
                                 torch.empty(self.down.shape, dtype=torch.float32, device=x.device))
        slots = torch.argsort(flat, stable=True)
        rows = x.index_select(0, slots % x.shape[0])
        y = _ExpertsToAccumulators.apply(rows, offs, self) if self.own_experts else self.experts(rows, offs)
        if self.own_combine:
            return weighted_unpermute(y, gates, None, "deepspeed", None, slots)
        y_routes = torch.index_copy(torch.empty_like(y), 0, slots, y).view(self.top_k, x.shape[0], -1)   # [k, S, H]
        return (y_routes * gates.unsqueeze(-1)).sum(dim=0).to(x.dtype)   # (the plain layer's, over [k, S])


# -- the systems -------------------------------------------------------------------------------------------------
@dataclass
class Built:
    """One system's layer: ``forward(x)``, ``after_backward()`` (ds_hecate: its flush, as ``engine.backward`` ends),
    ``reset()`` (gradients cleared, outside the timed call), ``phases()`` (ds_hecate: its phase seconds so far)."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    input_shape: Tuple[int, ...]
    reset: Callable[[], None]
    after_backward: Callable[[], None] = lambda: None
    phases: Optional[Callable[[], Dict[str, float]]] = None
    keep: List[Any] = field(default_factory=list)   # what must stay alive (modules, engines, runtimes)
    #: ds_hecate: the router alone, ``x -> gates`` (what the call runs outside the layer's phases), for the phase
    #: table's check that the phases cover the rest of the call
    router: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


def _clear(params) -> Callable[[], None]:
    params = list(params)

    def reset() -> None:
        for p in params:
            p.grad = None
    return reset


def _model_args(shape: LayerShape) -> argparse.Namespace:
    return argparse.Namespace(hidden=shape.hidden, ffn=shape.ffn, experts=shape.experts, top_k=shape.top_k,
                              layers=1, tokens=shape.tokens)


def build_plain(shape: LayerShape, inputs: RoutedInputs, dtype, device, cls: type = PlainGroupedMoE) -> Built:
    from benchmarks.step_systems import canonical_weights
    w = canonical_weights(_model_args(shape))[0]
    layer = cls(inputs.router.float().cpu(), w["w1"], w["w3"], w["w2"], shape.top_k).to(device, dtype)
    return Built(layer, (shape.tokens, shape.hidden), _clear(layer.parameters()), keep=[layer])


def hecate_runtime(model: nn.Module, convert: Callable, dtype, device, one_rank_shortcuts: bool = True,
                   profile: bool = False):
    """A one-rank runtime as ``deepspeed.initialize`` builds it (ZeRO-2, ``hecate.enabled``, bf16 when asked, defaults
    otherwise) that took ``model``'s experts over (``convert``), every expert owned, the call as after the cost
    model's first steps: phases untimed unless ``profile``."""
    from ds_hecate.config import split_hecate_section
    from ds_hecate.deepspeed_glue.initialize import build_runtime
    hecate = {"enabled": True, "log_conversion": False}
    hcfg, stripped = split_hecate_section({"train_micro_batch_size_per_gpu": 1, "bf16": {
        "enabled": dtype == torch.bfloat16}, "zero_optimization": {"stage": 2, "hecate": hecate}})
    assert hcfg is not None
    runtime = build_runtime(hcfg, stripped, model, one_rank_shortcuts=one_rank_shortcuts)
    convert(model, runtime)
    model.to(device, dtype)   # what the engine does with the module: the gate (the experts are Hecate's now)
    # no optimizer step is taken here: end the first step as the engine would (the step observer unhooks itself)
    cast(Any, runtime.metrics).end_step(SimpleNamespace(monitor=None, global_rank=0))   # StepMetrics, build_runtime's
    runtime.monitor.profiling = profile
    return runtime


def build_hecate(shape: LayerShape, inputs: RoutedInputs, dtype, device, one_rank_shortcuts: bool = True,
                 profile: bool = False) -> Built:
    """``ds_hecate.MoE`` on :func:`hecate_runtime`."""
    from benchmarks.step_systems import build_model
    from ds_hecate.deepspeed_glue.convert import convert_model
    model = build_model(_model_args(shape), "hecate", 1, 0)
    moe = model.blocks[0].moe
    moe.gate.wg.weight.data.copy_(inputs.router.float().cpu())
    runtime = hecate_runtime(model, convert_model, dtype, device, one_rank_shortcuts, profile)

    def forward(x: torch.Tensor) -> torch.Tensor:
        runtime.on_model_forward()   # the engine's forward pre-hook
        return moe(x)[0]

    def reset() -> None:
        runtime.store.zero_grads()
        moe.gate.wg.weight.grad = None
    # (no router beside the phases: the module's gate is its layer's "route" phase)
    return Built(forward, (shape.tokens, shape.hidden), reset, runtime.flush_reductions,
                 lambda: dict(moe.binding.phase_seconds()), keep=[model, runtime])


def build_hecate_call(shape: LayerShape, inputs: RoutedInputs, dtype, device, one_rank_shortcuts: bool = True,
                      profile: bool = False) -> Built:
    """:func:`build_hecate`'s runtime, its layer call behind the plain router (what a Hugging Face MoE model runs)."""
    hecate = build_hecate(shape, inputs, dtype, device, one_rank_shortcuts, profile)
    model, runtime = hecate.keep
    moe = model.blocks[0].moe
    router = nn.Parameter(inputs.router.float().clone().to(device, dtype))

    def route(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        top, expert = F.linear(x.float(), router.float()).softmax(dim=-1).topk(shape.top_k, dim=-1)
        return expert.t(), (top / top.sum(dim=-1, keepdim=True)).t()

    def forward(x: torch.Tensor) -> torch.Tensor:
        runtime.on_model_forward()
        return moe.binding.run(x, *route(x), "deepspeed")

    def reset() -> None:
        runtime.store.zero_grads()
        router.grad = None
    return Built(forward, hecate.input_shape, reset, hecate.after_backward, hecate.phases, [model, runtime, router],
                 lambda x: route(x)[1])


def _engine_layer(shape: LayerShape, inputs: RoutedInputs, dtype, device, kind: str, extra: dict):
    """A DeepSpeed layer converted by ``deepspeed.initialize`` without an optimizer (no ZeRO hooks), then cast as
    DeepSpeed's bf16 engine casts its module."""
    import deepspeed
    from benchmarks.step_systems import build_model
    model = build_model(_model_args(shape), kind, 1, 0)
    moe = model.blocks[0].moe
    (moe.router if kind == "autoep" else moe.deepspeed_moe.gate.wg).weight.data.copy_(inputs.router.float().cpu())
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, **extra})
    layer = engine.module.blocks[0].moe
    layer.to(device, dtype)
    return layer, engine


def build_autoep(shape: LayerShape, inputs: RoutedInputs, dtype, device) -> Built:
    from benchmarks.step_systems import autoep_section
    import transformers  # noqa: F401  (AutoEP's presets need it; a missing one is the reason it did not run)
    layer, engine = _engine_layer(shape, inputs, dtype, device, "autoep",
                                  {"expert_parallel": autoep_section(1, shape.top_k, use_grouped_mm=True)})
    if type(layer).__name__ != "AutoEPMoELayer":
        raise RuntimeError(f"AutoEP left {type(layer).__name__} unconverted")
    return Built(layer, (1, shape.tokens, shape.hidden), _clear(layer.parameters()), keep=[layer, engine])


def build_deepspeed_moe(shape: LayerShape, inputs: RoutedInputs, dtype, device) -> Built:
    layer, engine = _engine_layer(shape, inputs, dtype, device, "legacy", {})
    return Built(lambda x: layer(x)[0], (shape.tokens, shape.hidden), _clear(layer.parameters()),
                 keep=[layer, engine])


class NRankBranches(int):
    """An expert-parallel size of 1 on a DeepSpeed layer's N-rank branches: ``== 1`` is False and ``> 1`` True (AutoEP
    tests the first, the legacy layer the second), while as a number (views, ranges) it is 1, the group's size."""

    def __new__(cls) -> "NRankBranches":
        return super().__new__(cls, 1)

    def __eq__(self, other: object) -> bool:
        return other is self

    def __ne__(self, other: object) -> bool:
        return other is not self

    def __gt__(self, other: int) -> bool:
        return int(other) <= 1

    def __ge__(self, other: int) -> bool:
        return int(other) <= 1

    __hash__ = int.__hash__


def _n_rank(built: Built, inner: Callable[[Any], Any]) -> Built:
    layer = inner(built.keep[0])
    if int(layer.ep_size) != 1:
        raise RuntimeError(f"{type(layer).__name__}.ep_size is {layer.ep_size}, not 1")
    layer.ep_size = NRankBranches()
    return built


BUILDERS: Dict[str, Callable[..., Built]] = {
    "plain": build_plain,
    "plain-all-to-all": functools.partial(build_plain, cls=PlainAllToAllMoE),
    "ds_hecate": build_hecate,
    "ds_hecate-ops": functools.partial(build_plain, cls=HecateOpsMoE),
    "ds_hecate-no-shortcuts": functools.partial(build_hecate, one_rank_shortcuts=False),
    "ds_hecate-call": build_hecate_call,
    "ds_hecate-call-no-shortcuts": functools.partial(build_hecate_call, one_rank_shortcuts=False),
    "autoep": build_autoep,
    "autoep-no-shortcuts": lambda *a: _n_rank(build_autoep(*a), lambda layer: layer),
    "deepspeed-moe": build_deepspeed_moe,
    "deepspeed-moe-no-shortcuts": lambda *a: _n_rank(build_deepspeed_moe(*a), lambda layer: layer.deepspeed_moe),
    **{name: functools.partial(build_plain, cls=type(name, (HecateOpsMoE,), flags))
       for name, flags in FLOOR_PARTS.items()},
}
#: the systems whose builders take ``profile`` (ds_hecate's runtimes)
PROFILED = ("ds_hecate", "ds_hecate-no-shortcuts", "ds_hecate-call", "ds_hecate-call-no-shortcuts")


# -- transformers' experts modules (``--hf``) ---------------------------------------------------------------------
#: per transformers family, its config's keys of the experts' FFN width and of their number
HF_FAMILIES: Dict[str, Tuple[str, str]] = {
    "mixtral": ("intermediate_size", "num_local_experts"), "gpt_oss": ("intermediate_size", "num_local_experts"),
    "nemotron_h": ("moe_intermediate_size", "n_routed_experts"),
    "glm4_moe": ("moe_intermediate_size", "n_routed_experts"), "qwen3_moe": ("moe_intermediate_size", "num_experts")}


def hf_systems(families: List[str]) -> List[str]:
    """``--hf``'s systems: per family ``<family>/ds_hecate`` and ``<family>/transformers`` (:func:`build_hf`)."""
    return [f"{f}/{side}" for f in families for side in ("ds_hecate", "transformers")]


def build_hf(shape: LayerShape, inputs: RoutedInputs, dtype, device, family: str, hecate: bool) -> Built:
    """The family's experts module from its transformers config at the shape's sizes (weights N(0, 0.02), seed 0)
    fed the plain layer's routing of ``inputs``: taken over by :func:`hecate_runtime` (its layer call with Hugging
    Face's weighting, what the ``"hecate"`` experts implementation runs; grouped GEMM forced, the fused fast path), or
    (``hecate=False``) transformers' own call, ``grouped_mm``."""
    from transformers import CONFIG_MAPPING
    from ds_hecate.hf.interface import interface_classes
    ffn_key, experts_key = HF_FAMILIES[family]
    sizes: Dict[str, Any] = {"hidden_size": shape.hidden, ffn_key: shape.ffn, experts_key: shape.experts}
    config = CONFIG_MAPPING[family](**sizes)
    torch.manual_seed(0)
    module = next(c.cls for c in interface_classes() if c.model_type == family)(config).to(device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    top, expert = F.linear(inputs.x.float(), inputs.router.float()).softmax(dim=-1).topk(shape.top_k, dim=-1)
    indices, weights = expert.t().contiguous(), (top / top.sum(dim=-1, keepdim=True)).t().contiguous().to(dtype)
    if not hecate:
        module.to(dtype).config._experts_implementation = "grouped_mm"
        return Built(lambda x: module(x, indices.t(), weights.t()), (shape.tokens, shape.hidden),
                     _clear(module.parameters()), keep=[module])
    from ds_hecate.hf import convert_hf_model
    os.environ["DS_HECATE_GROUPED_MM"] = "1"   # read when a layer's experts are built
    model = nn.ModuleDict({"experts": module})
    runtime = hecate_runtime(model, convert_hf_model, dtype, device)
    binding = runtime.bindings[0]

    def forward(x: torch.Tensor) -> torch.Tensor:
        runtime.on_model_forward()   # the engine's forward pre-hook
        return binding.run(x, indices, weights, "hf")
    return Built(forward, (shape.tokens, shape.hidden), runtime.store.zero_grads, runtime.flush_reductions,
                 keep=[model, runtime, binding])


BUILDERS.update({s: functools.partial(build_hf, family=s.split("/")[0], hecate=s.endswith("/ds_hecate"))
                 for s in hf_systems(list(HF_FAMILIES))})
