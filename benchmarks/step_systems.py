"""What ``python -m benchmarks.step`` trains: one model and one set of weights for every system, the systems, and the
routing forced on their gates.

Systems (docs/benchmarks.md): :data:`ALL_SYSTEMS`, and ``ds_hecate-owner``, ``ds_hecate-uncalibrated`` and
``ds_hecate-replan`` on request; ``gather-all`` and ``fastermoe-shadow`` are ds_hecate's placements ``all`` and
``shadow``.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ds_hecate.planning.balance import force_uniform, is_uniform
from ds_hecate.testing.workloads import RouteSource

ALL_SYSTEMS = ("ds_hecate", "autoep", "deepspeed-ep", "gather-all", "fastermoe-shadow", "ideal")
HECATE_PLACEMENTS = {"ds_hecate": "hecate", "gather-all": "all", "fastermoe-shadow": "shadow",
                     "ds_hecate-owner": "owner", "ds_hecate-uncalibrated": "hecate", "ds_hecate-replan": "hecate"}
HECATE_OPTIONS: Dict[str, Dict[str, Any]] = {"ds_hecate-uncalibrated": {"calibration": False},
                                             "ds_hecate-replan": {"replan_tolerance": 0.0}}
#: DeepSpeed's default buckets (5e8 elements) allocate 2 GB per step on a CPU; these hold the whole model
BUCKET_ELEMENTS = 2_000_000
UNIFORM = "-uniform"


def canonical_weights(args) -> List[Dict[str, Any]]:
    """One set of weights per layer that every system copies; drawn once per process (1.4e9 numbers for a
    DeepSeek-V3-like layer)."""
    return _weights(args.hidden, args.ffn, args.experts, args.layers, 1234)


@functools.lru_cache(maxsize=1)
def _weights(H: int, F: int, E: int, layers: int, seed: int) -> List[Dict[str, Any]]:
    import torch
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return torch.randn(*shape, generator=gen) * std
    return [{"dense_w": normal(H, H, std=H ** -0.5), "dense_b": torch.zeros(H), "gate": normal(E, H, std=0.02),
             "w1": normal(E, F, H, std=H ** -0.5), "w3": normal(E, F, H, std=H ** -0.5),
             "w2": normal(E, H, F, std=F ** -0.5)} for _ in range(layers)]


def _load_expert(expert, w, e: int) -> None:
    for name in ("w1", "w3", "w2"):
        getattr(expert, name).weight.data.copy_(w[name][e])


def build_model(args, kind: str, world: int, rank: int):
    """``layers`` blocks of (Linear + tanh, top-k MoE of SwiGLU experts), the loss the output's mean square. ``kind``:
    'hecate' (ds_hecate.MoE), 'legacy' (deepspeed.moe.layer.MoE), 'autoep' (a router and a ModuleList of experts,
    which AutoEP converts) or 'ideal' (this rank's experts on the mean load)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from ds_hecate.experts import SwiGLUExpert

    H, Fh, E, k = args.hidden, args.ffn, args.experts, args.top_k
    weights = canonical_weights(args)

    class AutoEPSource(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(H, E, bias=False)
            self.experts = nn.ModuleList([SwiGLUExpert(H, Fh) for _ in range(E)])

        def forward(self, h):
            raise RuntimeError("AutoEP did not convert this layer")

    class IdealMoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(H, E, bias=False)
            self.experts = nn.ModuleList([SwiGLUExpert(H, Fh) for _ in range(E // world)])
            self.pairs = 0

        def forward(self, h):
            w = F.softmax(self.gate(h).float(), dim=-1)[:, :1]
            out, offset = torch.zeros_like(h), 0
            for i, expert in enumerate(self.experts):
                rows = self.pairs // len(self.experts) + (1 if i < self.pairs % len(self.experts) else 0)
                idx = (torch.arange(rows) + offset) % max(1, h.shape[0])
                offset += rows
                out = out.index_add(0, idx, expert(h.index_select(0, idx)) * w.index_select(0, idx))
            return out

    class Block(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.dense = nn.Linear(H, H)
            self.dense.weight.data.copy_(w["dense_w"])
            self.dense.bias.data.copy_(w["dense_b"])
            if kind in ("hecate", "legacy"):
                import ds_hecate
                from deepspeed.moe.layer import MoE as DeepSpeedMoE
                self.moe = (ds_hecate.MoE if kind == "hecate" else DeepSpeedMoE)(
                    H, SwiGLUExpert(H, Fh), num_experts=E, ep_size=1 if kind == "hecate" else world, k=k,
                    drop_tokens=False, use_rts=False, min_capacity=0, top2_2nd_expert_sampling=False)
                inner: Any = self.moe if kind == "hecate" else self.moe.deepspeed_moe
                inner.gate.wg.weight.data.copy_(w["gate"])
                experts = inner.experts if kind == "hecate" else inner.experts.deepspeed_experts
                first = 0 if len(experts) == E else (rank % world) * len(experts)
                for i, expert in enumerate(experts):
                    _load_expert(expert, w, first + i)
            else:
                self.moe = AutoEPSource() if kind == "autoep" else IdealMoE()
                router: Any = self.moe.router if kind == "autoep" else self.moe.gate
                router.weight.data.copy_(w["gate"])
                first = 0 if kind == "autoep" else rank * (E // world)
                for i, expert in enumerate(self.moe.experts):
                    _load_expert(expert, w, first + i)

        def forward(self, h):
            h = h + torch.tanh(self.dense(h))
            out = self.moe(h if kind != "autoep" else h.unsqueeze(0))
            return h + (out[0] if isinstance(out, tuple) else out).reshape(h.shape)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(w) for w in weights])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x.pow(2).mean()

    return Model()


def ds_config(extra: Optional[dict] = None) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET_ELEMENTS,
                                  "allgather_bucket_size": BUCKET_ELEMENTS}, **(extra or {})}


def autoep_section(world: int, top_k: int, use_grouped_mm: bool) -> dict:
    """The ``expert_parallel`` section that makes AutoEP convert the ``autoep`` layers (softmax top-k, renormalized)."""
    return {"enabled": True, "autoep_size": world, "preset_model": "mixtral",
            "moe_layer_pattern": r"blocks\.\d+\.moe", "router_pattern": "router", "expert_pattern": "experts",
            "expert_w1": "w1", "expert_w2": "w2", "expert_w3": "w3", "top_k": top_k,
            "score_func": "softmax", "route_norm": True, "use_grouped_mm": use_grouped_mm}


def _build_gated(system: "System", args, world: int, rank: int) -> None:
    """ds_hecate and the systems on its runtime (one placement each), and DeepSpeed's legacy MoE layer."""
    import deepspeed
    from ds_hecate.testing.workloads import route_gate
    hecate = system.name in HECATE_PLACEMENTS
    model = build_model(args, "hecate" if hecate else "legacy", world, rank)
    system.forcers = [route_gate(b.moe) for b in model.blocks]
    cfg = ds_config()
    if hecate:
        cfg["zero_optimization"]["hecate"] = {"enabled": True, "placement": HECATE_PLACEMENTS[system.name],
                                              "reshard_interval": 0, "log_conversion": False,
                                              **HECATE_OPTIONS.get(system.name, {})}
    system.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)


def _build_autoep(system: "System", args, world: int, rank: int) -> None:
    import deepspeed
    import transformers  # noqa: F401  (AutoEP's presets need it; a missing one is the reason it is skipped)
    from ds_hecate.testing.workloads import LinearRouteForcer
    model = build_model(args, "autoep", world, rank)
    ep = autoep_section(world, args.top_k, use_grouped_mm=False)
    system.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=ds_config({"expert_parallel": ep}))
    for block in system.engine.module.blocks:
        if type(block.moe).__name__ != "AutoEPMoELayer":
            raise RuntimeError(f"AutoEP left {type(block.moe).__name__} unconverted")
        system.forcers.append(LinearRouteForcer(block.moe.router.gate))


def _build_ideal(system: "System", args, world: int, rank: int) -> None:
    import torch
    system.local_model = build_model(args, "ideal", world, rank)
    system.optimizer = torch.optim.AdamW(system.local_model.parameters(), lr=1e-4)


BUILDERS: Dict[str, Callable[["System", Any, int, int], None]] = {
    **{name: _build_gated for name in HECATE_PLACEMENTS}, "deepspeed-ep": _build_gated,
    "autoep": _build_autoep, "ideal": _build_ideal}


class System:
    """One trained system: its engine (or local model and optimizer) and the forcers of its gates."""

    def __init__(self, name: str, args, world: int, rank: int) -> None:
        import torch
        self.name, self.last_loss = name, float("nan")
        self.engine: Any = None
        self.local_model: Any = None
        self.optimizer: Any = None
        self.forcers: List[Any] = []
        torch.manual_seed(1234)
        BUILDERS[name](self, args, world, rank)

    @property
    def hecate(self):
        return getattr(self.engine, "hecate", None)

    def set_routes(self, choices: Sequence[Any], pairs_per_rank: int) -> None:
        if self.local_model is not None:
            for block in self.local_model.blocks:
                block.moe.pairs = pairs_per_rank
        for forcer, c in zip(self.forcers, choices):
            forcer.choices = c

    def step(self, x) -> Dict[str, float]:
        """One training step; this rank's forward, backward and optimizer seconds."""
        t0 = time.perf_counter()
        model = self.engine if self.engine is not None else self.local_model
        loss = model(x)
        t1 = time.perf_counter()
        if self.engine is not None:
            self.engine.backward(loss)
            t2 = time.perf_counter()
            self.engine.step()
        else:
            loss.backward()
            t2 = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.last_loss = float(loss.detach())
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": time.perf_counter() - t2}


# -- routing -----------------------------------------------------------------------------------------------------
class UniformRoutes(RouteSource):
    """``base``'s tokens per rank with every call's pairs forced uniform over the experts (``force_uniform``)."""

    def __init__(self, base: RouteSource, name: str) -> None:
        self.base, self.name = base, name
        self.world_size, self.num_experts, self.top_k = base.world_size, base.num_experts, base.top_k

    def tokens(self, step: int, rank: int) -> int:
        return self.base.tokens(step, rank)

    def counts(self, step: int, layer: int) -> List[List[int]]:
        return force_uniform(self.base.counts(step, layer)).tolist()


def _profile(routes: RouteSource, steps: int, layers: int) -> Tuple[Tuple[Tuple[int, ...], ...], bool]:
    """(pairs per rank of every (step, layer), whether every call is uniform up to rounding)."""
    calls = [np.asarray(routes.counts(s, layer)) for s in range(steps) for layer in range(layers)]
    return tuple(tuple(int(t) for t in c.sum(axis=1)) for c in calls), all(is_uniform(c) for c in calls)


def counterparts(sources: Dict[str, RouteSource], steps: int, layers: int) -> Dict[str, Optional[str]]:
    """Per source, the source that is its forced-uniform routing: itself when uniform, else one uniform with the
    same pairs per rank at every call (W0, where every rank holds as many tokens), else None."""
    profiles = {n: _profile(r, steps, layers) for n, r in sources.items()}
    return {n: n if uniform else next((m for m, (t, u) in profiles.items() if u and t == totals), None)
            for n, (totals, uniform) in profiles.items()}


def route_sources(args, world: int) -> List[Tuple[str, str, RouteSource]]:
    """``(name, title, routes)`` per workload: the named ones, the traces, and a ``<name>-uniform`` run for each set
    of pairs per rank that no other run is the forced-uniform routing of."""
    from ds_hecate.sim.workloads import WORKLOADS
    from ds_hecate.testing.workloads import TraceRoutes, WorkloadRoutes
    sources: List[Tuple[str, str, RouteSource]] = []
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        sources.append((name, WORKLOADS[name].title if name in WORKLOADS else name,
                        WorkloadRoutes(name, world, args.experts, args.top_k, args.tokens, args.seed)))
    for path in args.trace:
        if not os.path.isabs(path) and not os.path.exists(path):   # a record's trace, relative to the checkout
            path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
        src = TraceRoutes(path, world, args.experts, args.top_k, args.tokens)
        sources.append((src.name, f"trace {os.path.basename(path)} ({src.num_steps} steps)", src))
    steps = args.warmup + args.steps
    found = counterparts({n: r for n, _, r in sources}, steps, args.layers)
    seen = set()
    for name, title, routes in list(sources):
        totals = _profile(routes, steps, args.layers)[0] if found[name] is None else None
        if totals is not None and totals not in seen:   # force_uniform depends only on the pairs per rank
            seen.add(totals)
            sources.append((name + UNIFORM, f"{title}, routing forced uniform", UniformRoutes(routes, name + UNIFORM)))
    return sources
