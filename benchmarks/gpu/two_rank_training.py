"""Stage ``two_rank_training``: the first multi-process CUDA run. Two processes, two ranks on the one GPU
(``cuda:0`` for both), torch.distributed over gloo with CUDA tensors: gloo stages CUDA collectives through the
host, where NCCL refuses two ranks on one device. Each rank trains the ``training`` stage's model
(:func:`benchmarks.gpu.training.build_model`: same initial weights, deterministic routing, fp32, no TF32) for 20
steps with the Hecate runtime over the 2-rank group (experts placed across the ranks, SparseAllGather, token
all-to-all, SparseReduceScatter), the dense gradients averaged over the group as DeepSpeed's data parallelism
does, each rank on batches of its own.

The CPU run it is held against is the same 2-rank training on the CPU, in the same two processes, over the same
gloo group, before the CUDA run: per rank and step the losses must agree within the ``training`` stage's tolerance
(1e-4 relative), and so must the final weights (every expert, gathered by ``full_expert_weights``, and every dense
parameter: largest difference over the largest magnitude). Reported per rank: the largest relative loss
difference, the per-step differences, the final weights' difference, the first step whose routing (tokens per
expert) differs, each run's wall time and the CUDA kernels' use.

A hang fails fast: gloo's own timeout on every collective, and the stage stops waiting for the ranks (and kills
them) before its own limit, saying how many answered.

Dry run: the "CUDA" run under the CUDA stand-in (tests/device_shim.py), both ranks on the CPU, 3 steps.
"""
from __future__ import annotations

import datetime
import time
from typing import Dict, List

from .common import Context, result, spawn_ranks
from .training import TOLERANCE, build_model, hecate_runtime

WORLD = 2


def train(rank: int, world: int, device: str, steps: int) -> dict:
    """One rank's run of ``steps`` steps on ``device`` over the process group (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from ds_hecate.comm.backend import build_communicator

    start = time.perf_counter()
    model = build_model()
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    comm = build_communicator("torch", dist.group.WORLD, rank, world, dev, timeout_s=60)
    # configured costs (every one the scheduler reads: training.FIXED_COSTS) and no re-sharding: the placements (so
    # the summation order) must not hang on how fast each run happened to be
    rt, dense = hecate_runtime(model, comm, dev, ranks_per_node=world, reshard_interval=0)
    gen = torch.Generator().manual_seed(1 + rank)   # each rank its own batches
    losses: List[float] = []
    counts: List[List[int]] = []
    for step in range(1, steps + 1):
        rt.on_model_forward()
        x = torch.randn(256, model["inp"].in_features, generator=gen).to(dev)
        y, l_aux, exp_counts = model["moe"](model["inp"](x))
        loss = (y - x).pow(2).mean() + 0.01 * l_aux
        loss.backward()
        rt.flush_reductions()
        for p in model.parameters():   # the dense gradients averaged over the ranks, as ZeRO's reduction does
            if p.grad is not None:
                comm.all_reduce(p.grad, collective="dense gradient all-reduce")
                p.grad.div_(world)
        dense.step()
        dense.zero_grad()
        rt.apply_step(True, world, 1.0, 0.0, rt.optimizer.current_hyperparameters())
        rt.after_step(step)
        losses.append(float(loss.detach()))
        counts.append([int(c) for c in exp_counts.reshape(-1).tolist()])
    weights = {f"expert {k}": v.detach().cpu().clone() for k, v in rt.full_expert_weights().items()}
    weights.update({f"dense {k}": p.detach().cpu().clone() for k, p in model.named_parameters()
                    })
    return {"losses": losses, "counts": counts, "weights": weights, "seconds": time.perf_counter() - start,
            "owned": list(rt.bindings[0].shard.owned),
            "kernel_use": dict(getattr(comm.transport.device_ops, "used", {}))}


def compare(cpu: dict, cuda: dict) -> dict:
    """The CUDA run against the CPU run of the same rank: losses per step, final weights, routing."""
    def rel(a, b):
        return float((a - b).abs().max() / a.abs().max().clamp(min=1e-12)) if a.numel() else 0.0

    per_step = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(cpu["losses"], cuda["losses"])]
    same_names = sorted(cpu["weights"]) == sorted(cuda["weights"])
    weights = {k: rel(cpu["weights"][k], cuda["weights"][k].reshape(cpu["weights"][k].shape))
               for k in cpu["weights"] if k in cuda["weights"]}
    worst_weight = max(weights.values(), default=float("inf"))
    worst = max(per_step, default=float("inf"))
    differs = next((i + 1 for i, (p, q) in enumerate(zip(cpu["counts"], cuda["counts"])) if p != q), None)
    ok = (len(cpu["losses"]) == len(cuda["losses"]) > 0 and same_names and worst <= TOLERANCE
          and worst_weight <= TOLERANCE)
    return {"ok": ok, "max_rel_diff": worst, "rel_diff_per_step": per_step, "weights_max_rel_diff": worst_weight,
            "weights_compared": len(weights), "same_weight_names": same_names,
            "first_step_routing_differs": differs, "cpu_losses": cpu["losses"], "cuda_losses": cuda["losses"],
            "cpu_seconds": cpu["seconds"], "cuda_seconds": cuda["seconds"], "owned": cuda["owned"],
            "kernel_use": cuda["kernel_use"]}


def _worker(rank: int, world: int, store: str, steps: int, dry_run: bool, timeout_s: float, q) -> None:
    """One rank: the gloo group, the CPU run, then the CUDA run (under the stand-in in a dry run), compared."""
    try:
        import torch
        import torch.distributed as dist
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(5.0, timeout_s)))
        if not dry_run:
            torch.cuda.set_device(0)   # both ranks on the one GPU
        cpu = train(rank, world, "cpu", steps)
        with Context(dry_run=dry_run).stand_in():
            cuda = train(rank, world, "cuda", steps)
        q.put((rank, True, compare(cpu, cuda)))
    except BaseException as exc:  # noqa: BLE001 - report, never hang
        q.put((rank, False, f"{type(exc).__name__}: {str(exc)[:300]}"))


def _summary(steps: int, ranks: Dict[int, dict]) -> str:
    parts = []
    for r, fig in sorted(ranks.items()):
        parts.append(f"rank {r}: loss max rel diff {fig['max_rel_diff']:.1e}, weights {fig['weights_max_rel_diff']:.1e}"
                     + (f", routing differs from step {fig['first_step_routing_differs']}"
                        if fig["first_step_routing_differs"] else "")
                     + f" (CPU {fig['cpu_seconds']:.1f} s, CUDA {fig['cuda_seconds']:.1f} s)")
    head = f"2 ranks on 1 device over gloo, {steps} steps vs the 2-rank CPU run (tol {TOLERANCE:g}): "
    return head + "; ".join(parts)


def run(ctx: Context) -> dict:
    steps = 3 if ctx.dry_run else (10 if ctx.quick else 20)
    limit = ctx.left_s(margin=6.0) or 120.0
    start = time.perf_counter()
    answers = spawn_ranks(_worker, WORLD, (steps, ctx.dry_run, limit - 5.0), limit)
    out = {"steps": steps, "tolerance": TOLERANCE, "world": WORLD, "backend": "gloo",
           "device": "cpu (CUDA stand-in, dry run)" if ctx.dry_run else "cuda:0 (both ranks)",
           "wall_s": time.perf_counter() - start}
    bad = [f"rank {r}: {p}" for r, (ok, p) in sorted(answers.items()) if not ok]
    if len(answers) < WORLD or bad:
        why = "; ".join(bad) if bad else f"{len(answers)}/{WORLD} ranks answered within {limit:.0f} s (killed)"
        return result(False, why, **out)
    ranks = {r: p for r, (_, p) in answers.items()}
    out["ranks"] = {str(r): fig for r, fig in sorted(ranks.items())}
    out["max_rel_diff"] = max(f["max_rel_diff"] for f in ranks.values())
    out["weights_max_rel_diff"] = max(f["weights_max_rel_diff"] for f in ranks.values())
    out["max_rel_diff_per_step"] = [max(v) for v in zip(*(f["rel_diff_per_step"] for f in ranks.values()))]
    ok = all(f["ok"] for f in ranks.values())
    return result(ok, _summary(steps, ranks), **out)
