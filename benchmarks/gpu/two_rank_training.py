"""Stage ``two_rank_training``: the first multi-process CUDA run, on the N-rank layer path. Two processes, two ranks
on the one GPU (``cuda:0`` for both), torch.distributed over gloo with CUDA tensors: gloo stages CUDA collectives
through the host, where NCCL refuses two ranks on one device. Each rank trains a model of two ``ds_hecate.MoE``
layers with biased experts (:func:`benchmarks.gpu.syncs.build_model`: same initial weights on every rank,
deterministic routing, fp32, no TF32) for 20 steps with the Hecate runtime over the 2-rank group as the engine
builds it: tokens and weights on groups of their own (the next layer's weights prefetched over the second), the
one-rank shortcuts off (moot on two ranks: every collective goes through the groups), experts placed across the
ranks, SparseAllGather of the replicas, the token all-to-all, SparseReduceScatter to the owners; the dense
gradients averaged over the group as DeepSpeed's data parallelism does, each rank on batches of its own.

The CPU run it is held against is the same 2-rank training on the CPU, in the same two processes, over the same
gloo groups, before the CUDA run: per rank and step the losses must agree within the ``training`` stage's
tolerance (1e-4 relative), and so must the final weights (every expert, gathered by ``full_expert_weights``, and
every dense parameter: largest difference over the largest magnitude); and the CUDA run must have sent tokens to
the other rank (the runtime's ``stats()["comm"]``: else the N-rank path was not exercised). Reported per rank: the
largest relative loss difference, the per-step differences, the final weights' difference, the first step whose
routing (tokens per expert) differs, the bytes each kind of traffic moved, each run's wall time and the CUDA
kernels' use.

The placements do not depend on timing: every cost the scheduler reads is configured (``training.FIXED_COSTS``:
compute per pair, link, T_nonMoE and the replica overhead; the runtime still measures them at steps 1 and 4, and
configured figures win) and re-sharding is off, so both runs place alike and sum in the same order.

A hang fails fast: gloo's own timeout on every collective, and the stage stops waiting for the ranks (and kills
them) before its own limit, saying how many answered.

Dry run: the "CUDA" run under the GPU stand-in (tests/fake_cupy.py), both ranks on the CPU, 3 steps.
"""
from __future__ import annotations

import datetime
import time
from typing import Any, Dict, List, cast

from .common import Context, result, spawn_ranks
from .syncs import build_model, forward
from .training import TOLERANCE, hecate_runtime

WORLD = 2
HIDDEN, EXPERTS, TOKENS = 64, 8, 256
#: the configured link: fast against the configured compute per pair, so the scheduler places replicas (whose
#: SparseAllGather and SparseReduceScatter then run) where the routing is uneven
LINK_GBPS = 100.0


def train(rank: int, world: int, device: str, steps: int) -> dict:
    """One rank's run of ``steps`` steps on ``device`` over the process group (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from ds_hecate.comm.backend import build_communicator

    start = time.perf_counter()
    model = build_model("biased", HIDDEN, 4 * HIDDEN, EXPERTS)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    # the engine's groups: tokens and weights each on a group of their own (the weights' prefetch on the second)
    comm = build_communicator("torch", dist.new_group(list(range(world))), rank, world, dev, timeout_s=60,
                              weight_group=dist.new_group(list(range(world))), one_rank_shortcuts=False)
    # configured costs (training.FIXED_COSTS, a fast link so that replicas pay) and no re-sharding: the placements,
    # so the summation order, never depend on how fast each run happened to be
    rt, dense = hecate_runtime(model, comm, dev, ranks_per_node=world, reshard_interval=0, link_gbps=LINK_GBPS)
    gen = torch.Generator().manual_seed(1 + rank)   # each rank its own batches
    losses: List[float] = []
    counts: List[List[int]] = []
    for step in range(1, steps + 1):
        rt.on_model_forward()
        x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dev)
        loss = forward(model, x)
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
        counts.append([int(c) for b in model.values() for c in b["moe"].exp_counts.reshape(-1).tolist()])
    weights = {f"expert {k}": v.detach().cpu().clone() for k, v in rt.full_expert_weights().items()}
    weights.update({f"dense {k}": p.detach().cpu().clone() for k, p in model.named_parameters()})
    stats = rt.stats()
    return {"losses": losses, "counts": counts, "weights": weights, "seconds": time.perf_counter() - start,
            "owned": [list(b.shard.owned) for b in rt.bindings], "comm": stats["comm"],
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
    sent_tokens = cuda["comm"]["bytes_dispatch"] > 0
    ok = (len(cpu["losses"]) == len(cuda["losses"]) > 0 and same_names and worst <= TOLERANCE
          and worst_weight <= TOLERANCE and sent_tokens)
    return {"ok": ok, "sent_tokens": sent_tokens, "comm": cuda["comm"], "max_rel_diff": worst,
            "rel_diff_per_step": per_step, "weights_max_rel_diff": worst_weight,
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
                     + f", sent {fig['comm']['bytes_dispatch']:,} B of tokens, "
                       f"{fig['comm']['bytes_allgather']:,} B of replicas"
                     + f" (CPU {fig['cpu_seconds']:.1f} s, CUDA {fig['cuda_seconds']:.1f} s)")
    head = f"2 ranks on 1 device over gloo, N-rank path, {steps} steps vs the 2-rank CPU run (tol {TOLERANCE:g}): "
    return head + "; ".join(parts)


def run(ctx: Context) -> dict:
    steps = 3 if ctx.dry_run else (10 if ctx.quick else 20)
    limit = ctx.left_s(margin=6.0) or 120.0
    start = time.perf_counter()
    answers = spawn_ranks(_worker, WORLD, (steps, ctx.dry_run, limit - 5.0), limit)
    out: Dict[str, Any] = {"steps": steps, "tolerance": TOLERANCE, "world": WORLD, "backend": "gloo",
           "device": "cpu (GPU stand-in, dry run)" if ctx.dry_run else "cuda:0 (both ranks)",
           "wall_s": time.perf_counter() - start}
    bad = [f"rank {r}: {p}" for r, (ok, p) in sorted(answers.items()) if not ok]
    if len(answers) < WORLD or bad:
        why = "; ".join(bad) if bad else f"{len(answers)}/{WORLD} ranks answered within {limit:.0f} s (killed)"
        return result(False, why, **out)
    ranks = {r: cast(dict, p) for r, (_, p) in answers.items()}
    out["ranks"] = {str(r): fig for r, fig in sorted(ranks.items())}
    out["max_rel_diff"] = max(f["max_rel_diff"] for f in ranks.values())
    out["weights_max_rel_diff"] = max(f["weights_max_rel_diff"] for f in ranks.values())
    out["max_rel_diff_per_step"] = [max(v) for v in zip(*(f["rel_diff_per_step"] for f in ranks.values()))]
    ok = all(f["ok"] for f in ranks.values())
    return result(ok, _summary(steps, ranks), **out)
