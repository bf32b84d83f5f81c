"""Measured inputs of the scheduler's cost model: link bandwidth, expert compute per token-expert pair, and the
non-MoE compute time that hides a layer's SparseAllGather (T_nonMoE in the paper).

Measured at the first optimizer step, so planning can start, and again at step :data:`WARM_PROFILE_STEP` from the
work of the steps in between: the first step is cold (allocations, first-call kernel set-up) and on a CPU its
compute per pair reads about twice the steady value, which would make the scheduler over-value replicas. Every rank
measures (the link inside its group); the mean over the world is broadcast from rank 0 so every rank of every group
plans with identical floats (identical plans are what keeps the collectives matched). Every figure is device time (CUDA events on CUDA, see :mod:`ds_hecate.runtime.timing`) and
every tensor handed to a collective is on the communicator's device.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .timing import DeviceClock

PROBE_BYTES_PER_PEER = 1 << 20
WARM_PROFILE_STEP = 4


def expert_work(rt) -> Tuple[int, float]:
    """Token-expert pairs processed and forward expert-compute seconds so far, over all layers of this rank."""
    return (sum(b.pairs_processed for b in rt.bindings), sum(b.device_time["compute"].total() for b in rt.bindings))


def _probe_link_gbps(rt) -> float:
    if rt.world_size == 1:
        return 0.0
    n = PROBE_BYTES_PER_PEER // 4
    send = torch.zeros(n * rt.world_size, dtype=torch.float32, device=rt.comm.device)
    splits = [n] * rt.world_size
    clock = DeviceClock(rt.comm.device)
    rt.comm.all_to_all(send, splits, splits, collective="link probe")  # warm-up
    start = clock.mark()
    reps = 3
    for _ in range(reps):
        rt.comm.all_to_all(send, splits, splits, collective="link probe")
    elapsed = DeviceClock.seconds(start, clock.mark()) / reps
    return PROBE_BYTES_PER_PEER * (rt.world_size - 1) / max(elapsed, 1e-9) / 1e9


def measure_costs(rt, since: Optional[Tuple[int, float]] = None) -> Dict[str, float]:
    """The cost-model inputs; ``since`` (an :func:`expert_work` snapshot) limits the compute figure to the work done
    after it."""
    pairs, compute = expert_work(rt)
    if since is not None:
        pairs, compute = pairs - since[0], compute - since[1]
    # Forward compute is timed; backward costs about twice the forward.
    per_pair = 3.0 * compute / pairs if pairs else 0.0
    gaps = [g for b in rt.bindings for g in b.gap_time.values()]
    non_moe = sum(gaps) / len(gaps) if gaps else 0.0
    link = _probe_link_gbps(rt)
    values = torch.tensor([per_pair, non_moe, link], dtype=torch.float64).to(rt.comm.device)
    world = rt.layout.world   # every group plans with the same figures (re-sharding must agree across groups)
    world.all_reduce(values, collective="cost measurement all-reduce")
    values /= world.world_size
    world.broadcast(values, 0, collective="cost measurement broadcast")
    per_pair, non_moe, link = values.tolist()
    out = {"non_moe_time_s": non_moe, "profiled_at_step": float(rt.global_steps)}
    if per_pair > 0:
        out["compute_s_per_pair"] = per_pair
    if link > 0:
        out["link_gbps"] = link
    return out
