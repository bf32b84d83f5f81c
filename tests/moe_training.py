"""Train a tiny MoE model with DeepSpeed, with or without Hecate, and report its trajectory.

The same function is the data-parallel oracle (no ``hecate`` section: experts are ordinary data-parallel
parameters) and the system under test, so the two runs differ only in Hecate. Runs inside ranks started by
``dist_utils.run_ranks``.

An oracle spec (``hecate=None``, ``native=False``) never imports ``ds_hecate``: when it runs in processes of its
own (a ``run_specs`` call without Hecate specs) it is DeepSpeed alone, with ``deepspeed.initialize`` unpatched
(its result's ``hecate_imported`` says so). :func:`trajectory_checks.assert_same_steps` compares two such runs step by step.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch
import torch.utils.checkpoint
from torch import nn

from grad_norms import (consolidated_expert_grads, full_grad_norm, gathered_grad_norm,  # noqa: F401
                        independent_grad_norm)


def _workloads():
    """``ds_hecate.testing.workloads`` (biased and forced gates). It needs only torch and DeepSpeed; in a process
    that has not imported ``ds_hecate`` (a plain-DeepSpeed oracle) it is loaded from its file, so the package's
    import-time patch of ``deepspeed.initialize`` never runs there."""
    if "ds_hecate" in sys.modules:
        from ds_hecate.testing import workloads
        return workloads
    module = sys.modules.get("_oracle_workloads")
    if module is None:
        package = importlib.util.find_spec("ds_hecate")   # a top-level lookup: does not import the package
        assert package is not None and package.submodule_search_locations is not None
        path = os.path.join(package.submodule_search_locations[0], "testing", "workloads.py")
        spec = importlib.util.spec_from_file_location("_oracle_workloads", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["_oracle_workloads"] = module
        spec.loader.exec_module(module)
    return module


def bias_gate(moe: nn.Module, bias) -> None:
    """``ds_hecate.testing.workloads.bias_gate`` (kept importable from here)."""
    _workloads().bias_gate(moe, bias)


@dataclass(frozen=True)
class Spec:
    hecate: Optional[dict] = None          # the hecate section, None = plain DeepSpeed (the oracle)
    native: bool = False                   # ds_hecate.MoE instead of deepspeed.moe.layer.MoE
    k: int = 2
    num_experts: int = 8
    layers: int = 2
    hidden: int = 16
    ffn: int = 32
    ffn_per_layer: Optional[tuple] = None  # expert FFN width of each MoE layer (default ``ffn`` for all): layers
                                           # of different expert sizes, which the replica pool grants apart
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
    drop_tokens: bool = False              # DeepSpeed's capacity-based token dropping
    capacity_factor: float = 1.0           # with drop_tokens: capacity = factor * tokens * k / experts
    min_capacity: int = 0
    noisy_gate_policy: Optional[str] = None   # None, "Jitter" or "RSample" (random draws: same stream in both runs)
    use_residual: bool = False             # residual MoE (an extra dense MLP mixed in per token)
    per_step_state: bool = False           # also return dense and expert weights after every step
    master_state: bool = False             # with per_step_state, fp16/bf16: also the fp32 masters (see model_state)
    independent_norm: bool = False         # ZeRO stage 0: record a grad norm the test computes (independent_grad_norm)
    client_optimizer: bool = False         # torch AdamW over split_params_into_different_moe_groups_for_optimizer
    megatron: Optional[dict] = None        # Megatron-DeepSpeed's optimizer (tests/megatron_recipes.py): weight and
                                           # bias groups (one group: "biases_apart" False), split for the experts
                                           # unless "moe_groups" is False, torch Adam; "schedule": {"warmup",
                                           # "decay", "min_lr"} its scheduler (lr from 0)
    checkpoint: str = ""                   # activation checkpointing of each block: "torch" or "deepspeed"
    reseed_each_step: bool = False         # seed the gate's sampling per step (so a resumed run can match)
    save_after: Optional[int] = None       # engine.save_checkpoint(ckpt_dir) after this many steps
    ckpt_dir: Optional[str] = None
    resume_from: Optional[str] = None      # engine.load_checkpoint(resume_from) first, continue from its step
    load_module_only: bool = False
    zero_init: bool = False                # build the model under deepspeed.zero.Init (ZeRO-3)
    step_hook: Optional[Callable] = None    # called as step_hook(rank, step, engine) before each step (faults)
    full_norm: bool = False                # plain DeepSpeed, ZeRO 1/2: also record the norm of every parameter's full
                                           # gradient (full_grad_norm), before each step
    gathered_norm: bool = False            # ZeRO 1/2: also record the norm of every unique gradient gathered on one
                                           # rank (grad_norms.gathered_grad_norm), before each step
    tp_size: int = 1                       # a model-parallel unit (tests/grid_mpu.py) of this tensor-parallel size:
                                           # each slice of tp_size consecutive ranks trains on the same data
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


def _full_values(params: List[nn.Parameter]):
    """Context in which ``params`` hold their full values and may be modified: a no-op for ordinary parameters;
    under ``deepspeed.zero.Init`` (partitioned, ``Spec.zero_init``) gathered, and rank 0's modified values kept
    (every rank runs the same initialisation and draws the same random numbers, so the RNG streams stay equal and
    the model matches the one built without zero.Init)."""
    import contextlib

    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


class Block(nn.Module):
    def __init__(self, spec: Spec, layer: int = 0) -> None:
        super().__init__()
        self.checkpoint = spec.checkpoint
        self.mix = nn.Linear(spec.hidden, spec.hidden)
        ffn = spec.ffn if spec.ffn_per_layer is None else spec.ffn_per_layer[layer]
        expert = (nn.Sequential(nn.Linear(spec.hidden, ffn), nn.GELU(), nn.Linear(ffn, spec.hidden))
                  if spec.expert_kind == "ffn" else GenericExpert(spec.hidden, ffn))
        if spec.native:
            from ds_hecate import MoE
        else:   # the same name, DeepSpeed's class
            from deepspeed.moe.layer import MoE  # type: ignore[no-redef]
        layer_of_either = MoE(spec.hidden, expert, num_experts=spec.num_experts, ep_size=spec.ep_size, k=spec.k,
                              drop_tokens=spec.drop_tokens, capacity_factor=spec.capacity_factor,
                              min_capacity=spec.min_capacity, noisy_gate_policy=spec.noisy_gate_policy,
                              use_residual=spec.use_residual, use_rts=False)
        self.moe = cast(Any, layer_of_either)   # ds_hecate's or DeepSpeed's layer: their attributes differ
        # Distinct experts (DeepSpeed deep-copies one expert), identical on every rank (same seed). With ep_size > 1
        # DeepSpeed's layer holds num_experts / ep_size local experts, drawn alike on every rank, so expert e has
        # the values of local expert e mod that: ds_hecate.MoE (all experts on every rank) is given the same.
        experts = (self.moe.experts if spec.native else self.moe.deepspeed_moe.experts.deepspeed_experts)
        n_local = spec.num_experts // spec.ep_size
        with _full_values(list(experts.parameters())):
            for expert in list(experts)[:n_local]:
                for p in expert.parameters():
                    nn.init.normal_(p, std=0.3)
            for e, expert in enumerate(list(experts)[n_local:], n_local):
                for p, q in zip(expert.parameters(), experts[e % n_local].parameters()):
                    p.data.copy_(q.data)
        if spec.forced_routes:
            self.router = _workloads().route_gate(self.moe)
        elif spec.gate_bias is not None:
            inner = self.moe.deepspeed_moe if hasattr(self.moe, "deepspeed_moe") else self.moe
            original = inner.gate.wg.weight
            bias_gate(self.moe, spec.gate_bias)
            if hasattr(original, "ds_id"):  # zero.Init: the biased copy read empty partitions; copy the full values
                with _full_values([original, inner.gate.wg.weight]):
                    inner.gate.wg.weight.data.copy_(original.data)

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
        self.blocks = nn.ModuleList([Block(spec, layer) for layer in range(spec.layers)])
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
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": spec.gas,
        "gradient_clipping": spec.clip,
        "steps_per_print": 10 ** 9,
        "zero_optimization": {"stage": spec.stage},
        "zero_allow_untested_optimizer": True,
    }
    if not spec.client_optimizer and spec.megatron is None:
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


def _expert_flats(moe: Any) -> Dict[int, torch.Tensor]:
    """Expert id -> flat fp32 weights for an unconverted DeepSpeed or ds_hecate MoE layer on this rank."""
    if hasattr(moe, "deepspeed_moe"):
        experts = list(moe.deepspeed_moe.experts.deepspeed_experts)
        n_local = len(experts)
        first = (torch.distributed.get_rank() % moe.ep_size) * n_local if n_local != moe.num_experts else 0
    else:
        experts, first = list(moe.experts), 0
    params = [p for e in experts for p in e.parameters()]
    if any(hasattr(p, "ds_id") for p in params):   # ZeRO-3 partitions: gather the full values (collective)
        import deepspeed
        with deepspeed.zero.GatheredParameters(params):
            return {first + i: torch.cat([p.detach().float().reshape(-1) for p in e.parameters()])
                    for i, e in enumerate(experts)}
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
    for layer, block in enumerate(cast(Any, model).blocks):   # TinyMoE's
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
        def poison_hecate():   # in place, what the expert optimizer will read: the master's gradient (a view of
            shard = engine.hecate.bindings[0].shard   # the owner's rows, or with groups of its reduced slice)
            master = shard.masters[min(shard.masters)]
            if master.grad is None:
                shard.grad_rows(engine.hecate.device)
            master.grad.fill_(float("inf"))
        return poison_hecate
    experts = [m for n, m in engine.module.named_modules() if n.endswith("deepspeed_experts")][0]
    param = next(iter(experts.parameters()))
    handle = param.register_hook(lambda g: torch.full_like(g, float("inf")))

    def remove_hook():
        handle.remove()
    return remove_hook


def _model_parallel_unit(spec: Spec):
    """``Spec.tp_size`` > 1: a model-parallel unit of that tensor-parallel size (tests/grid_mpu.py), and in the oracle
    DeepSpeed's own tensor-parallel token gather made to run on gloo; else None."""
    if spec.tp_size == 1:
        return None
    from grid_mpu import GridMPU, flat_token_gather_on_gloo
    if spec.hecate is None:
        flat_token_gather_on_gloo()
    return GridMPU(spec.tp_size)


def train(rank: int, world_size: int, spec: Spec) -> dict:
    """Train ``spec.steps`` optimizer steps; return losses, grad norms, dense params and every expert's weights."""
    import deepspeed
    if spec.hecate is not None or spec.native:
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
    optimizer: Optional[torch.optim.Optimizer] = None
    params: Any = model.parameters()
    lr_scheduler = None
    if spec.client_optimizer:
        groups = [{"params": [p for p in model.parameters()], "name": "dense"}]
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
        optimizer = torch.optim.AdamW(groups, lr=spec.lr, weight_decay=spec.weight_decay)
        params = groups
    if spec.megatron is not None:   # as Megatron-DeepSpeed calls initialize: optimizer and scheduler, no parameters
        import megatron_recipes
        optimizer = megatron_recipes.optimizer(
            megatron_recipes.param_groups(model, spec.megatron.get("moe_groups", True),
                                          spec.megatron.get("biases_apart", True)), spec.lr, spec.weight_decay)
        params = None
        schedule = spec.megatron.get("schedule")
        if schedule:
            lr_scheduler = megatron_recipes.ParamScheduler(optimizer, spec.lr, schedule["min_lr"], schedule["warmup"],
                                                           schedule["decay"], spec.weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=params,
                                      lr_scheduler=lr_scheduler, config=ds_config(spec),
                                      mpu=_model_parallel_unit(spec))
    data_rank, data_world = rank // spec.tp_size, world_size // spec.tp_size   # a slice's TP ranks: the same data
    dtype = torch.bfloat16 if spec.bf16 else torch.float16 if spec.fp16 else torch.float32
    if spec.resume_from is not None:
        engine.load_checkpoint(spec.resume_from, load_module_only=spec.load_module_only)
    start = engine.global_steps   # 0, or the checkpoint's step
    torch.manual_seed(spec.seed + 1)  # same RNG stream (gate sampling) in both runs from here on
    losses: List[float] = []
    norms: List[float] = []
    scales: List[float] = []
    states: List[dict] = []
    independent: List[float] = []
    full_norms: List[float] = []   # Spec.full_norm
    gathered: List[float] = []   # Spec.gathered_norm: every gradient's, and those tensor-parallel rank 0 holds
    gathered_tp0: List[float] = []
    scales_before: List[float] = []
    for step in range(start, spec.steps):
        if spec.step_hook is not None:
            spec.step_hook(rank, step, engine)
        if spec.reseed_each_step:
            torch.manual_seed(spec.seed + 7919 * step)
        scales_before.append(float(getattr(engine.optimizer, "loss_scale", 1.0)))
        poisoned = _inject_inf(engine, rank) if spec.inject_inf_step == step else None
        for micro in range(spec.gas):
            x, y, used = rank_batch(spec, step, micro, data_rank, data_world, dtype)
            if spec.forced_routes:
                force_routes(engine.module, spec, step, micro, data_rank, data_world)
            loss = engine(x, y, used)
            engine.backward(loss)
            if poisoned is not None and micro == spec.gas - 1:
                poisoned()
            if spec.independent_norm and spec.stage == 0 and micro == spec.gas - 1:
                independent.append(independent_grad_norm(engine, world_size))
            if spec.full_norm and micro == spec.gas - 1:
                full_norms.append(full_grad_norm(engine))
            if spec.gathered_norm and micro == spec.gas - 1:
                every, on_tp_rank0 = gathered_grad_norm(engine)
                gathered.append(every)
                gathered_tp0.append(on_tp_rank0)
            engine.step()
            losses.append(float(loss.detach()))
        scales.append(float(getattr(engine.optimizer, "loss_scale", 1.0)))
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else float("nan"))
        if spec.save_after == step + 1:
            engine.save_checkpoint(spec.ckpt_dir)
        if len(independent) < len(norms):
            independent.append(float("nan"))
        if spec.per_step_state:
            state = model_state(engine, masters=spec.master_state)
            if getattr(engine, "hecate", None) is not None:  # replicas each layer's plan of this step moved
                state["replicas"] = [b.tally.last_plan.num_moved if b.tally.last_plan is not None else 0
                                     for b in engine.hecate.bindings]
            states.append(state)
    final = model_state(engine)
    return {"losses": losses, "norms": norms, "scales": scales, "skipped": engine.skipped_steps,
            "dense": final["dense"], "experts": final["experts"], "local_experts": final["local_experts"],
            "states": states, "independent_norms": independent, "scales_before": scales_before,
            "full_norms": full_norms, "gathered_norms": gathered,
            "gathered_tp0_norms": gathered_tp0, "hecate_imported": "ds_hecate" in sys.modules,
            "hecate_stats": engine.hecate.stats() if getattr(engine, "hecate", None) is not None else None,
            "hecate_memory": engine.hecate.memory_bytes() if getattr(engine, "hecate", None) is not None else None}


def model_state(engine, masters: bool = False) -> dict:
    """Dense weights (fp32 copies) and every expert's weights: Hecate's consolidated ``[E, numel]`` per layer
    (a collective), or the oracle's local experts (assembled over ranks by :func:`trajectory_checks.full_experts_of_oracle`).

    ``masters`` (fp16/bf16 runs): also ``dense_fp32`` and, for the oracle, ``local_experts_fp32``: the fp32 master
    weights DeepSpeed's optimizer steps (collectives), where the module holds only their fp16/bf16 rounding. Hecate's
    ``experts`` are its fp32 masters already. Comparing masters keeps the rounding of the module copy (about 5e-4 of
    a weight in fp16) out of the comparison.
    """
    module = engine.module
    named = [(n.replace("deepspeed_moe.", ""), p) for n, p in module.named_parameters()]
    dense = {n: _dense_value(engine, p) for n, p in named if "experts" not in n}
    low_precision = any(p.dtype in (torch.float16, torch.bfloat16) for _, p in named)
    extra: Dict[str, Any] = {}
    if masters and low_precision:
        fp32 = {n: _fp32_master(engine, p) for n, p in named}
        if all(v is not None for v in fp32.values()):
            extra["dense_fp32"] = {n: v for n, v in fp32.items() if "experts" not in n}
            if getattr(engine, "hecate", None) is None:
                complete = cast(Dict[str, torch.Tensor], fp32)   # no value is None (checked above)
                extra["local_experts_fp32"] = _expert_masters(module, complete)
    if getattr(engine, "hecate", None) is not None:
        return {"dense": dense, "experts": dict(engine.hecate.full_expert_weights()), "local_experts": None, **extra}
    local = {name: _expert_flats(m) for name, m in module.named_modules() if name.endswith(".moe")}
    return {"dense": dense, "experts": None, "local_experts": local, **extra}


def _fp32_master(engine, param) -> Optional[torch.Tensor]:
    """The full fp32 master of a parameter DeepSpeed's optimizer keeps (ZeRO 1-3, BF16_Optimizer: through
    ``safe_get_full_fp32_param``, a collective; FP16_UnfusedOptimizer: its ``fp32_groups``), else None."""
    from deepspeed.utils import safe_get_full_fp32_param

    value = safe_get_full_fp32_param(param)
    if value is not None:
        return value.detach().float().cpu().clone()
    optimizer = engine.optimizer
    for low, high in zip(getattr(optimizer, "fp16_groups", []), getattr(optimizer, "fp32_groups", [])):
        for p, master in zip(low, high):
            if p is param:
                return master.detach().float().cpu().clone()
    return None


def _expert_masters(module: nn.Module, fp32: Dict[str, torch.Tensor]) -> Dict[str, Dict[int, torch.Tensor]]:
    """Like :func:`_expert_flats` (the oracle's DeepSpeed MoE layers), from the fp32 masters ``fp32`` (by name)."""
    out = {}
    for name, moe in module.named_modules():
        if not name.endswith(".moe"):
            continue
        experts = list(moe.deepspeed_moe.experts.deepspeed_experts)
        first = (torch.distributed.get_rank() % moe.ep_size) * len(experts) if len(experts) != moe.num_experts else 0
        out[name] = {first + i: torch.cat([fp32[f"{name}.experts.deepspeed_experts.{i}.{pn}"].reshape(-1)
                                           for pn, _ in expert.named_parameters()])
                     for i, expert in enumerate(experts)}
    return out


def _dense_value(engine, param) -> torch.Tensor:
    """A dense parameter's full value; under ZeRO-3 gathered from its partitions first."""
    if hasattr(param, "ds_id") and getattr(param, "ds_status", None) is not None:
        import deepspeed
        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().float().clone()
    return param.detach().float().clone()


def train_many(rank: int, world_size: int, specs: List[Spec]) -> List[dict]:
    """Several trainings in one set of processes (saves process start-up, the dominant cost on CPU)."""
    return [train(rank, world_size, spec) for spec in specs]


def run_specs(world_size: int, specs: List[Spec], timeout: Optional[float] = None) -> List[List[dict]]:
    """results[i][rank] for specs[i], all run on one set of ``world_size`` processes (watchdog: ``timeout`` seconds,
    default ``dist_utils.DEFAULT_TIMEOUT_S``)."""
    from dist_utils import run_ranks

    per_rank = (run_ranks(world_size, train_many, list(specs)) if timeout is None else
                run_ranks(world_size, train_many, list(specs), timeout=timeout))
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(specs))]


def run_against_oracles(world_size: int, cases: Dict[str, Tuple[Spec, dict, Any]], oracle_of: Callable[[Spec], Spec],
                        timeout: float) -> Dict[str, Tuple[List[dict], List[dict]]]:
    """For each case ``name -> (spec, hecate section, tolerances)``: (the oracle's results, Hecate's results). The
    distinct oracles (``oracle_of(spec)``: plain DeepSpeed) run first on processes of their own, so no Hecate import
    touches them, then every case with ``hecate = {"enabled": True, **section}``."""
    oracles: List[Spec] = []
    for spec, _, _ in cases.values():
        if oracle_of(spec) not in oracles:
            oracles.append(oracle_of(spec))
    mine = [replace(spec, hecate={"enabled": True, **section}) for spec, section, _ in cases.values()]
    oracle_runs = run_specs(world_size, oracles, timeout=timeout)
    hecate_runs = run_specs(world_size, mine, timeout=timeout)
    return {name: (oracle_runs[oracles.index(oracle_of(spec))], hecate_runs[i])
            for i, (name, (spec, _, _)) in enumerate(cases.items())}
