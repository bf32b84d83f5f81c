"""The MoE layers ``benchmarks/layer_versus.py`` puts side by side, built from one set of weights and fed one routing.

Every system computes the same function of the same input: a router (a bias-free linear ``H -> E`` whose logits are
taken in fp32, softmax, top-k, the k gates renormalized to sum to 1), SwiGLU experts ``w2(silu(w1 x) * w3 x)`` and
the gate-weighted sum of each token's k expert outputs. The weights are :func:`benchmarks.systems.canonical_weights`
(seed 1234), the router's are :func:`routed_inputs`' (see there why the routing is the same in every system and
dtype). What each system's layer call is (timed from the forward's start to the end of what its backward leaves to
do), per :data:`DESCRIPTIONS`:

- ``plain``: :class:`~benchmarks.plain_layers.PlainGroupedMoE`, written from torch ops: the floor a user gets
  without a framework;
- ``plain-all-to-all``: :class:`~benchmarks.plain_layers.PlainAllToAllMoE`, the plain layer with the count
  exchange, the token exchange each way and the receive-side permutations every rank of an N-rank all-to-all
  expert-parallel layer runs, through the 1-rank process group: the floor for the no-shortcut rows;
- ``ds_hecate``: a ``ds_hecate.MoE`` layer taken over by a 1-rank Hecate runtime built as ``deepspeed.initialize``
  builds it (:func:`ds_hecate.deepspeed_glue.initialize.build_runtime` from the user's config, ``convert_model``,
  the engine's forward pre-hook ``runtime.on_model_forward``), every expert owned; forward, backward and
  ``runtime.flush_reductions()``, which ``engine.backward`` runs after autograd's backward. DeepSpeed's engine
  itself is left out, as for every system: its ZeRO-2 gradient buckets and optimizer are the step's, not the
  layer's (and its hooks refuse a second backward without the step in between). No optimizer step is taken (what
  one does is a step cost for every system: DeepSpeed's bf16 optimizer also rewrites its bf16 weights from the
  fp32 masters); the call runs in the state a run without a monitor reaches after its first step;
- ``ds_hecate-no-shortcuts``: the same with the communicator's one-rank shortcuts off (``one_rank_shortcuts=False``):
  count exchange and token all-to-all go through the 1-rank gloo (or NCCL) group as on N ranks;
- ``ds_hecate-call`` (and ``-no-shortcuts``): the same runtime's layer call, ``LayerBinding.run``, behind the plain
  layer's router (fp32 logits, softmax, top-k, renormalized gates) instead of DeepSpeed's ``TopKGate``: what a
  Hugging Face MoE model runs (its router, then the experts module Hecate took over), and the layer call alone
  against the floor. ``ds_hecate.MoE`` keeps DeepSpeed's gate (bit-for-bit DeepSpeed's routing), which on the CPU
  costs a few ms and several dozen ops more than the plain router (top-2: a one-hot with a host read, an einsum);
  the legacy ``deepspeed-moe`` layer pays the same gate;
- ``ds_hecate-rank-of-8``: not run, see :data:`NOT_RUN`;
- ``autoep``: DeepSpeed's AutoEP layer (``expert_parallel`` on :func:`benchmarks.systems.build_model`'s AutoEP
  source, ``autoep_size`` 1, AutoEP's default grouped GEMM), converted by ``deepspeed.initialize`` with no
  optimizer (so no ZeRO hooks), called as a module;
- ``deepspeed-moe``: DeepSpeed's legacy ``deepspeed.moe.layer.MoE`` (``ep_size`` 1, ``drop_tokens=False``), through
  ``deepspeed.initialize`` with no optimizer, called as a module;
- ``autoep-no-shortcuts``, ``deepspeed-moe-no-shortcuts``: the same two layers taking the branches every rank of an
  N-rank run takes (:class:`NRankBranches`): both skip their all-to-alls when their expert-parallel size is 1, as
  ds_hecate's shortcuts skip its collectives; here they go through the 1-rank process group (AutoEP: the count
  all-to-all with its host read of the splits, the token all-to-all each way; legacy: its two all-to-alls of the
  capacity-padded ``[E, C, H]`` buffer). The N-rank paths side by side: ds_hecate-no-shortcuts against these.
  :data:`ONE_RANK_TWIN` pairs each no-shortcut system with its one-rank layer; ``benchmarks.layer_versus`` checks
  before any timing that the two compute the same bits and that only the no-shortcut one exchanges its rows.

A system whose build fails here (AutoEP without its requirements, say) is reported as not run, with the error.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.plain_layers import PlainAllToAllMoE, PlainGroupedMoE

DESCRIPTIONS = {
    "plain": "plain grouped-GEMM MoE layer from torch ops (router, sort-permute, F.grouped_mm, weighted "
             "un-permute): the floor",
    "plain-all-to-all": "the plain layer with an all-to-all expert-parallel layer's exchange (count exchange, token "
                        "all-to-alls, receive-side permutations) through the 1-rank process group: the floor for the "
                        "no-shortcut rows",
    "ds_hecate": "ds_hecate.MoE on a 1-rank Hecate runtime built as deepspeed.initialize builds it, every expert "
                 "owned",
    "ds_hecate-no-shortcuts": "the same, the communicator's one-rank shortcuts off (collectives through the 1-rank "
                              "process group, the per-rank path of N ranks)",
    "ds_hecate-call": "ds_hecate's layer call (LayerBinding.run, the path Hugging Face models take) behind the plain "
                      "layer's router, on the same 1-rank runtime",
    "ds_hecate-call-no-shortcuts": "the same, the communicator's one-rank shortcuts off",
    "ds_hecate-rank-of-8": "a rank's share of an 8-rank run (E/8 experts owned, the rest as replicas)",
    "autoep": "DeepSpeed AutoEP layer (autoep_size 1, grouped GEMM)",
    "autoep-no-shortcuts": "the same AutoEP layer on its N-rank branches (count and token all-to-alls through the "
                           "1-rank process group)",
    "deepspeed-moe": "DeepSpeed legacy deepspeed.moe.layer.MoE (ep_size 1, drop_tokens=False)",
    "deepspeed-moe-no-shortcuts": "the same legacy layer on its N-rank branches (its two all-to-alls through the "
                                  "1-rank process group)",
}
#: each no-shortcut system's one-rank layer: the same bits, without the collectives (checked before timing)
ONE_RANK_TWIN = {"plain-all-to-all": "plain", "ds_hecate-no-shortcuts": "ds_hecate",
                 "ds_hecate-call-no-shortcuts": "ds_hecate-call", "autoep-no-shortcuts": "autoep",
                 "deepspeed-moe-no-shortcuts": "deepspeed-moe"}
SYSTEMS = tuple(DESCRIPTIONS)

#: systems the benchmark cannot run in one process on one device, and why (reported with the results)
NOT_RUN = {
    "ds_hecate-rank-of-8": (
        "a Hecate group owns every expert of its layers, so in a 1-rank group every expert is owned; E/8 owned "
        "experts with the rest arriving as replicas needs 7 other ranks that own and send them. One process with "
        "one rank can only get there through a transport that fabricates the other ranks' bytes and tokens, which "
        "would time a call no real rank makes; ds_hecate-no-shortcuts is the measurable part of the per-rank path "
        "(its collectives through a real process group)"),
}


@dataclass(frozen=True)
class RoutedInputs:
    """One routing for every system: the input ``x`` ``[S, H]``, the router weight ``[E, H]``, the output gradient
    ``[S, H]`` (all in the compute dtype, on the device) and the expert each route picks, ``[S, k]`` (reference)."""

    x: torch.Tensor
    router: torch.Tensor
    grad: torch.Tensor
    choices: torch.Tensor


def routed_inputs(hidden: int, experts: int, top_k: int, tokens: int, dtype: torch.dtype, device: torch.device,
                  seed: int = 1) -> RoutedInputs:
    """Inputs whose routing is the same in every system, fp32 or bf16, whatever precision its router computes in.

    Why: AutoEP's router takes its logits in the parameters' dtype, DeepSpeed's gate in fp32; random weights would
    route some tokens differently in bf16, and the systems would not do the same work. Here each expert's router row
    has one non-zero, +-1, on one of the first ``m = ceil(E/2)`` input features (expert ``e < m`` reads feature ``e``
    with +1, expert ``m + j`` feature ``j`` with -1), and those features of every token are a permutation of
    ``1..m`` scaled by a power of two, with random signs: every logit is exact in bf16 and fp32, and a token's logits
    are distinct (``+-v``, the ``v`` distinct), so every top-k agrees. Each token picks the features of its k largest
    ``v`` and, by their signs, one of the two experts on each: uniform random routing. The other features and the
    output gradient are standard normal (rounded to ``dtype``)."""
    m = math.ceil(experts / 2)
    if hidden < m or top_k > m:
        raise ValueError(f"routed_inputs needs hidden >= ceil(experts / 2) >= top_k (hidden {hidden}, experts "
                         f"{experts}, top-k {top_k})")
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** math.floor(math.log2(4.0 / m))   # the largest logit about 4
    v = torch.argsort(torch.rand(tokens, m, generator=gen), dim=1).float() + 1.0
    signs = torch.where(torch.rand(tokens, m, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.randn(tokens, hidden, generator=gen)
    x[:, :m] = v * signs * scale
    router = torch.zeros(experts, hidden)
    for e in range(experts):
        router[e, e % m] = 1.0 if e < m else -1.0
    grad = torch.randn(tokens, hidden, generator=gen)
    logits = x @ router.t()
    choices = logits.topk(top_k, dim=1).indices
    return RoutedInputs(x.to(device, dtype), router.to(device, dtype), grad.to(device, dtype), choices)


@dataclass
class VersusLayer:
    """One system's layer, ready to call: ``forward(x)`` gives the output (``x`` shaped ``input_shape``),
    ``after_backward()`` finishes what its backward leaves (ds_hecate: the flush of the gradient reductions),
    ``reset()`` clears gradients as an optimizer step would (outside the timed call), ``phases()`` the runtime's
    per-phase seconds so far (ds_hecate only)."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    input_shape: Tuple[int, ...]
    reset: Callable[[], None]
    after_backward: Callable[[], None] = lambda: None
    phases: Optional[Callable[[], Dict[str, float]]] = None
    keep: List[Any] = field(default_factory=list)   # what must stay alive (engines, runtimes)


def _clear_grads(params) -> Callable[[], None]:
    params = list(params)

    def reset() -> None:
        for p in params:
            p.grad = None
    return reset


def _model_args(shape) -> argparse.Namespace:
    return argparse.Namespace(hidden=shape.hidden, ffn=shape.ffn, experts=shape.experts, top_k=shape.top_k,
                              layers=1, tokens=shape.tokens)


def build_plain(shape, inputs: RoutedInputs, dtype: torch.dtype, device: torch.device,
                layer_class: type = PlainGroupedMoE) -> VersusLayer:
    from benchmarks.systems import canonical_weights
    w = canonical_weights(_model_args(shape))[0]
    layer = layer_class(inputs.router.float().cpu(), w["w1"], w["w3"], w["w2"], shape.top_k).to(device, dtype)
    return VersusLayer(layer, (shape.tokens, shape.hidden), _clear_grads(layer.parameters()), keep=[layer])


def build_hecate(shape, inputs: RoutedInputs, dtype: torch.dtype, device: torch.device,
                 one_rank_shortcuts: bool = True, profile: bool = False) -> VersusLayer:
    """ds_hecate as a user gets it: the config a user writes (ZeRO-2, ``hecate.enabled``, bf16 when asked), every
    other key at its default."""
    from benchmarks.systems import build_model
    from ds_hecate.config import split_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.deepspeed_glue.initialize import build_runtime
    model = build_model(_model_args(shape), "hecate", 1, 0)
    moe = model.blocks[0].moe
    moe.gate.wg.weight.data.copy_(inputs.router.float().cpu())
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": dtype == torch.bfloat16},
              "zero_optimization": {"stage": 2, "hecate": {"enabled": True, "log_conversion": False}}}
    hcfg, stripped = split_hecate_section(config)
    runtime = build_runtime(hcfg, stripped, model, one_rank_shortcuts=one_rank_shortcuts)
    convert_model(model, runtime)
    model.to(device, dtype)   # what the engine does with the module: the gate (the experts are Hecate's now)
    binding = moe.binding
    # A run without a monitor: the step-metrics observer unhooks itself at the first optimizer step
    # (StepMetrics.end_step, from HecateEngine.step); no step is taken here, so end that one as the engine would.
    runtime.metrics.end_step(SimpleNamespace(monitor=None, global_rank=0))
    # and the call as it runs once the cost model has its steady-state figures: phases not timed (hecate.profile)
    runtime.monitor.profiling = bool(profile)

    def forward(x: torch.Tensor) -> torch.Tensor:
        runtime.on_model_forward()   # the engine's forward pre-hook (attach_engine)
        return moe(x)[0]

    def reset() -> None:
        runtime.store.zero_grads()   # what the expert optimizer's step leaves
        moe.gate.wg.weight.grad = None
    return VersusLayer(forward, (shape.tokens, shape.hidden), reset, runtime.flush_reductions,
                       lambda: dict(binding.phase_seconds()), keep=[model, runtime])


def build_hecate_call(shape, inputs: RoutedInputs, dtype: torch.dtype, device: torch.device,
                      one_rank_shortcuts: bool = True) -> VersusLayer:
    """``ds_hecate-call``: :func:`build_hecate`'s runtime, its layer call behind the plain layer's router."""
    hecate = build_hecate(shape, inputs, dtype, device, one_rank_shortcuts)
    model, runtime = hecate.keep
    moe = model.blocks[0].moe
    router = nn.Parameter(inputs.router.float().clone().to(device, dtype))

    def forward(x: torch.Tensor) -> torch.Tensor:
        runtime.on_model_forward()
        probs = F.linear(x.float(), router.float()).softmax(dim=-1)
        top, expert = probs.topk(shape.top_k, dim=-1)
        gates = top / top.sum(dim=-1, keepdim=True)
        return moe.binding.run(x, expert.t(), gates.t(), "deepspeed")

    def reset() -> None:
        runtime.store.zero_grads()
        router.grad = None
    return VersusLayer(forward, hecate.input_shape, reset, hecate.after_backward, hecate.phases,
                       keep=[model, runtime, router])


def _engine_layer(shape, inputs: RoutedInputs, dtype: torch.dtype, device: torch.device, kind: str,
                  extra: dict) -> Tuple[nn.Module, Any]:
    """A DeepSpeed baseline's layer, converted by ``deepspeed.initialize`` without an optimizer (no ZeRO hooks), in
    fp32 and then cast to ``dtype``: what DeepSpeed's bf16 engine does with the module (with ``bf16`` in the config
    and no optimizer DeepSpeed still builds its BF16_Optimizer, which refuses MoE layers outside an MoE param
    group)."""
    import deepspeed
    from benchmarks.systems import build_model
    model = build_model(_model_args(shape), kind, 1, 0)
    moe = model.blocks[0].moe
    router = moe.router if kind == "autoep" else moe.deepspeed_moe.gate.wg
    router.weight.data.copy_(inputs.router.float().cpu())
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, **extra})
    layer = engine.module.blocks[0].moe
    layer.to(device, dtype)
    return layer, engine


def build_autoep(shape, inputs: RoutedInputs, dtype: torch.dtype, device: torch.device) -> VersusLayer:
    from benchmarks.systems import autoep_section
    import transformers  # noqa: F401  (AutoEP's presets need it; a missing one is the reason it did not run)
    layer, engine = _engine_layer(shape, inputs, dtype, device, "autoep",
                                  {"expert_parallel": autoep_section(1, shape.top_k, use_grouped_mm=True)})
    if type(layer).__name__ != "AutoEPMoELayer":
        raise RuntimeError(f"AutoEP left {type(layer).__name__} unconverted")
    return VersusLayer(layer, (1, shape.tokens, shape.hidden), _clear_grads(layer.parameters()),
                       keep=[layer, engine])


def build_deepspeed_moe(shape, inputs: RoutedInputs, dtype: torch.dtype, device: torch.device) -> VersusLayer:
    layer, engine = _engine_layer(shape, inputs, dtype, device, "legacy", {})
    return VersusLayer(lambda x: layer(x)[0], (shape.tokens, shape.hidden), _clear_grads(layer.parameters()),
                       keep=[layer, engine])


class NRankBranches(int):
    """An expert-parallel size of 1 that takes a DeepSpeed layer's N-rank branches: ``== 1`` is False and ``> 1``
    True, while as a number (views, reshapes, ranges, products) it is 1. AutoEP tests ``ep_size == 1``, the legacy
    layer ``ep_size > 1``, to skip their all-to-alls on one rank; with this size each runs them through its 1-rank
    process group, as every rank of an N-rank run does (every other use of the size sees 1, the group's size)."""

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


def _on_n_rank_branches(built: VersusLayer, moe_layer: Callable[[nn.Module], nn.Module]) -> VersusLayer:
    """A DeepSpeed layer (``built.keep[0]``) whose layer holding ``ep_size`` (``moe_layer`` of it) takes its N-rank
    branches (:class:`NRankBranches`)."""
    inner = moe_layer(built.keep[0])
    if int(inner.ep_size) != 1:
        raise RuntimeError(f"{type(inner).__name__}.ep_size is {inner.ep_size}, not 1")
    inner.ep_size = NRankBranches()
    return built


BUILDERS: Dict[str, Callable[..., VersusLayer]] = {
    "plain": build_plain,
    "plain-all-to-all": lambda *a: build_plain(*a, layer_class=PlainAllToAllMoE),
    "ds_hecate": build_hecate,
    "ds_hecate-no-shortcuts": lambda *a: build_hecate(*a, one_rank_shortcuts=False),
    "ds_hecate-call": build_hecate_call,
    "ds_hecate-call-no-shortcuts": lambda *a: build_hecate_call(*a, one_rank_shortcuts=False),
    "autoep": build_autoep,
    "autoep-no-shortcuts": lambda *a: _on_n_rank_branches(build_autoep(*a), lambda layer: layer),
    "deepspeed-moe": build_deepspeed_moe,
    "deepspeed-moe-no-shortcuts": lambda *a: _on_n_rank_branches(build_deepspeed_moe(*a),
                                                                 lambda layer: layer.deepspeed_moe),
}
