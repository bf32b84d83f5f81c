"""The systems the benchmark compares: the shared model and weights, their DeepSpeed configs, and a registry from
system name to the builder that sets it up, so that adding a system is one function and one entry."""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

ALL_SYSTEMS = ("ds_hecate", "autoep", "deepspeed-ep", "gather-all", "fastermoe-shadow", "ideal")
HECATE_PLACEMENTS = {"ds_hecate": "hecate", "gather-all": "all", "fastermoe-shadow": "shadow",
                     "ds_hecate-owner": "owner", "ds_hecate-uncalibrated": "hecate", "ds_hecate-replan": "hecate"}
# hecate keys besides the placement, for the optional variants (not in the default set of systems)
HECATE_OPTIONS = {"ds_hecate-uncalibrated": {"calibration": False}, "ds_hecate-replan": {"replan_tolerance": 0.0}}
DESCRIPTIONS = {
    "ds_hecate": "ds_hecate, placement 'hecate' (load-aware scheduler, prefetched SparseAllGather)",
    "autoep": "DeepSpeed AutoEP expert parallelism (dropless, ragged all-to-all)",
    "deepspeed-ep": "DeepSpeed legacy deepspeed.moe.layer.MoE, ep_size=world, drop_tokens=False",
    "gather-all": "every expert on every rank each step (ZeRO-3 style), Hecate runtime with placement 'all'",
    "fastermoe-shadow": "FasterMoE-style shadowing of the hottest experts, Hecate runtime with placement 'shadow'",
    "ds_hecate-owner": "Hecate runtime with placement 'owner' (expert parallelism on Hecate's transport)",
    "ds_hecate-uncalibrated": "ds_hecate with calibration: false (the prefetched placement only, no re-planning "
                              "after the gate)",
    "ds_hecate-replan": "ds_hecate with replan_tolerance: 0 (the scheduler searches whenever the loads change)",
    "ideal": "perfectly balanced expert compute, no communication (local experts on the mean load)",
}
BUCKET_ELEMENTS = 2_000_000


def canonical_weights(args, seed: int = 1234) -> List[Dict[str, Any]]:
    """One set of weights per layer that every system loads, so all of them compute the same function. Drawn once
    per process for the last shape asked (a DeepSeek-V3-like layer's are 1.4e9 numbers, drawn on one core): every
    system of a benchmark gets the same tensors, which each copies and none changes."""
    return _canonical_weights(args.hidden, args.ffn, args.experts, args.layers, seed)


@functools.lru_cache(maxsize=1)
def _canonical_weights(H: int, F: int, E: int, layers: int, seed: int) -> List[Dict[str, Any]]:
    import torch
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return torch.randn(*shape, generator=gen) * std
    return [{"dense_w": normal(H, H, std=H ** -0.5), "dense_b": torch.zeros(H),
             "gate": normal(E, H, std=0.02),
             "w1": normal(E, F, H, std=H ** -0.5), "w3": normal(E, F, H, std=H ** -0.5),
             "w2": normal(E, H, F, std=F ** -0.5)} for _ in range(layers)]


def _load_expert(expert, w, e: int) -> None:
    expert.w1.weight.data.copy_(w["w1"][e])
    expert.w3.weight.data.copy_(w["w3"][e])
    expert.w2.weight.data.copy_(w["w2"][e])


def build_model(args, kind: str, world: int, rank: int):
    """``kind``: 'hecate' (ds_hecate.MoE), 'legacy' (deepspeed.moe.layer.MoE), 'autoep' (plain module that AutoEP
    converts), 'ideal' (local experts on the mean load)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from ds_hecate.experts import SwiGLUExpert

    H, Fh, E, k = args.hidden, args.ffn, args.experts, args.top_k
    weights = canonical_weights(args)

    class AutoEPSource(nn.Module):
        """What AutoEP detects: a router linear and a ModuleList of SwiGLU experts (w1, w3, w2)."""

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
            out = torch.zeros_like(h)
            n_local = len(self.experts)
            offset = 0
            for i, expert in enumerate(self.experts):
                rows = self.pairs // n_local + (1 if i < self.pairs % n_local else 0)
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
                cls = ds_hecate.MoE if kind == "hecate" else DeepSpeedMoE
                self.moe = cls(H, SwiGLUExpert(H, Fh), num_experts=E, ep_size=1 if kind == "hecate" else world,
                               k=k, drop_tokens=False, use_rts=False, min_capacity=0,
                               top2_2nd_expert_sampling=False)
                inner = self.moe if kind == "hecate" else self.moe.deepspeed_moe
                inner.gate.wg.weight.data.copy_(w["gate"])
                experts = inner.experts if kind == "hecate" else inner.experts.deepspeed_experts
                first = 0 if len(experts) == E else (rank % world) * len(experts)
                for i, expert in enumerate(experts):
                    _load_expert(expert, w, first + i)
            elif kind == "autoep":
                self.moe = AutoEPSource()
                self.moe.router.weight.data.copy_(w["gate"])
                for e, expert in enumerate(self.moe.experts):
                    _load_expert(expert, w, e)
            else:
                self.moe = IdealMoE()
                self.moe.gate.weight.data.copy_(w["gate"])
                n_local = E // world
                for i, expert in enumerate(self.moe.experts):
                    _load_expert(expert, w, rank * n_local + i)

        def forward(self, h):
            h = h + torch.tanh(self.dense(h))
            out = self.moe(h if kind != "autoep" else h.unsqueeze(0))
            if isinstance(out, tuple):
                out = out[0]
            return h + out.reshape(h.shape)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(w) for w in weights])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x.pow(2).mean()

    return Model()


def ds_config(args, extra: Optional[dict] = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           # DeepSpeed's default buckets (5e8 elements) allocate 2 GB per step on a CPU; these hold the whole model
           "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET_ELEMENTS,
                                 "allgather_bucket_size": BUCKET_ELEMENTS}}
    cfg.update(extra or {})
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Registry: system name -> the builder that gives a System its engine (or local model + optimizer) and its gates
# ---------------------------------------------------------------------------------------------------------------

def _build_hecate(system: "System", args, world: int, rank: int) -> None:
    """ds_hecate and the systems on Hecate's runtime: one placement (plus options) each."""
    import deepspeed
    from ds_hecate.testing.workloads import route_gate
    name = system.name
    model = build_model(args, "hecate", world, rank)
    system.forcers = [route_gate(b.moe) for b in model.blocks]
    hec = {"enabled": True, "placement": HECATE_PLACEMENTS[name], "reshard_interval": 0,
           "log_conversion": False, **HECATE_OPTIONS.get(name, {})}
    cfg = ds_config(args)
    cfg["zero_optimization"]["hecate"] = hec
    system.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)


def _build_deepspeed_ep(system: "System", args, world: int, rank: int) -> None:
    import deepspeed
    from ds_hecate.testing.workloads import route_gate
    model = build_model(args, "legacy", world, rank)
    system.forcers = [route_gate(b.moe) for b in model.blocks]
    system.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=ds_config(args))


def autoep_section(world: int, top_k: int, use_grouped_mm: bool) -> dict:
    """The ``expert_parallel`` config that makes AutoEP convert :func:`build_model`'s ``autoep`` layers (a router
    linear and SwiGLU experts; softmax top-k, renormalized: the gate arithmetic of the other systems)."""
    return {"enabled": True, "autoep_size": world, "preset_model": "mixtral",
            "moe_layer_pattern": r"blocks\.\d+\.moe", "router_pattern": "router", "expert_pattern": "experts",
            "expert_w1": "w1", "expert_w2": "w2", "expert_w3": "w3", "top_k": top_k,
            "score_func": "softmax", "route_norm": True, "use_grouped_mm": use_grouped_mm}


def _build_autoep(system: "System", args, world: int, rank: int) -> None:
    import deepspeed
    from ds_hecate.testing.workloads import LinearRouteForcer
    import transformers  # noqa: F401  (AutoEP's presets need it; a missing one is a skip reason)
    model = build_model(args, "autoep", world, rank)
    ep = autoep_section(world, args.top_k, use_grouped_mm=False)
    system.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=ds_config(args, {"expert_parallel": ep}))
    for block in system.engine.module.blocks:
        if type(block.moe).__name__ != "AutoEPMoELayer":
            raise RuntimeError(f"AutoEP left {type(block.moe).__name__} unconverted")
        system.forcers.append(LinearRouteForcer(block.moe.router.gate))


def _build_ideal(system: "System", args, world: int, rank: int) -> None:
    import torch
    system.local_model = build_model(args, "ideal", world, rank)
    system.optimizer = torch.optim.AdamW(system.local_model.parameters(), lr=1e-4)


Builder = Callable[["System", Any, int, int], None]
BUILDERS: Dict[str, Builder] = {**{name: _build_hecate for name in HECATE_PLACEMENTS},
                                "deepspeed-ep": _build_deepspeed_ep, "autoep": _build_autoep, "ideal": _build_ideal}


class System:
    """One trained system: its engine (or local model + optimizer), its gates, and what it measured."""

    def __init__(self, name: str, args, world: int, rank: int) -> None:
        import torch
        self.name, self.world, self.rank = name, world, rank
        self.engine = None
        self.local_model = None
        self.optimizer = None
        self.forcers: List[Any] = []
        torch.manual_seed(1234)
        if name not in BUILDERS:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(DESCRIPTIONS)}")
        BUILDERS[name](self, args, world, rank)

    @property
    def hecate(self):
        return getattr(self.engine, "hecate", None) if self.engine is not None else None

    def set_routes(self, choices: Sequence[Any], pairs_per_rank: int) -> None:
        if self.local_model is not None:
            for block in self.local_model.blocks:
                block.moe.pairs = pairs_per_rank
        for forcer, c in zip(self.forcers, choices):
            forcer.choices = c

    def step(self, x) -> Dict[str, float]:
        """One training step; local (unsynchronised) phase times."""
        t0 = time.perf_counter()
        if self.engine is not None:
            loss = self.engine(x)
            t1 = time.perf_counter()
            self.engine.backward(loss)
            t2 = time.perf_counter()
            self.engine.step()
        else:
            loss = self.local_model(x)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.last_loss = float(loss.detach())
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}
