"""Measured inputs of the scheduler's cost model: link bandwidth, expert compute per token-expert pair, what one
replica costs its holder besides (``replica_overhead_s``), and the non-MoE compute time that hides a layer's
SparseAllGather (T_nonMoE in the paper).

Measured at the first optimizer step, so planning can start, and again at step :data:`WARM_PROFILE_STEP` from the
work of the steps in between: the first step is cold (allocations, first-call kernel set-up) and on a CPU its
compute per pair reads about twice the steady value, which would make the scheduler over-value replicas. Every rank
measures (the link inside its group); the mean over the world is broadcast from rank 0 so every rank of every group
plans with identical floats (identical plans are what keeps the collectives matched). Every figure is device time
(CUDA events on CUDA, see :mod:`ds_hecate.runtime.timing`) and every tensor handed to a collective is on the
communicator's device.

All four figures are taken whatever the config says (``stats()["measured_costs"]`` reports them); where the
``hecate`` section sets one (``compute_s_per_pair``, ``link_gbps``, ``non_moe_time_s``, ``replica_overhead_s``), the
scheduler plans with the configured value (:func:`ds_hecate.planning.cost_model.scheduler_costs`). Placements
therefore depend on how fast a run happened to be unless all four are configured: two runs that must place alike
(the same training on the CPU and on CUDA, say) configure all four.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .timing import DeviceClock

PROBE_BYTES_PER_PEER = 1 << 20
WARM_PROFILE_STEP = 4
#: rows of the replica probe: a replica's share of a call is a small group (2-rank W4: about 40 rows a layer)
REPLICA_PROBE_ROWS = 64
REPLICA_PROBE_REPS = 5


def expert_work(rt) -> Tuple[int, float]:
    """Token-expert pairs processed and forward expert-compute seconds so far, over all layers of this rank."""
    return (sum(b.tally.pairs_processed for b in rt.bindings),
            sum(b.times.device["compute"].total() for b in rt.bindings))


def _probe_link_gbps(rt) -> float:
    if rt.ep_size == 1:
        return 0.0
    n = PROBE_BYTES_PER_PEER // 4
    send = torch.zeros(n * rt.ep_size, dtype=torch.float32, device=rt.comm.device)
    splits = [n] * rt.ep_size
    clock = DeviceClock(rt.comm.device)
    rt.comm.all_to_all(send, splits, splits, collective="link probe")  # warm-up
    start = clock.mark()
    reps = 3
    for _ in range(reps):
        rt.comm.all_to_all(send, splits, splits, collective="link probe")
    elapsed = DeviceClock.seconds(start, clock.mark()) / reps
    return PROBE_BYTES_PER_PEER * (rt.ep_size - 1) / max(elapsed, 1e-9) / 1e9


def _probe_replica_overhead_s(rt) -> float:
    """What one replica costs its holder in a layer call besides its rows' compute and its transfer, on the compute
    device: the first layer's expert kernel, forward and backward, on :data:`REPLICA_PROBE_ROWS` rows split over two
    experts against the same rows held by one (one more weight buffer, kernel and weight gradient), plus two copies
    of one expert (its gathered weights landed in the call's buffer, its gradient handed to the SparseReduceScatter).
    Medians of :data:`REPLICA_PROBE_REPS` after a warm-up. Why measured: the per-pair compute and the link are, and
    without this a replica's fixed cost is priced at nothing (on CPU ranks, replicas that cost a few percent of a
    step are then priced as a gain)."""
    from ..ops.grouped_experts import RowGroups, expert_outputs
    binding = rt.bindings[0]
    kernel, device, dtype = binding.shard.kernel, rt.comm.device, rt.compute_dtype
    gen = torch.Generator(device="cpu").manual_seed(0)   # the probe's values do not matter; its own generator
    rows = (torch.randn(REPLICA_PROBE_ROWS, binding.hidden_size, generator=gen) * 0.1).to(device=device, dtype=dtype)
    weights = (torch.randn(2, kernel.numel, generator=gen) * 0.02).to(device=device, dtype=dtype)
    clock = DeviceClock(device)

    def call(sizes) -> float:
        start = clock.mark()
        buffer = weights[:len(sizes)].clone().requires_grad_(True)
        x = rows.clone().requires_grad_(True)
        out = expert_outputs(kernel, buffer, x, RowGroups.build(sizes, device))
        out.backward(torch.ones_like(out))
        return DeviceClock.seconds(start, clock.mark())

    def copies() -> float:
        start = clock.mark()
        landed = torch.empty_like(weights[0])
        landed.copy_(weights[1])
        sent = torch.empty_like(weights[0])
        sent.copy_(landed)
        return DeviceClock.seconds(start, clock.mark())

    half = REPLICA_PROBE_ROWS // 2
    with torch.enable_grad():
        call([REPLICA_PROBE_ROWS]), call([half, half]), copies()   # warm-up: allocator, first-call set-up
        one = sorted(call([REPLICA_PROBE_ROWS]) for _ in range(REPLICA_PROBE_REPS))
        two = sorted(call([half, half]) for _ in range(REPLICA_PROBE_REPS))
        copy = sorted(copies() for _ in range(REPLICA_PROBE_REPS))
    mid = REPLICA_PROBE_REPS // 2
    return max(0.0, two[mid] - one[mid]) + copy[mid]


def measure_costs(rt, since: Optional[Tuple[int, float]] = None) -> Dict[str, float]:
    """The cost-model inputs; ``since`` (an :func:`expert_work` snapshot) limits the compute figure to the work done
    after it."""
    pairs, compute = expert_work(rt)
    if since is not None:
        pairs, compute = pairs - since[0], compute - since[1]
    # Forward compute is timed; backward costs about twice the forward.
    per_pair = 3.0 * compute / pairs if pairs else 0.0
    gaps = [g for b in rt.bindings for g in b.times.gap.values()]
    non_moe = sum(gaps) / len(gaps) if gaps else 0.0
    link = _probe_link_gbps(rt)
    replica = _probe_replica_overhead_s(rt) if rt.bindings else 0.0
    values = torch.tensor([per_pair, non_moe, link, replica], dtype=torch.float64).to(rt.comm.device)
    world = rt.layout.world   # every group plans with the same figures (re-sharding must agree across groups)
    world.all_reduce(values, collective="cost measurement all-reduce")
    values /= world.world_size
    world.broadcast(values, 0, collective="cost measurement broadcast")
    per_pair, non_moe, link, replica = values.tolist()
    out = {"non_moe_time_s": non_moe, "profiled_at_step": float(rt.global_steps), "replica_overhead_s": replica}
    if per_pair > 0:
        out["compute_s_per_pair"] = per_pair
    if link > 0:
        out["link_gbps"] = link
    return out
