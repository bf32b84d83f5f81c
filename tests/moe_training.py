"""Train a tiny MoE model with DeepSpeed, with or without Hecate, and report its trajectory.

The same function is the data-parallel oracle (no ``hecate`` section: experts are ordinary data-parallel
parameters) and the system under test, so the two runs differ only in Hecate. Runs inside ranks started by
``dist_utils.run_ranks``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.utils.checkpoint
from torch import nn

from ds_hecate.testing.workloads import bias_gate


@dataclass(frozen=True)
class Spec:
    hecate: Optional[dict] = None          # the hecate section, None = plain DeepSpeed (the oracle)
    native: bool = False                   # ds_hecate.MoE instead of deepspeed.moe.layer.MoE
    k: int = 2
    num_experts: int = 8
    layers: int = 2
    hidden: int = 16
    ffn: int = 32
    tokens: int = 24                       # tokens per rank per micro-step
    steps: int = 20
    gas: int = 1
    clip: float = 0.0
    bf16: bool = False
    fp16: bool = False                     # DeepSpeed dynamic loss scaling (CPU: the fp16 capability probe is forced)
    initial_scale_power: int = 8
    inject_inf_step: Optional[int] = None  # rank 0 puts an Inf into one expert's gradient at this step
    virtual_ranks: int = 0                 # data (and forced routes) laid out for this many ranks: each real rank
                                           # trains on its share of them, concatenated (resizing tests)
    forced_routes: bool = False            # every token's experts drawn from (seed, step, rank, layer), not learned:
                                           # low-precision runs then cannot flip a route (gate_bias skews the draw)
    stage: int = 2
    ep_size: int = 1
    expert_kind: str = "ffn"               # "ffn" (fast path) or "generic" (functional_call path)
    gate_bias: Optional[tuple] = None      # added to gate logits: adversarial routing
    zero_token_rank: Optional[int] = None  # top-1 only: this rank masks all its tokens (used_token = 0)
    empty_rank: Optional[int] = None       # this rank's micro-batches have zero tokens (needs no aux loss)
    aux_coef: float = 0.01
    client_optimizer: bool = False         # torch AdamW over split_params_into_different_moe_groups_for_optimizer
    checkpoint: str = ""                   # activation checkpointing of each block: "torch" or "deepspeed"
    reseed_each_step: bool = False         # seed the gate's sampling per step (so a resumed run can match)
    save_after: Optional[int] = None       # engine.save_checkpoint(ckpt_dir) after this many steps
    ckpt_dir: Optional[str] = None
    resume_from: Optional[str] = None      # engine.load_checkpoint(resume_from) first, continue from its step
    load_module_only: bool = False
    zero_init: bool = False                # build the model under deepspeed.zero.Init (ZeRO-3)
    step_hook: Optional[Callable] = None    # called as step_hook(rank, step, engine) before each step (faults)
    lr: float = 5e-3
    weight_decay: float = 0.01
    seed: int = 1234
    extra_config: dict = field(default_factory=dict)


class GenericExpert(nn.Module):
    """Not an FFN shape Hecate recognizes: exercises the functional_call path (a norm, a buffer, a tuple out)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.down(torch.tanh(self.up(self.norm(x)))) * self.scale, None


class Block(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.checkpoint = spec.checkpoint
        self.mix = nn.Linear(spec.hidden, spec.hidden)
        expert = (nn.Sequential(nn.Linear(spec.hidden, spec.ffn), nn.GELU(), nn.Linear(spec.ffn, spec.hidden))
                  if spec.expert_kind == "ffn" else GenericExpert(spec.hidden, spec.ffn))
        if spec.native:
            from ds_hecate import MoE
        else:
            from deepspeed.moe.layer import MoE
        self.moe = MoE(spec.hidden, expert, num_experts=spec.num_experts, ep_size=spec.ep_size, k=spec.k,
                       drop_tokens=False, use_rts=False, min_capacity=0)
        # Distinct experts (DeepSpeed deep-copies one expert), identical on every rank (same seed).
        experts = (self.moe.experts if spec.native else self.moe.deepspeed_moe.experts.deepspeed_experts)
        for p in experts.parameters():
            nn.init.normal_(p, std=0.3)
        if spec.forced_routes:
            from ds_hecate.testing.workloads import route_gate
            self.router = route_gate(self.moe)
        elif spec.gate_bias is not None:
            bias_gate(self.moe, spec.gate_bias)

    def forward(self, h, used_token):
        if self.checkpoint == "torch" and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, h, used_token, use_reentrant=False)
        if self.checkpoint == "deepspeed" and torch.is_grad_enabled():
            import deepspeed
            return deepspeed.checkpointing.checkpoint(self._forward, h, used_token)
        return self._forward(h, used_token)

    def _forward(self, h, used_token):
        h = h + torch.tanh(self.mix(h))
        out, l_aux, _ = self.moe(h, used_token)
        return h + out, l_aux


class TinyMoE(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.inp = nn.Linear(spec.hidden, spec.hidden)
        self.blocks = nn.ModuleList([Block(spec) for _ in range(spec.layers)])
        self.head = nn.Linear(spec.hidden, 1)

    def forward(self, x, y, used_token=None):
        h = self.inp(x)
        aux = h.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            h, l_aux = block(h, used_token)
            aux = aux + l_aux
        # Mean squared error written so an empty micro-batch gives 0, not NaN.
        loss = (self.head(h).float().squeeze(-1) - y).pow(2).sum() / max(x.shape[0], 1)
        if x.shape[0] and self.spec.aux_coef:
            loss = loss + self.spec.aux_coef * aux
        return loss


def ds_config(spec: Spec) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": spec.gas,
        "gradient_clipping": spec.clip,
        "steps_per_print": 10 ** 9,
        "zero_optimization": {"stage": spec.stage},
        "zero_allow_untested_optimizer": True,
    }
    if not spec.client_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": spec.lr, "weight_decay": spec.weight_decay,
                                                        "torch_adam": True}}
    if spec.bf16:
        cfg["bf16"] = {"enabled": True}
    if spec.fp16:
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": spec.initial_scale_power,
                       "loss_scale_window": 4, "hysteresis": 1, "min_loss_scale": 1}
    if spec.hecate is not None:
        cfg["zero_optimization"]["hecate"] = dict(spec.hecate)
    cfg.update(spec.extra_config)
    return cfg


def batch(spec: Spec, step: int, micro: int, rank: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(spec.seed * 7919 + step * 131 + micro * 17 + rank)
    n = 0 if spec.empty_rank == rank else spec.tokens
    x = torch.randn(n, spec.hidden, generator=g).to(dtype)
    y = torch.randn(n, generator=g)
    used = None
    if spec.zero_token_rank is not None:
        # Integer mask: DeepSpeed's top-1 gate breaks on a float mask with drop_tokens=False (topk(k=float)).
        used = torch.full((n,), 0 if rank == spec.zero_token_rank else 1, dtype=torch.long)
    return x, y, used


def _expert_flats(moe: nn.Module) -> Dict[int, torch.Tensor]:
    """Expert id -> flat fp32 weights for an unconverted DeepSpeed or ds_hecate MoE layer on this rank."""
    if hasattr(moe, "deepspeed_moe"):
        experts = list(moe.deepspeed_moe.experts.deepspeed_experts)
        n_local = len(experts)
        first = (torch.distributed.get_rank() % moe.ep_size) * n_local if n_local != moe.num_experts else 0
    else:
        experts, first = list(moe.experts), 0
    return {first + i: torch.cat([p.detach().float().reshape(-1) for p in e.parameters()])
            for i, e in enumerate(experts)}


def _virtual(spec: Spec, rank: int, world_size: int) -> List[int]:
    """The data ranks this rank trains on: itself, or its share of ``spec.virtual_ranks``."""
    if not spec.virtual_ranks:
        return [rank]
    per = spec.virtual_ranks // world_size
    return list(range(rank * per, (rank + 1) * per))


def rank_batch(spec: Spec, step: int, micro: int, rank: int, world_size: int, dtype: torch.dtype):
    parts = [batch(spec, step, micro, v, dtype) for v in _virtual(spec, rank, world_size)]
    if len(parts) == 1:
        return parts[0]
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
            None if parts[0][2] is None else torch.cat([p[2] for p in parts]))


def force_routes(model: nn.Module, spec: Spec, step: int, micro: int, rank: int, world_size: int) -> None:
    """Set each layer's forced expert choices for this micro-batch (distinct experts per token, skewed by
    ``spec.gate_bias``), identical in the Hecate run and in the oracle, and for any world size."""
    weights = torch.softmax(torch.tensor(spec.gate_bias or (0.0,) * spec.num_experts, dtype=torch.float64), 0)
    tokens = 0 if spec.empty_rank == rank else spec.tokens
    for layer, block in enumerate(model.blocks):
        choices = []
        for v in _virtual(spec, rank, world_size):
            g = torch.Generator().manual_seed(spec.seed * 104729 + step * 7919 + micro * 131 + v * 17 + layer)
            choices.append(torch.multinomial(weights.expand(tokens, -1), spec.k, replacement=False, generator=g)
                           if tokens else torch.zeros(0, spec.k, dtype=torch.long))
        block.router.choices = torch.cat(choices)


def _allow_fp16_on_cpu() -> None:
    """DeepSpeed refuses fp16 on CPUs without native fp16 matmul (its capability probe); torch emulates fp16 on
    any CPU, so the tests force the probe to run DeepSpeed's real fp16 path (loss scaling, overflow skipping)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    if torch.float16 not in accelerator.supported_dtypes():
        supported = accelerator.supported_dtypes
        accelerator.supported_dtypes = lambda: supported() + [torch.float16]


def _inject_inf(engine, rank: int):
    """Return a function that, called after backward, makes one expert gradient Inf on rank 0 (an fp16 overflow
    that only an expert sees), in the Hecate run and in the data-parallel oracle alike."""
    if rank != 0:
        return None
    if getattr(engine, "hecate", None) is not None:
        def poison_hecate():
            shard = engine.hecate.bindings[0].shard
            param = shard.masters[min(shard.masters)]
            param.grad = torch.full_like(param, float("inf"))
        return poison_hecate
    experts = [m for n, m in engine.module.named_modules() if n.endswith("deepspeed_experts")][0]
    param = next(iter(experts.parameters()))
    handle = param.register_hook(lambda g: torch.full_like(g, float("inf")))

    def remove_hook():
        handle.remove()
    return remove_hook


def train(rank: int, world_size: int, spec: Spec) -> dict:
    """Train ``spec.steps`` optimizer steps; return losses, grad norms, dense params and every expert's weights."""
    import deepspeed
    import ds_hecate  # noqa: F401  (patches deepspeed.initialize)
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    if spec.fp16:
        _allow_fp16_on_cpu()
    torch.manual_seed(spec.seed)
    if spec.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=ds_config(spec)):
            model = TinyMoE(spec)
    else:
        model = TinyMoE(spec)
    optimizer = None
    params = model.parameters()
    if spec.client_optimizer:
        groups = [{"params": [p for p in model.parameters()], "name": "dense"}]
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
        optimizer = torch.optim.AdamW(groups, lr=spec.lr, weight_decay=spec.weight_decay)
        params = groups
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=params,
                                      config=ds_config(spec))
    dtype = torch.bfloat16 if spec.bf16 else torch.float16 if spec.fp16 else torch.float32
    start = 0
    if spec.resume_from is not None:
        engine.load_checkpoint(spec.resume_from, load_module_only=spec.load_module_only)
        start = engine.global_steps
    torch.manual_seed(spec.seed + 1)  # same RNG stream (gate sampling) in both runs from here on
    losses: List[float] = []
    norms: List[float] = []
    scales: List[float] = []
    for step in range(start, spec.steps):
        if spec.step_hook is not None:
            spec.step_hook(rank, step, engine)
        if spec.reseed_each_step:
            torch.manual_seed(spec.seed + 7919 * step)
        poisoned = _inject_inf(engine, rank) if spec.inject_inf_step == step else None
        for micro in range(spec.gas):
            x, y, used = rank_batch(spec, step, micro, rank, world_size, dtype)
            if spec.forced_routes:
                force_routes(engine.module, spec, step, micro, rank, world_size)
            loss = engine(x, y, used)
            engine.backward(loss)
            if poisoned is not None and micro == spec.gas - 1:
                poisoned()
            engine.step()
            losses.append(float(loss.detach()))
        scales.append(float(getattr(engine.optimizer, "loss_scale", 1.0)))
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else float("nan"))
        if spec.save_after == step + 1:
            engine.save_checkpoint(spec.ckpt_dir)
    dense = {n.replace("deepspeed_moe.", ""): p.detach().float().clone() for n, p in engine.module.named_parameters()
             if "experts" not in n}
    if getattr(engine, "hecate", None) is not None:
        experts = {name: full for name, full in engine.hecate.full_expert_weights().items()}
        local = None
    else:
        experts = None
        local = {name: _expert_flats(m) for name, m in engine.module.named_modules()
                 if name.endswith(".moe")}
    return {"losses": losses, "norms": norms, "scales": scales, "skipped": engine.skipped_steps, "dense": dense, "experts": experts, "local_experts": local,
            "hecate_stats": engine.hecate.stats() if getattr(engine, "hecate", None) is not None else None,
            "hecate_memory": engine.hecate.memory_bytes() if getattr(engine, "hecate", None) is not None else None}


def full_experts_of_oracle(results: List[dict]) -> Dict[str, torch.Tensor]:
    """Assemble [E, numel] expert weights from the oracle's per-rank local experts."""
    out = {}
    for name in results[0]["local_experts"]:
        merged: Dict[int, torch.Tensor] = {}
        for r in results:
            for e, flat in r["local_experts"][name].items():
                merged.setdefault(e, flat)
        out[name] = torch.stack([merged[e] for e in sorted(merged)])
    return out


def train_many(rank: int, world_size: int, specs: List[Spec]) -> List[dict]:
    """Several trainings in one set of processes (saves process start-up, the dominant cost on CPU)."""
    return [train(rank, world_size, spec) for spec in specs]


def run_specs(world_size: int, specs: List[Spec]) -> List[List[dict]]:
    """results[i][rank] for specs[i], all run on one set of ``world_size`` processes."""
    from dist_utils import run_ranks

    per_rank = run_ranks(world_size, train_many, list(specs))
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(specs))]


def assert_same_trajectory(oracle: List[dict], mine: List[dict], loss_rtol: float = 1e-5,
                           param_atol: float = 1e-4, label: str = "") -> None:
    """Hecate's run follows the data-parallel run: per-rank per-step losses, grad norms, dense and expert weights."""
    for rank, (o, m) in enumerate(zip(oracle, mine)):
        lo, lm = torch.tensor(o["losses"], dtype=torch.float64), torch.tensor(m["losses"], dtype=torch.float64)
        rel = ((lo - lm).abs() / lo.abs().clamp_min(1e-12)).max().item()
        assert rel <= loss_rtol, \
            f"{label} rank {rank}: loss rel diff {rel:.3e} > {loss_rtol}: {o['losses']} vs {m['losses']}"
        no, nm = torch.tensor(o["norms"]), torch.tensor(m["norms"])
        reported = ~torch.isnan(no)  # DeepSpeed's ZeRO stage 0 reports no norm; Hecate does
        assert torch.allclose(no[reported], nm[reported], rtol=max(loss_rtol, 1e-5) * 10, atol=1e-6), \
            f"{label} rank {rank}: grad norms differ: {o['norms']} vs {m['norms']}"
        assert o["dense"].keys() == m["dense"].keys(), f"{label}: dense parameter names differ"
        for name in o["dense"]:
            diff = (o["dense"][name] - m["dense"][name]).abs().max().item()
            assert diff <= param_atol, f"{label} rank {rank}: dense '{name}' differs by {diff:.3e}"
    full_oracle = full_experts_of_oracle(oracle)
    for rank, m in enumerate(mine):
        assert m["experts"].keys() == full_oracle.keys(), f"{label}: expert layers differ"
        for name, full in full_oracle.items():
            diff = (full - m["experts"][name]).abs().max().item()
            assert diff <= param_atol, f"{label} rank {rank}: experts of '{name}' differ by {diff:.3e}"
