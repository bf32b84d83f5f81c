"""Measured inputs of the scheduler's cost model: link bandwidth, expert compute per token-expert pair, and the
non-MoE compute time that hides a layer's SparseAllGather (T_nonMoE in the paper).

Measured once, at the first optimizer step, on every rank; rank 0's numbers are broadcast so every rank plans with
identical floats (identical plans are what keeps the collectives matched).
"""
from __future__ import annotations

import time
from typing import Dict

import torch
import torch.distributed as dist

PROBE_BYTES_PER_PEER = 1 << 20


def _probe_link_gbps(rt) -> float:
    if rt.world_size == 1:
        return 0.0
    n = PROBE_BYTES_PER_PEER // 4
    send = torch.zeros(n * rt.world_size, dtype=torch.float32)
    splits = [n] * rt.world_size
    rt.comm.all_to_all(send, splits, splits)  # warm-up
    start = time.perf_counter()
    reps = 3
    for _ in range(reps):
        rt.comm.all_to_all(send, splits, splits)
    elapsed = (time.perf_counter() - start) / reps
    return PROBE_BYTES_PER_PEER * (rt.world_size - 1) / max(elapsed, 1e-9) / 1e9


def measure_costs(rt) -> Dict[str, float]:
    pairs = sum(b.pairs_processed for b in rt.bindings)
    compute = sum(b.phase_s["compute"] for b in rt.bindings)
    # Forward compute is timed; backward costs about twice the forward.
    per_pair = 3.0 * compute / pairs if pairs else 0.0
    gaps = [g for b in rt.bindings for g in b.gaps_s]
    non_moe = sum(gaps) / len(gaps) if gaps else 0.0
    link = _probe_link_gbps(rt)
    values = torch.tensor([per_pair, non_moe, link], dtype=torch.float64)
    rt.comm.all_reduce(values, collective="cost measurement all-reduce")
    values /= rt.world_size
    if rt.world_size > 1:
        dist.broadcast(values, src=dist.get_global_rank(rt.comm.group, 0) if rt.comm.group is not None else 0,
                       group=rt.comm.group)
    per_pair, non_moe, link = values.tolist()
    out = {"non_moe_time_s": non_moe}
    if per_pair > 0:
        out["compute_s_per_pair"] = per_pair
    if link > 0:
        out["link_gbps"] = link
    return out
