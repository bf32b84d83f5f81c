"""The simulator's machine: link and compute time of one MoE layer call under a placement.

Time of one MoE layer (forward + backward), with ``x_r`` per rank and ``max`` over ranks because every all-to-all
is a collective:

    max exposed gather (forward)  +  4 x max all-to-all pass  +  max expert compute  +  max exposed reduce (backward)

The dispatch of the step's counts is the planner's own rule (:func:`~ds_hecate.planning.dispatch.dispatch_flows`);
only the time each transfer and each pair takes is modelled here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..planning.cost_model import BACKWARD_FACTOR, imbalance, replica_transfers
from ..planning.dispatch import dispatch_flows
from ..planning.fanout import chunk_bounds
from ..planning.plan import IntVector, holders_matrix, owned_experts
from .context import SimContext


def link_time(ctx: SimContext, world: int, intra_in, intra_out, node_in, node_out, nbytes: float):
    """Per-rank time of one communication phase moving the given per-rank units of ``nbytes``."""
    rpn = ctx.rpn
    node_idx = np.arange(world) // rpn
    c = ctx.cluster
    t_intra = np.maximum(intra_in, intra_out) * nbytes / (c.intra_node_gbps * 1e9)
    t_inter = (np.maximum(node_in, node_out) * nbytes / (c.inter_node_gbps * 1e9))[node_idx]
    busy = (np.maximum(intra_in, intra_out) + np.maximum(node_in, node_out)[node_idx]) > 0
    latency = c.inter_latency_s if world > rpn else c.intra_latency_s
    return np.maximum(t_intra, t_inter) + np.where(busy, latency, 0.0)


def node_sum(values, world: int, rpn: int):
    return np.add.reduceat(values, np.arange(0, world, rpn))


@dataclass
class LayerTime:
    total: float
    compute: float
    a2a: float
    exposed: float
    imbalance: float
    replicas: np.ndarray                # per rank
    processed: Optional[np.ndarray] = None   # token-expert pairs computed per rank (the call overhead's rows)


def layer_time(ctx: SimContext, counts: np.ndarray, mat: np.ndarray, owners: np.ndarray, mode: str,
               late: Optional[np.ndarray] = None) -> LayerTime:
    """Time of one layer call: ``counts`` [world, experts] routed over placement ``mat`` [world, experts] (bool)
    with sharded placement ``owners``. ``mode`` says how replicas travel: ``prefetch`` (Hecate: SparseAllGather
    before the gate, hidden behind T_nonMoE; SparseReduceScatter behind the backward non-MoE compute), ``rm``
    (the same plus a second gather in backward; both relay copies through holders beyond ``hecate.fanout``
    replicas of an expert, as the runtime does, every level issued with the collective on a GPU cluster),
    ``critical`` (FasterMoE: broadcast after the gate and reduce, both exposed), ``persistent`` (FlexMoE: replicas
    stay; their gradients are all-reduced in backward). ``late``: replicas (a subset of ``mat``) gathered after the
    gate (Hecate's calibration), on the critical path."""
    world, num_experts = counts.shape
    rpn = min(ctx.rpn, world)
    flows = dispatch_flows(counts.T, mat.T, rpn)
    processed = flows.processed.sum(axis=0)
    sent, recv = flows.sent.sum(axis=0), flows.received.sum(axis=0)
    s_inter, r_inter = flows.sent_inter.sum(axis=0), flows.received_inter.sum(axis=0)
    compute = processed * ctx.s_per_pair
    a2a_pass = link_time(ctx, world, recv - r_inter, sent - s_inter, node_sum(r_inter, world, rpn),
                      node_sum(s_inter, world, rpn), ctx.row_bytes)
    owner_mask = np.zeros_like(mat)
    owner_mask[owners, np.arange(num_experts)] = True
    replicas = mat & ~owner_mask
    fanout = ctx.hecate.fanout if mode in ("prefetch", "rm") else 0

    def phase(rep: np.ndarray, nbytes: int) -> Tuple[np.ndarray, np.ndarray]:
        return _replica_phase(ctx, rep, mat, owners, rpn, fanout, nbytes)

    early = replicas if late is None else replicas & ~late
    gather, gather_rest = phase(early, ctx.numel * ctx.compute_b)
    reduce, reduce_rest = phase(replicas, ctx.numel * ctx.grad_b)
    late_gather = sum(phase(late & replicas, ctx.numel * ctx.compute_b)) if late is not None else np.zeros(world)
    if mode == "broadcast":
        gather, reduce = _broadcast_times(ctx, replicas, rpn)
    hide = ctx.cluster.overlaps_compute
    t_f, t_b = (ctx.t_fwd, BACKWARD_FACTOR * ctx.t_fwd) if hide else (0.0, 0.0)
    if mode in ("critical", "broadcast"):
        exp_f, exp_b = gather, reduce
    elif mode == "persistent":
        exp_f, exp_b = np.zeros(world), np.maximum(0.0, 2 * reduce - t_b)
    elif mode == "rm":
        regather, regather_rest = ((gather, gather_rest) if late is None
                                   else phase(replicas, ctx.numel * ctx.compute_b))
        exp_f = np.maximum(0.0, gather - t_f) + gather_rest
        exp_b = np.maximum(0.0, reduce + regather - t_b) + reduce_rest + regather_rest
    elif mode == "prefetch":
        exp_f = np.maximum(0.0, gather - t_f) + gather_rest
        exp_b = np.maximum(0.0, reduce - t_b) + reduce_rest
    else:
        raise ValueError(f"layer_time: unknown mode {mode!r}")
    exp_f = exp_f + late_gather
    c_max, a_max = float(compute.max()), 4 * float(a2a_pass.max())
    exposed = float(exp_f.max()) + float(exp_b.max())
    return LayerTime(c_max + a_max + exposed, c_max, a_max, exposed,
                     float(imbalance(processed)), replicas.sum(axis=1), processed)


def _replica_phase(ctx: SimContext, rep: np.ndarray, mat: np.ndarray, owners: np.ndarray, rpn: int, fanout: int,
                   nbytes: int) -> Tuple[np.ndarray, np.ndarray]:
    """One expert collective of :func:`layer_time` moving the replicas ``rep`` ([world, experts] bool) of ``nbytes``
    each: (its first exchange, issued with it; the rest, run when it is waited for) per rank."""
    world = rep.shape[0]
    if ctx.spag == "ring":
        # what-if: each replicated expert travels as a pipelined ring broadcast (reduce) over its holders:
        # every holder receives and forwards it once; the ring enters and leaves each node holding it once
        moved = rep.any(axis=0)
        hold = mat[:, moved]
        on_node = np.add.reduceat(hold.astype(float), np.arange(0, world, rpn), axis=0) > 0
        crossing = (on_node & (on_node.sum(axis=0) > 1)).sum(axis=1).astype(float)
        return link_time(ctx, world, rep.sum(axis=1).astype(float), hold.sum(axis=1).astype(float), crossing,
                         crossing, nbytes), np.zeros(world)
    # Hecate's sparse collectives relay through holders beyond hecate.fanout copies (planning.fanout),
    # pipelined in relay_chunks pieces past the first level (one latency per exchange). On a GPU cluster the
    # runtime issues every level with the collective (stream-ordered, comm/relay.py): all of it may hide
    # behind compute; elsewhere (gloo) the levels below the first run at its wait. The baselines' owners send
    # every copy
    chunks = len(chunk_bounds(ctx.numel, ctx.hecate.relay_chunks))   # as comm/relay.py cuts the rows
    stream_ordered = ctx.cluster.overlaps_compute
    first, later, depth = replica_transfers(rep, owners, rpn, fanout, chunks, True, stream_ordered)
    start = link_time(ctx, world, first[0], first[1], node_sum(first[2], world, rpn),
                      node_sum(first[3], world, rpn), nbytes)
    latency = ctx.cluster.inter_latency_s if world > rpn else ctx.cluster.intra_latency_s
    fill_latency = (depth - 2 + chunks - 1) * latency if depth >= 2 else 0.0
    if stream_ordered:
        return start + fill_latency, np.zeros(world)
    if not any(part.any() for part in later):
        return start, np.zeros(world)
    rest = link_time(ctx, world, later[0], later[1], node_sum(later[2], world, rpn),
                     node_sum(later[3], world, rpn), nbytes)
    return start, rest + fill_latency


def _broadcast_times(ctx: SimContext, replicas: np.ndarray, rpn: int) -> Tuple[np.ndarray, np.ndarray]:
    """(gather, reduce) per rank of NCCL ring broadcasts / reductions of each shadowed expert: every rank receives
    and forwards it once, and the ring crosses each node boundary once."""
    world = replicas.shape[0]
    shadowed = float((replicas.sum(axis=0) > 0).sum())
    ones = np.full(world, shadowed)
    per_node = np.full(-(-world // rpn), shadowed if world > rpn else 0.0)
    return (link_time(ctx, world, ones, ones, per_node, per_node, ctx.numel * ctx.compute_b),
            link_time(ctx, world, ones, ones, per_node, per_node, ctx.numel * ctx.grad_b))


def edp_reduction_time(ctx: SimContext, grad_bytes: float, weight_bytes: float) -> float:
    """Seconds, exposed, of one layer's expert-gradient reduction over the expert-data-parallel peers at the
    accumulation boundary: ``grad_bytes`` of gradients and ``weight_bytes`` of weights per rank (what the rank owns).

    ZeRO stage >= 1: a ring reduce-scatter of the gradients, then a ring all-gather of the updated weights after each
    peer stepped its ``1/R``; stage 0: a ring all-reduce of the gradients (every peer steps the whole expert). Each
    ring phase moves ``(R-1)/R`` of the bytes through every member in ``R-1`` hops (one latency each). The rings run
    over ranks ``r mod G`` ascending: with groups of whole nodes every hop crosses nodes and all ``rpn`` rings of a
    node share its NICs; with groups smaller than a node, ``rpn/G`` members of a ring share a node, and the ring leaves
    and enters each node once, so the ``G`` rings of a node load its NICs with one member's bytes each, the other hops
    staying on the node's links. A whole job on one node stays on the node's links."""
    peers = ctx.edp_size
    if peers == 1 or grad_bytes <= 0:
        return 0.0
    second = weight_bytes if ctx.zero_stage >= 1 else grad_bytes
    moved = (peers - 1) / peers * (grad_bytes + second)
    c = ctx.cluster
    hops = 2 * (peers - 1)
    if ctx.world <= ctx.rpn:
        return moved / (c.intra_node_gbps * 1e9) + hops * c.intra_latency_s
    rings_per_node = min(ctx.ep_size, ctx.rpn)
    t_inter = moved * rings_per_node / (c.inter_node_gbps * 1e9)
    t_intra = moved / (c.intra_node_gbps * 1e9) if ctx.ep_size < ctx.rpn else 0.0
    return max(t_inter, t_intra) + hops * c.inter_latency_s


def placement_matrix(placement: Sequence[Sequence[int]], num_experts: int) -> np.ndarray:
    return holders_matrix(placement, len(placement), num_experts)


def owner_matrix(owners: IntVector, world: int) -> np.ndarray:
    return holders_matrix(owned_experts(owners, world), world, len(owners))


def migration_time(ctx: SimContext, world: int, moves: List[Tuple[int, int]]) -> float:
    """Seconds to move whole experts (weights + gradient buffer + optimizer state) ``(src, dst)``, exposed."""
    if not moves:
        return 0.0
    rpn = min(ctx.rpn, world)
    node = lambda r: r // rpn   # noqa: E731
    in_intra, out_intra, in_inter, out_inter = (np.zeros(world) for _ in range(4))
    for src, dst in moves:
        if node(src) == node(dst):
            in_intra[dst] += 1
            out_intra[src] += 1
        else:
            in_inter[dst] += 1
            out_inter[src] += 1
    t = link_time(ctx, world, in_intra, out_intra, node_sum(in_inter, world, rpn), node_sum(out_inter, world, rpn),
               ctx.numel * (ctx.compute_b + ctx.state_bytes_per_param))
    return float(t.max())
