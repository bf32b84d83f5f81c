"""Train a tiny MoE model with DeepSpeed, with or without Hecate, and report its trajectory.

The same function is the data-parallel oracle (no ``hecate`` section: experts are ordinary data-parallel
parameters) and the system under test, so the two runs differ only in Hecate. Runs inside ranks started by
``dist_utils.run_ranks``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.utils.checkpoint
from torch import nn

from ds_hecate.workloads import bias_gate


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
    crash_save_after: Optional[int] = None  # this rank kills itself (SIGKILL) while saving after this many steps
    crash_rank: int = 1
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
        if spec.gate_bias is not None:
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


def _kill_self_on_first_file_write() -> None:
    """Simulate kill -9 of this rank in the middle of a checkpoint save."""
    import os
    import signal

    import ds_hecate.checkpoint as checkpoint

    def die(obj, path):
        os.kill(os.getpid(), signal.SIGKILL)
    checkpoint._atomic_torch_save = die


def train(rank: int, world_size: int, spec: Spec) -> dict:
    """Train ``spec.steps`` optimizer steps; return losses, grad norms, dense params and every expert's weights."""
    import deepspeed
    import ds_hecate  # noqa: F401  (patches deepspeed.initialize)
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
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
    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    start = 0
    if spec.resume_from is not None:
        engine.load_checkpoint(spec.resume_from, load_module_only=spec.load_module_only)
        start = engine.global_steps
    torch.manual_seed(spec.seed + 1)  # same RNG stream (gate sampling) in both runs from here on
    losses: List[float] = []
    norms: List[float] = []
    for step in range(start, spec.steps):
        if spec.reseed_each_step:
            torch.manual_seed(spec.seed + 7919 * step)
        for micro in range(spec.gas):
            x, y, used = batch(spec, step, micro, rank, dtype)
            loss = engine(x, y, used)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else float("nan"))
        if spec.save_after == step + 1:
            engine.save_checkpoint(spec.ckpt_dir)
        if spec.crash_save_after == step + 1:
            if rank == spec.crash_rank:
                _kill_self_on_first_file_write()
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
    return {"losses": losses, "norms": norms, "dense": dense, "experts": experts, "local_experts": local,
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
