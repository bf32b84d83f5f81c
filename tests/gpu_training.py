"""Small ds_hecate.MoE models trained by the Hecate runtime as the engine drives it, on a chosen device and transport:
what the GPU training checks (tests/gpu/test_gpu_training.py, test_gpu_syncs.py, test_gpu_two_ranks.py) and
tests/test_kernels.py hold a CUDA run against a CPU run with.

Routing is deterministic (no second-expert sampling, no noisy gate, no random token selection: CPU and CUDA draw
different random numbers) and every cost the scheduler plans with is configured (:data:`FIXED_COSTS`), so the
placements, and with them the summation order, never depend on how fast a run happened to be. No public entry point
gives a runtime over a chosen transport on a chosen device, so these reach the config parser, ``convert_model``,
``HecateRuntime`` and its step-boundary calls, the expert optimizer and ``build_communicator``.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, TYPE_CHECKING, Tuple

import torch
from torch import nn

import ds_hecate

if TYPE_CHECKING:
    from ds_hecate.runtime.hecate import HecateRuntime

#: CUDA runs against the CPU run (fp32), and in bf16 against each other (only atomics' order may differ)
TOLERANCE = 1e-4
BF16_TOLERANCE = 1e-3
HIDDEN = 64
FIXED_COSTS = {"compute_s_per_pair": 1e-6, "link_gbps": 1.0, "non_moe_time_s": 0.0, "replica_overhead_s": 0.0}
#: the CUDA runs: (name, transport, device_kernels)
CUDA_RUNS = (("cuda_torch", "torch", "auto"), ("cuda_torch_ops", "torch", "torch"), ("cuda_cupy", "cupy", "auto"))


class Run(NamedTuple):
    """One training run: losses and tokens per expert per step, the device ops' kernel use, and (bf16) the largest
    difference of a resident weight row from its master cast to the compute dtype after the last step."""

    losses: List[float]
    counts: List[List[int]]
    kernel_use: Dict[str, int]
    resident_error: Optional[float] = None


def fp32_everywhere() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _moe(hidden: int, expert: nn.Module, experts: int) -> nn.Module:
    return ds_hecate.MoE(hidden, expert, num_experts=experts, k=2, drop_tokens=False, use_rts=False,
                         noisy_gate_policy=None, top2_2nd_expert_sampling=False)


def build_model() -> nn.ModuleDict:
    """The demo model (a Linear, then 8 experts Linear-GELU-Linear), built on the CPU from seed 0."""
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
    return nn.ModuleDict({"inp": nn.Linear(HIDDEN, HIDDEN), "moe": _moe(HIDDEN, expert, 8)})


def build_blocks(kind: str, hidden: int, ffn: int, experts: int) -> nn.ModuleDict:
    """Two blocks ``x + moe(tanh(linear(x)))``, experts SwiGLU (``kind`` 'swiglu') or Linear-GELU-Linear with biases
    ('biased'); built on the CPU from seed 0."""
    def expert():
        if kind == "swiglu":
            return ds_hecate.SwiGLUExpert(hidden, ffn)
        return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    torch.manual_seed(0)
    return nn.ModuleDict({f"block{i}": nn.ModuleDict({"inp": nn.Linear(hidden, hidden),
                                                      "moe": _moe(hidden, expert(), experts)}) for i in range(2)})


def blocks_loss(model: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
    aux = 0.0
    block: Any
    for block in model.values():
        y, l_aux, _ = block["moe"](torch.tanh(block["inp"](x)))
        x = x + y
        aux = aux + l_aux.float()
    return x.float().pow(2).mean() + 0.01 * aux


def hecate_runtime(model, comm, dev, ranks_per_node: int, dtype=None,
                   **hecate) -> Tuple[HecateRuntime, torch.optim.AdamW]:
    """(runtime, dense AdamW) for ``model`` as the engine sets them up: its MoE layers converted onto a runtime over
    ``comm`` computing in ``dtype`` (default fp32) with :data:`FIXED_COSTS` (``hecate`` overrides keys), the model
    cast and moved to ``dev``, the expert optimizer following the dense one's learning rate."""
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.deepspeed_glue.expert_optimizer import attach_expert_optimizer
    from ds_hecate.runtime.hecate import HecateRuntime

    dtype = torch.float32 if dtype is None else dtype
    rt = HecateRuntime(parse_hecate_section({"enabled": True, **FIXED_COSTS, **hecate}), comm, dtype, ranks_per_node)
    convert_model(model, rt)
    model.to(dtype).to(dev)   # dtype first: the CUDA stand-in cannot follow `.data =` on its tensors
    dense = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attach_expert_optimizer(rt, torch.optim.AdamW, [dense.param_groups[0]])
    return rt, dense


def step(rt: HecateRuntime, dense: torch.optim.Optimizer, world: int, number: int) -> None:
    """The optimizer step and the step boundary, as the engine makes them."""
    dense.step()
    dense.zero_grad()
    assert rt.optimizer is not None
    rt.apply_step(True, world, 1.0, 0.0, rt.optimizer.current_hyperparameters())
    rt.after_step(number)


def resident_error(rt: HecateRuntime) -> Optional[float]:
    """Largest difference of a resident weight row from its master cast to the compute dtype (None: every layer's
    masters are its weights, fp32)."""
    worst = None
    for binding in rt.bindings:
        shard = binding.shard
        if shard.shares_weights or shard.partition is not None or shard.weight_rows is None:
            continue
        for row, e in zip(shard.weight_rows.unbind(0), shard.owned):
            diff = float((row.float() - shard.masters[e].detach().to(row.dtype).float()).abs().max().cpu())
            worst = diff if worst is None else max(worst, diff)
    return worst


def _communicator(transport: str, device, kernels: str = "auto"):
    """A 1-rank Communicator over ``transport`` ("torch", "cupy", or "cupy-fake": the CuPy transport over the 1-rank
    fakes of tests/gpu_fakes.py with the kernels' references, under the bare CUDA stand-in)."""
    from ds_hecate.comm.backend import build_communicator
    from ds_hecate.comm.collectives import Communicator
    if transport == "cupy-fake":
        from gpu_fakes import loopback_transport
        return Communicator(None, 0, 1, transport=loopback_transport(device, timeout_s=60))
    return build_communicator(transport, None, 0, 1, device, timeout_s=60, device_kernels=kernels)


def demo_losses(device: str, steps: int, transport: str = "torch", kernels: str = "auto",
                dtype_name: str = "fp32") -> Run:
    """The demo model trained ``steps`` steps on 1 rank on ``device`` in ``dtype_name``."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = build_model()
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    comm = _communicator(transport, dev, kernels)
    rt, dense = hecate_runtime(model, comm, dev, ranks_per_node=1, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    losses, counts = [], []
    for number in range(1, steps + 1):
        rt.on_model_forward()
        x = torch.randn(256, HIDDEN, generator=gen).to(dev).to(dtype)
        y, l_aux, exp_counts = model["moe"](model["inp"](x))
        loss = (y.float() - x.float()).pow(2).mean() + 0.01 * l_aux.float()
        loss.backward()
        rt.flush_reductions()
        step(rt, dense, 1, number)
        losses.append(float(loss.detach()))
        counts.append([int(c) for c in exp_counts.reshape(-1).tolist()])
    return Run(losses, counts, dict(getattr(comm.transport.device_ops, "used", {})), resident_error(rt))


def compare(reference: Run, other: Run, tolerance: float = TOLERANCE) -> dict:
    """Largest relative loss difference over the steps, and the first step whose routing differs."""
    a, b = reference.losses, other.losses
    worst = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)), default=float("inf"))
    differs = next((i + 1 for i, (p, q) in enumerate(zip(reference.counts, other.counts)) if p != q), None)
    return {"max_rel_diff": worst, "first_step_routing_differs": differs, "kernel_use": other.kernel_use,
            "resident_error": other.resident_error, "ok": worst <= tolerance and len(a) == len(b) > 0}


def kernel_use_problems(out: dict, dtype_name: str) -> List[str]:
    """What the runs' kernel use says is wrong: the kernel runs must run the combine (and in bf16 the pack of the
    resident refresh; in fp32 nothing is packed, the masters are the weights), the torch-ops run no kernel."""
    problems = []
    for name, _, kernels in CUDA_RUNS:
        used = out.get(name, {}).get("kernel_use")
        if used is None:
            continue
        if kernels == "torch":
            if used:
                problems.append(f"{name} ran kernels {used}")
            continue
        if used.get("combine", 0) == 0 or "combine:torch" in used:
            problems.append(f"{name}: the combine did not run on the kernel ({used})")
        packs = used.get("pack", 0)
        if dtype_name == "bf16" and (packs == 0 or "pack:torch" in used):
            problems.append(f"{name}: the resident refresh did not pack through the kernel ({used})")
        if dtype_name == "fp32" and packs:
            problems.append(f"{name}: {packs} packs in fp32 (the masters are the resident weights)")
    return problems
