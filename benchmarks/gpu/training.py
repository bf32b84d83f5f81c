"""Stage ``training``: a small ds_hecate.MoE model trained on 1 rank on the CPU and on CUDA, fp32, from the same
initial weights on the same batches; the losses must agree within 1e-4 (relative) at every step.

Routing is deterministic, so the two devices route alike: DeepSpeed's top-2 gate samples its second expert with
Gumbel noise from the device's generator by default (``top2_2nd_expert_sampling``), which CPU and CUDA draw
differently, so it is switched off, as are RSample/Jitter (``noisy_gate_policy=None``) and random token selection.
TF32 is off (fp32 products on both). CUDA runs three times: over the CuPy transport, whose device ops (the pack of
the owned experts, the weighted un-permute) are the CUDA kernels, and over the torch transport twice: with the
kernels as its device work (``device_kernels: auto``, the default, which must run them on a GPU) and with torch ops
alone. The per-step token counts per expert are compared too: the first step whose routing differs is named.

Dry run: the CPU against the CUDA stand-in (torch transport, and the CuPy transport over the 1-rank fakes with the
kernels' torch references), 2 steps.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

from .common import Context, result

TOLERANCE = 1e-4


def _communicator(transport: str, device, kernels: str = "auto"):
    """A 1-rank Communicator over ``transport`` ("torch", "cupy", or "cupy-fake": the CuPy transport over fakes),
    its device work on ``kernels`` (``hecate.device_kernels``)."""
    from ds_hecate.comm.collectives import Communicator
    from ds_hecate.comm.backend import build_communicator
    if transport == "cupy-fake":
        from .fakes import loopback_transport
        return Communicator(None, 0, 1, transport=loopback_transport(device, timeout_s=60))
    return build_communicator(transport, None, 0, 1, device, timeout_s=60, device_kernels=kernels)


HIDDEN = 64


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


def hecate_runtime(model, comm, dev, ranks_per_node: int, **hecate) -> tuple:
    """(runtime, dense AdamW) for ``model`` as the engine sets them up: its MoE layer converted onto a Hecate runtime
    over ``comm`` (configured costs: the placements must not hang on how fast a run happened to be; ``hecate``
    overrides keys), the model moved to ``dev``, the expert optimizer following the dense one's learning rate."""
    import torch

    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.deepspeed_glue.expert_optimizer import attach_expert_optimizer
    from ds_hecate.runtime.hecate import HecateRuntime

    cfg = parse_hecate_section({"enabled": True, "compute_s_per_pair": 1e-6, "link_gbps": 1.0, "non_moe_time_s": 0.0,
                                **hecate})
    rt = HecateRuntime(cfg, comm, torch.float32, ranks_per_node)
    convert_model(model, rt)
    model.to(dev)
    dense = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attach_expert_optimizer(rt, torch.optim.AdamW, [dense.param_groups[0]])
    return rt, dense


def demo_losses(device: str, steps: int, transport: str = "torch",
                kernels: str = "auto") -> Tuple[List[float], List[List[int]], dict]:
    """(losses, tokens per expert per step, the transport's kernel use) of the demo model trained ``steps`` steps
    on 1 rank on ``device`` (the Hecate runtime and its expert optimizer, as the engine drives them)."""
    import torch

    model = build_model()
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    comm = _communicator(transport, dev, kernels)
    rt, dense = hecate_runtime(model, comm, dev, ranks_per_node=1)
    gen = torch.Generator().manual_seed(1)
    losses, counts = [], []
    for step in range(1, steps + 1):
        rt.on_model_forward()
        x = torch.randn(256, HIDDEN, generator=gen).to(dev)
        y, l_aux, exp_counts = model["moe"](model["inp"](x))
        loss = (y - x).pow(2).mean() + 0.01 * l_aux
        loss.backward()
        rt.flush_reductions()
        dense.step()
        dense.zero_grad()
        rt.apply_step(True, 1, 1.0, 0.0, rt.optimizer.current_hyperparameters())
        rt.after_step(step)
        losses.append(float(loss.detach()))
        counts.append([int(c) for c in exp_counts.reshape(-1).tolist()])
    used = dict(getattr(comm.transport.device_ops, "used", {}))
    return losses, counts, used


def compare(reference: Tuple[List[float], List[List[int]], dict],
            other: Tuple[List[float], List[List[int]], dict]) -> dict:
    (a, ca, _), (b, cb, used) = reference, other
    worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
    differs = next((i + 1 for i, (p, q) in enumerate(zip(ca, cb)) if p != q), None)
    return {"losses": b, "max_rel_diff": worst, "first_step_routing_differs": differs, "kernel_use": used,
            "ok": worst <= TOLERANCE and len(a) == len(b)}


def _fp32_everywhere() -> None:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def run(ctx: Context) -> dict:
    steps = 2 if ctx.dry_run else (10 if ctx.quick else 20)
    _fp32_everywhere()
    cpu = demo_losses("cpu", steps)
    # torch.distributed with the CUDA kernels (device_kernels auto: the default on CUDA), with torch ops alone, and
    # the CuPy transport (its NCCL and the kernels)
    runs: List[Tuple[str, Callable]] = [("cuda_torch", lambda: demo_losses("cuda", steps, "torch")),
                                        ("cuda_torch_ops", lambda: demo_losses("cuda", steps, "torch", "torch"))]
    runs.append(("cuda_cupy", lambda: demo_losses("cuda", steps, "cupy-fake" if ctx.dry_run else "cupy")))
    out = {"steps": steps, "tolerance": TOLERANCE, "cpu_losses": cpu[0]}
    for name, fn in runs:
        try:
            with ctx.stand_in():
                out[name] = compare(cpu, fn())
        except Exception as exc:  # noqa: BLE001 - one transport failing must not hide the other's result
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    ok = all(out[name]["ok"] for name, _ in runs)
    if not ctx.dry_run:   # on a GPU the default must have run the kernels, and torch ops alone none
        kernels_used = out["cuda_torch"].get("kernel_use", {})
        out["cuda_torch_ran_kernels"] = kernels_used.get("pack", 0) > 0 and kernels_used.get("combine", 0) > 0
        ok = ok and out["cuda_torch_ran_kernels"] and not out["cuda_torch_ops"].get("kernel_use")
    parts = []
    for name, _ in runs:
        r = out[name]
        parts.append(f"{name}: " + (r["error"][:120] if "error" in r else
                                    f"max rel diff {r['max_rel_diff']:.1e}"
                                    + (f", routing differs from step {r['first_step_routing_differs']}"
                                       if r["first_step_routing_differs"] else "")))
    return result(ok, f"{steps} steps vs CPU (tol {TOLERANCE:g}): " + "; ".join(parts), **out)
