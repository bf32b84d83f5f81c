"""Two ranks in two processes on the N-rank layer path on CUDA (``make gpu-check``'s stage ``two_rank_training``).

Both ranks on the one GPU (``cuda:0``), torch.distributed over gloo with CUDA tensors (gloo stages CUDA collectives
through the host, where NCCL refuses two ranks on one device). Each rank trains two ``ds_hecate.MoE`` layers with
biased experts (same initial weights on every rank, deterministic routing, fp32, no TF32) with the Hecate runtime
over the 2-rank group as the engine builds it: tokens and weights on groups of their own, the one-rank shortcuts off,
experts placed across the ranks, SparseAllGather of the replicas, the token all-to-all, SparseReduceScatter to the
owners; the dense gradients averaged over the group as DeepSpeed's data parallelism does, each rank on batches of its
own. Held against the same 2-rank training on the CPU in the same processes: per rank and step the losses within
1e-4 relative, the final weights too (every expert gathered by ``full_expert_weights``, every dense parameter), and
tokens must have crossed to the other rank. Every cost the scheduler reads is configured and re-sharding is off, so
both runs place alike and sum in the same order. Under the GPU stand-in: the "CUDA" run on the CPU, 3 steps.
"""
from __future__ import annotations

import time
from typing import Any, ContextManager, List

import torch
import torch.distributed as dist

from dist_utils import run_ranks
from gpu_training import TOLERANCE, blocks_loss, build_blocks, fp32_everywhere, hecate_runtime
from gpu_training import step as step_boundary

WORLD = 2
HIDDEN, EXPERTS, TOKENS = 64, 8, 256
#: the configured link: fast against the configured compute per pair, so the scheduler places replicas (whose
#: SparseAllGather and SparseReduceScatter then run) where the routing is uneven
LINK_GBPS = 100.0


def train(rank: int, world: int, device: str, steps: int) -> dict:
    """One rank's run of ``steps`` steps on ``device`` over the process group (see the module docstring)."""
    from ds_hecate.comm.backend import build_communicator

    start = time.perf_counter()
    model: Any = build_blocks("biased", HIDDEN, 4 * HIDDEN, EXPERTS)   # blocks: ModuleDicts
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    # the engine's groups: tokens and weights each on a group of their own (the weights' prefetch on the second)
    comm = build_communicator("torch", dist.new_group(list(range(world))), rank, world, dev, timeout_s=60,
                              weight_group=dist.new_group(list(range(world))), one_rank_shortcuts=False)
    # configured costs (FIXED_COSTS, a fast link so that replicas pay) and no re-sharding: the placements,
    # so the summation order, never depend on how fast each run happened to be
    rt, dense = hecate_runtime(model, comm, dev, ranks_per_node=world, reshard_interval=0, link_gbps=LINK_GBPS)
    gen = torch.Generator().manual_seed(1 + rank)   # each rank its own batches
    losses: List[float] = []
    counts: List[List[int]] = []
    for number in range(1, steps + 1):
        rt.on_model_forward()
        x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dev)
        loss = blocks_loss(model, x)
        loss.backward()
        rt.flush_reductions()
        for p in model.parameters():   # the dense gradients averaged over the ranks, as ZeRO's reduction does
            if p.grad is not None:
                comm.all_reduce(p.grad, collective="dense gradient all-reduce")
                p.grad.div_(world)
        step_boundary(rt, dense, world, number)
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


def _ranks(rank: int, world: int, real: bool, steps: int) -> dict:
    """One rank: the CPU run, then the CUDA run (under the GPU stand-in without a GPU), compared."""
    import contextlib
    import datetime
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    fp32_everywhere()
    if real:
        torch.cuda.set_device(0)   # both ranks on the one GPU
    cpu = train(rank, world, "cpu", steps)
    context: ContextManager[Any] = contextlib.nullcontext()
    if not real:
        from fake_cupy import gpu_stand_in
        context = gpu_stand_in()
    with context:
        cuda = train(rank, world, "cuda", steps)
    return compare(cpu, cuda)


def test_two_ranks_on_cuda_follow_the_two_ranks_on_the_cpu(gpu):
    steps = 20 if gpu.real else 3
    for rank, figures in enumerate(run_ranks(WORLD, _ranks, gpu.real, steps, timeout=300)):
        assert figures["ok"], (rank, {k: v for k, v in figures.items() if "weights" not in k})
        assert figures["first_step_routing_differs"] is None and figures["weights_compared"] >= 4
        assert figures["comm"]["calls"]["alltoall"] > 0


def test_compare_fails_a_differing_run():
    run = {"losses": [1.0, 0.5], "counts": [[3, 1], [2, 2]], "weights": {"w": torch.ones(4)}, "seconds": 1.0,
           "owned": [[0]], "kernel_use": {}, "comm": {"bytes_dispatch": 10, "bytes_allgather": 0}}
    assert compare(run, run)["ok"]
    assert not compare(run, {**run, "comm": {"bytes_dispatch": 0, "bytes_allgather": 0}})["ok"]
    assert not compare(run, {**run, "losses": [1.0, 0.5001]})["ok"]
    assert not compare(run, {**run, "weights": {"w": torch.tensor([1.0, 1.0, 1.0, 1.001])}})["ok"]
    assert not compare(run, {**run, "weights": {}})["ok"]
    assert compare(run, {**run, "counts": [[3, 1], [1, 3]]})["first_step_routing_differs"] == 2
