"""Stages ``training`` (fp32) and ``training_bf16``: a small ds_hecate.MoE model trained with optimizer steps on 1
rank on the CPU and on CUDA, from the same initial weights on the same batches.

Routing is deterministic, so the two devices route alike: DeepSpeed's top-2 gate samples its second expert with
Gumbel noise from the device's generator by default (``top2_2nd_expert_sampling``), which CPU and CUDA draw
differently, so it is switched off, as are RSample/Jitter (``noisy_gate_policy=None``) and random token selection.
TF32 is off (fp32 products on both). CUDA runs three times: over the torch transport with the CUDA kernels as its
device work (``device_kernels: auto``, the default, which must run them on a GPU), over the torch transport with
torch ops alone, and over the CuPy transport (NCCL and the kernels). The per-step token counts per expert are
compared too: the first step whose routing differs is named.

- ``training`` (fp32): every CUDA run's losses within 1e-4 (relative) of the CPU run's at every step. The layer
  call's combine runs through the kernel; nothing is packed (fp32 compute: the masters are the resident weights the
  call computes from), so the kernel runs must show combines and no pack.
- ``training_bf16``: the same model in bf16 (the runtime's compute dtype, the dense layers cast as DeepSpeed's
  bf16 engine casts them): after every optimizer step the resident bf16 weights are refreshed from the fp32 masters
  through the transport's pack, the CUDA kernel. The kernel runs must show packs and combines; their losses must
  follow the torch-ops run on CUDA within 1e-3 (relative: the kernels are bit-equal to their torch contracts; CUDA's
  atomics may reorder a few sums); after the last step every resident row must equal its master cast to bf16 (the
  refresh happened and packed the right rows). The CPU run's difference is reported, not judged (bf16 products on
  two devices round differently).

Dry run: the same code under the GPU stand-in (tests/fake_cupy.py: the kernels check their launches and compute
their contracts, NCCL a loopback), 2 steps.

Internals reached (no public entry point gives a runtime over a chosen transport on a chosen device): the config
parser, ``convert_model``, ``HecateRuntime`` and its step-boundary calls as the engine makes them, the expert
optimizer, ``build_communicator``; for the bf16 check, each layer's ``shard.weight_rows`` and ``shard.masters``.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

from .common import Context, result, test_fixtures

TOLERANCE = 1e-4
#: CUDA runs of one dtype against each other in bf16 (same arithmetic; only atomics' order may differ)
BF16_TOLERANCE = 1e-3
HIDDEN = 64
#: the costs the scheduler plans with: every figure it reads configured, so the placements (and with them the float
#: summation order) never depend on how fast a run happened to be (measured figures are still measured, unused)
FIXED_COSTS = {"compute_s_per_pair": 1e-6, "link_gbps": 1.0, "non_moe_time_s": 0.0, "replica_overhead_s": 0.0}


class Run(NamedTuple):
    """One training run: losses and tokens per expert per step, the device ops' kernel use, and (bf16) the largest
    difference of a resident weight row from its master cast to the compute dtype after the last step."""

    losses: List[float]
    counts: List[List[int]]
    kernel_use: Dict[str, int]
    resident_error: Optional[float] = None


def _communicator(transport: str, device, kernels: str = "auto"):
    """A 1-rank Communicator over ``transport`` ("torch", "cupy", or "cupy-fake": the CuPy transport over the
    1-rank fakes of tests/gpu_fakes.py with the kernels' references, for tests under the bare CUDA stand-in), its
    device work on ``kernels`` (``hecate.device_kernels``)."""
    from ds_hecate.comm.collectives import Communicator
    from ds_hecate.comm.backend import build_communicator
    if transport == "cupy-fake":
        test_fixtures()
        from gpu_fakes import loopback_transport
        return Communicator(None, 0, 1, transport=loopback_transport(device, timeout_s=60))
    return build_communicator(transport, None, 0, 1, device, timeout_s=60, device_kernels=kernels)


def build_model():
    """The demo model, built on the CPU from seed 0 (the same initial weights for every device), with a gate that
    routes deterministically (no draw from any generator)."""
    import torch
    from torch import nn

    import ds_hecate
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
    return nn.ModuleDict({"inp": nn.Linear(HIDDEN, HIDDEN),
                          "moe": ds_hecate.MoE(HIDDEN, expert, num_experts=8, k=2, drop_tokens=False,
                                               use_rts=False, noisy_gate_policy=None,
                                               top2_2nd_expert_sampling=False)})


def hecate_runtime(model, comm, dev, ranks_per_node: int, dtype=None, **hecate) -> tuple:
    """(runtime, dense AdamW) for ``model`` as the engine sets them up: its MoE layers converted onto a Hecate
    runtime over ``comm`` computing in ``dtype`` (default fp32) with :data:`FIXED_COSTS` (``hecate`` overrides
    keys), the model cast to ``dtype`` and moved to ``dev``, the expert optimizer following the dense one's
    learning rate."""
    import torch

    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.deepspeed_glue.expert_optimizer import attach_expert_optimizer
    from ds_hecate.runtime.hecate import HecateRuntime

    cfg = parse_hecate_section({"enabled": True, **FIXED_COSTS, **hecate})
    dtype = torch.float32 if dtype is None else dtype
    rt = HecateRuntime(cfg, comm, dtype, ranks_per_node)
    convert_model(model, rt)
    model.to(dtype).to(dev)   # dtype first: the CUDA stand-in cannot follow `.data =` on its tensors
    dense = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attach_expert_optimizer(rt, torch.optim.AdamW, [dense.param_groups[0]])
    return rt, dense


def resident_error(rt) -> Optional[float]:
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


def demo_losses(device: str, steps: int, transport: str = "torch", kernels: str = "auto",
                dtype_name: str = "fp32") -> Run:
    """The demo model trained ``steps`` steps on 1 rank on ``device`` in ``dtype_name`` (the Hecate runtime and its
    expert optimizer, as the engine drives them)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = build_model()
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    comm = _communicator(transport, dev, kernels)
    rt, dense = hecate_runtime(model, comm, dev, ranks_per_node=1, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    losses, counts = [], []
    for step in range(1, steps + 1):
        rt.on_model_forward()
        x = torch.randn(256, HIDDEN, generator=gen).to(dev).to(dtype)
        y, l_aux, exp_counts = model["moe"](model["inp"](x))
        loss = (y.float() - x.float()).pow(2).mean() + 0.01 * l_aux.float()
        loss.backward()
        rt.flush_reductions()
        dense.step()
        dense.zero_grad()
        rt.apply_step(True, 1, 1.0, 0.0, rt.optimizer.current_hyperparameters())
        rt.after_step(step)
        losses.append(float(loss.detach()))
        counts.append([int(c) for c in exp_counts.reshape(-1).tolist()])
    used = dict(getattr(comm.transport.device_ops, "used", {}))
    return Run(losses, counts, used, resident_error(rt))


def compare(reference: Run, other: Run, tolerance: float = TOLERANCE) -> dict:
    a, b = reference.losses, other.losses
    worst = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)), default=float("inf"))
    differs = next((i + 1 for i, (p, q) in enumerate(zip(reference.counts, other.counts)) if p != q), None)
    return {"losses": b, "max_rel_diff": worst, "first_step_routing_differs": differs,
            "kernel_use": other.kernel_use, "resident_error": other.resident_error, "tolerance": tolerance,
            "ok": worst <= tolerance and len(a) == len(b) > 0}


def _fp32_everywhere() -> None:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


#: the CUDA runs: (name, transport, device_kernels)
CUDA_RUNS = (("cuda_torch", "torch", "auto"), ("cuda_torch_ops", "torch", "torch"), ("cuda_cupy", "cupy", "auto"))


def kernel_use_problems(out: dict, dtype_name: str) -> List[str]:
    """What the runs' kernel use says is wrong: the kernel runs must have run the combine (and in bf16 the pack of
    the resident refresh; in fp32 nothing is packed, the masters are the weights), the torch-ops run no kernel."""
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


def _train(ctx: Context, dtype_name: str) -> dict:
    steps = 2 if ctx.dry_run else (10 if ctx.quick else 20)
    _fp32_everywhere()
    cpu = demo_losses("cpu", steps, dtype_name=dtype_name)
    out: dict = {"steps": steps, "dtype": dtype_name, "cpu_losses": cpu.losses}
    runs: Dict[str, Run] = {}
    for name, transport, kernels in CUDA_RUNS:
        try:
            with ctx.stand_in():
                runs[name] = demo_losses("cuda", steps, transport, kernels, dtype_name)
        except Exception as exc:  # noqa: BLE001 - one run failing must not hide the others' results
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    # fp32: every CUDA run against the CPU; bf16: against the torch-ops run on CUDA (the CPU's difference reported)
    reference = cpu if dtype_name == "fp32" else runs.get("cuda_torch_ops")
    for name, run in runs.items():
        if reference is None:
            out[name] = {"ok": False, "error": "no torch-ops run on CUDA to hold it against", "kernel_use":
                         run.kernel_use, "resident_error": run.resident_error}
        elif dtype_name == "fp32":
            out[name] = compare(cpu, run)
        else:
            out[name] = {**compare(reference, run, BF16_TOLERANCE), "cpu": compare(cpu, run, float("inf"))}
    return out


def _summary(out: dict, problems: List[str]) -> str:
    parts = []
    for name, _, _ in CUDA_RUNS:
        r = out[name]
        if "error" in r:
            parts.append(f"{name}: {r['error'][:120]}")
            continue
        text = f"{name}: max rel diff {r['max_rel_diff']:.1e}"
        if "cpu" in r:
            text += f" (vs CPU {r['cpu']['max_rel_diff']:.1e})"
        if r["first_step_routing_differs"]:
            text += f", routing differs from step {r['first_step_routing_differs']}"
        parts.append(text)
    return "; ".join(problems + parts)


def run(ctx: Context) -> dict:
    """Stage ``training``: fp32 against the CPU."""
    out = _train(ctx, "fp32")
    problems = kernel_use_problems(out, "fp32")
    ok = all(out[name]["ok"] for name, _, _ in CUDA_RUNS) and not problems
    return result(ok, f"{out['steps']} fp32 steps vs CPU (tol {TOLERANCE:g}): " + _summary(out, problems),
                  problems=problems, **out)


def run_bf16(ctx: Context) -> dict:
    """Stage ``training_bf16``: bf16 with the resident refresh through the pack kernel (module docstring)."""
    out = _train(ctx, "bf16")
    problems = kernel_use_problems(out, "bf16")
    for name, _, _ in CUDA_RUNS:
        err = out[name].get("resident_error")
        if "error" not in out[name] and err != 0.0:
            problems.append(f"{name}: resident bf16 rows differ from their masters by {err} after the last step")
    ok = all(out[name]["ok"] for name, _, _ in CUDA_RUNS) and not problems
    summary = (f"{out['steps']} bf16 steps, kernel runs vs CUDA torch ops (tol {BF16_TOLERANCE:g}); resident rows "
               f"{'equal' if not any('resident' in p for p in problems) else 'NOT equal'} to their masters: "
               + _summary(out, problems))
    return result(ok, summary, problems=problems, **out)
