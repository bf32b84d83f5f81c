"""The cost model: what a layer call costs, read by the runtime's planner, the simulator and the reports.

Two views of the same volumes (paper section 4): :class:`CommCostModel` counts bytes on the wire for the two ways of
bringing a token-expert pair together (move tokens or move the expert); :class:`StepCostModel` turns work into
seconds (profiled or configured, identical on every rank) and :func:`estimate_layer` gives a placement's layer time
as the scheduler sees it. :func:`scheduler_costs` derives it from the ``hecate`` config (the replica budget is
:mod:`.replica_pool`'s); the report and the memory plan read them from here, never the reverse.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .dispatch import dispatch_flows
from .fanout import relay_transfers
from .plan import FloatMatrix, IntMatrix, holders_matrix


@dataclass(frozen=True)
class CommCostModel:
    """Bytes on the wire per iteration for the two ways of bringing a token-expert pair together.

    Moving n tokens to the expert costs 4 transfers of n*hidden activations (dispatch and combine, forward and
    backward). Materializing the expert costs one SparseAllGather of its parameters plus one SparseReduceScatter
    of its gradient, independent of n.
    """

    hidden_size: int
    expert_numel: int
    activation_bytes: int = 4
    param_bytes: int = 4
    grad_bytes: int = 4

    def token_bytes(self, num_tokens: int) -> int:
        return 4 * num_tokens * self.hidden_size * self.activation_bytes

    @property
    def expert_bytes(self) -> int:
        """Bytes of one SparseAllGather + SparseReduceScatter of one expert."""
        return self.expert_numel * (self.param_bytes + self.grad_bytes)

    @property
    def reduce_bytes(self) -> int:
        """Bytes of one SparseReduceScatter of one expert (the part of :attr:`expert_bytes` backward hides)."""
        return self.expert_numel * self.grad_bytes

    def materialize_is_cheaper(self, num_tokens: int) -> bool:
        """True when gathering the expert moves fewer bytes than sending its tokens away and back."""
        return self.token_bytes(num_tokens) > self.expert_bytes


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per unit of work; profiled or configured, identical on every rank.

    compute_s_per_pair: one token through one expert, forward + backward.
    token_transfer_s: one token row leaving (or entering) a rank, all four all-to-all passes together.
    expert_transfer_s: one expert through SparseAllGather + SparseReduceScatter on one rank's link.
    overlap_s: communication time hidden behind the non-MoE compute before the layer (T_nonMoE).
    reduce_share, reduce_overlap_s: the share of ``expert_transfer_s`` that is the SparseReduceScatter, and the
    window that hides it: the runtime issues it asynchronously in backward and the rest of backward runs while it is
    in flight (:data:`BACKWARD_FACTOR` times ``overlap_s``). 0 and 0: the whole transfer hides behind ``overlap_s``
    alone, as before the reduction's own window was priced (a prefetched copy of an expert whose gather and reduction
    both fit their windows costs nothing; charged to the forward window together, a copy of a large expert looked
    dearer than it is: simulated bert-moe W4 on v100/a100-4x8 kept the owners, 6-8% slower than with replicas).
    regather: the layer re-materializes (``hecate.rematerialize``), so its backward gathers the copies again, in the
    reduction's window.
    token_transfer_inter_s, expert_transfer_inter_s: the same over the links between nodes, per rank's share of
    its node's NICs (the node's ranks share them). None: one link for everything at the first two prices (one
    node, or a model that does not tell the links apart). Set, the first two are the price on the links inside a
    node, and a rank's transfer time is that of its slowest link (:func:`link_seconds`): a token kept on its node
    costs NVLink time, not NIC time, so a replica that keeps tokens home is worth what it saves.
    fanout: ``hecate.fanout``, how the sparse collectives forward copies (:mod:`.fanout`): with more replicas of an
    expert than this, holders relay them, and their links carry the copies its owner's would (0: the owner sends
    every copy). relay_chunks: ``hecate.relay_chunks``, the pieces the relays pipeline the levels below the first
    in: those levels run when the collective is waited for, exposed (:func:`~.fanout.relay_transfers`).
    relay_levels_exposed: False prices every level of a tree as one flow issued with the collective, without the
    pipeline's fill: optimistic, the pricing of the scheduler's second search, whose result is then judged with
    the levels exposed. relay_stream_ordered: the runtime issues every level of the trees when the collective
    starts (a CUDA transport: each stage waits for the one before on the device, not the host), so the deeper
    levels, fill included, hide behind compute with the first (:func:`~.fanout.relay_transfers`).
    replica_overhead_s: what one replica costs the rank that holds it in a layer call besides its rows' compute and
    its transfer (``hecate.replica_overhead_s``, else measured: :mod:`ds_hecate.runtime.profiling`): one more expert
    kernel and its weight gradient, its weights landed in the call's buffer and its gradient sent back. Why: on CPU
    ranks that work is a fraction of a millisecond a replica, and unpriced it makes replicas the model counts as a
    gain of a few milliseconds a step come out a few percent slower; priced (about 0.15 ms there) the planner keeps
    the owners where replicas would not pay and still replicates where they do. 0: not priced (the simulator's
    presets: a GPU's grouped kernel takes one more expert at no launch of its own).
    """

    compute_s_per_pair: float
    token_transfer_s: float
    expert_transfer_s: float
    overlap_s: float = 0.0
    token_transfer_inter_s: Optional[float] = None
    expert_transfer_inter_s: Optional[float] = None
    fanout: int = 0
    relay_chunks: int = 1
    relay_levels_exposed: bool = True
    relay_stream_ordered: bool = False
    reduce_share: float = 0.0
    reduce_overlap_s: float = 0.0
    regather: bool = False
    replica_overhead_s: float = 0.0

    @property
    def relays(self) -> Tuple[int, int, bool, bool]:
        """How the relay trees are priced: the trailing arguments of :func:`~.fanout.relay_transfers`."""
        return self.fanout, self.relay_chunks, self.relay_levels_exposed, self.relay_stream_ordered

    @property
    def two_links(self) -> bool:
        return self.token_transfer_inter_s is not None or self.expert_transfer_inter_s is not None

    @property
    def slowest_expert_transfer_s(self) -> float:
        """One expert over the slowest link (the NICs' per-rank share on more than one node)."""
        return self.expert_transfer_s if self.expert_transfer_inter_s is None else self.expert_transfer_inter_s

    def single_link(self) -> "StepCostModel":
        """The same costs with every transfer priced at the slowest link (what a model that does not tell the
        links apart sees: the FasterMoE-style baseline's latency model)."""
        if not self.two_links:
            return self
        token = self.token_transfer_s if self.token_transfer_inter_s is None else self.token_transfer_inter_s
        return replace(self, token_transfer_s=token, expert_transfer_s=self.slowest_expert_transfer_s,
                       token_transfer_inter_s=None, expert_transfer_inter_s=None)

    @property
    def overlap_degree(self) -> int:
        """t in the paper: experts a rank can move while the preceding non-MoE compute runs (over the slowest
        link)."""
        if self.slowest_expert_transfer_s <= 0:
            return 1 << 30
        return int(self.overlap_s / self.slowest_expert_transfer_s)


def _node_max(a, b, ranks_per_node: int):
    """Per rank, the larger of its node's totals of ``a`` and ``b`` (``[..., world]`` arrays)."""
    world = a.shape[-1]
    starts = np.arange(0, world, ranks_per_node)
    node = np.arange(world) // ranks_per_node
    return np.maximum(np.add.reduceat(a, starts, axis=-1), np.add.reduceat(b, starts, axis=-1))[..., node]


def link_seconds(costs: StepCostModel, ranks_per_node: int, unit_s: float, unit_inter_s: Optional[float],
                 intra_in, intra_out, inter_in, inter_out):
    """Per-rank seconds of moving units (token rows or experts) in and out, ``[..., world]`` arrays of counts, the
    ``inter`` ones crossing nodes. One link (``unit_inter_s`` None): the larger direction of all units at
    ``unit_s``. Two: the slower of the rank's own links inside the node (``unit_s`` each) and its node's NICs,
    which the node's ranks share (the node's larger direction at ``unit_inter_s`` per rank share) -- the
    simulator's link model (:func:`ds_hecate.sim.machine.link_time`), so the search optimises what is timed."""
    if unit_inter_s is None:
        return np.maximum(intra_in + inter_in, intra_out + inter_out) * unit_s
    own = np.maximum(intra_in, intra_out) * unit_s
    nics = _node_max(np.asarray(inter_in, dtype=np.float64), np.asarray(inter_out, dtype=np.float64),
                     ranks_per_node) * (unit_inter_s / ranks_per_node)
    return np.maximum(own, nics)


def rank_seconds(costs: StepCostModel, ranks_per_node: int, processed, tokens, early, late):
    """Per-rank layer time as the scheduler sees it: expert compute, token all-to-all, and the expert transfers
    the preceding compute does not hide (``early``: prefetched, hidden up to ``overlap_s``; ``late``: gathered
    after the gate, exposed). ``tokens``, ``early`` and ``late`` are (in-intra, out-intra, in-inter, out-inter)
    count arrays (token rows received and sent; replicas received and sent by their senders), ``[..., world]``.

    The exposed transfers are a barrier: every rank waits for the slowest, because a rank enters the dispatch
    all-to-all only once its gather is complete and the all-to-all completes only when every rank has entered it
    (the simulator times the phases so, :func:`ds_hecate.sim.machine.layer_time`). Charged only on the rank that
    receives them, a search piled transfers onto ranks with little token traffic: at 1,024 H100s DeepSeek-V3 W3
    got slower with more budget (1.69x of EP with 32 GiB against 2.12x with 8 GiB, simulated); charged on every
    rank, 2.12x with 32 GiB."""
    token_s = link_seconds(costs, ranks_per_node, costs.token_transfer_s, costs.token_transfer_inter_s, *tokens)
    hidden = link_seconds(costs, ranks_per_node, costs.expert_transfer_s, costs.expert_transfer_inter_s, *early)
    r = costs.reduce_share   # the gather hides behind the forward's window, the reduction behind backward's
    backward = (1.0 if costs.regather else r) * hidden   # re-materialized: the gather again, beside the reduction
    exposed = (np.maximum(0.0, (1.0 - r) * hidden - costs.overlap_s)
               + np.maximum(0.0, backward - costs.reduce_overlap_s)) + link_seconds(
        costs, ranks_per_node, costs.expert_transfer_s, costs.expert_transfer_inter_s, *late)
    exposed = np.max(exposed, axis=-1, keepdims=True)   # a barrier: see the docstring
    compute = processed * costs.compute_s_per_pair
    if costs.replica_overhead_s:   # every replica is received once (a first level, a relay or after the gate)
        compute = compute + costs.replica_overhead_s * (early[0] + early[2] + late[0] + late[2])
    return compute + token_s + exposed


def replica_transfers(replicas, owners, ranks_per_node: int, fanout: int = 0, chunks: int = 1,
                      exposed_levels: bool = True, stream_ordered: bool = False):
    """``(first, later, depth)``: (in-intra, out-intra, in-inter, out-inter) expert transfers per rank for the
    ``[world, experts]`` bool matrix of replicas (owners excluded): each copy is received by its rank and sent by
    its expert's owner, or with more replicas than ``fanout`` by the holder that relays it, inside the node when
    both are on one; ``first`` the level the collective is issued with, ``later`` the deeper levels, run when it
    is waited for and charged with their pipeline's fill (:func:`~.fanout.relay_transfers`; flat: all first);
    ``depth`` the deepest tree's stages (0 without a replica)."""
    owners = np.asarray(owners, dtype=np.int64)
    replicas = np.asarray(replicas, dtype=bool)
    if not replicas.any():   # nothing to move (every call's late copies but calibration's): no tree walk
        none = tuple(np.zeros(replicas.shape[0]) for _ in range(4))
        return none, none, 0
    key = (replicas.shape, replicas.tobytes(), owners.tobytes(), ranks_per_node, fanout, chunks, exposed_levels,
           stream_ordered)
    cached = _TRANSFERS.get(key)
    if cached is None:
        first, later, depth = relay_transfers(replicas.T, owners, ranks_per_node, fanout,
                                              chunks, exposed_levels, stream_ordered)
        cached = (tuple(_frozen(part.sum(axis=0)) for part in first),
                  tuple(_frozen(part.sum(axis=0)) for part in later), int(depth.max()) if depth.size else 0)
        if len(_TRANSFERS) >= _TRANSFERS_KEPT:
            del _TRANSFERS[next(iter(_TRANSFERS))]   # the oldest entry
        _TRANSFERS[key] = cached
    return cached


#: :func:`replica_transfers` of the last placements priced, read-only: a prefetched placement is priced again at
#: every call it serves (the calibration check, the shadow move's two estimates) and its trees cost the most of an
#: estimate (a100-4x8 burst calls: 0.25 ms of 0.8 ms on a CPU)
_TRANSFERS: dict = {}
_TRANSFERS_KEPT = 64


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@dataclass(frozen=True)
class LayerEstimate:
    time_s: float
    compute_pairs: Tuple[float, ...]   # token-expert pairs processed per rank
    rank_time_s: Tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """max/mean of per-rank expert compute (1.0 = perfectly balanced)."""
        return imbalance(self.compute_pairs)


def estimate_layer(counts: FloatMatrix, owners: Sequence[int], materialized: IntMatrix,
                   costs: StepCostModel, ranks_per_node: int,
                   prefetched: Optional[IntMatrix] = None) -> LayerEstimate:
    """Estimated time of one layer under a placement: its slowest rank (:func:`rank_seconds`).

    Replicas listed in ``prefetched`` were gathered ahead of time (hidden up to ``overlap_s``); others are gathered
    on the critical path (calibration), fully exposed.
    """
    world = len(counts)
    num_experts = len(owners)
    pairs = np.asarray(counts, dtype=np.float64).reshape(world, num_experts)
    mat = holders_matrix(materialized, world, num_experts)
    if (~mat.any(axis=0) & (pairs.sum(axis=0) != 0)).any():
        raise ValueError("estimate_layer: an expert with token-expert pairs is materialized nowhere")
    flows = dispatch_flows(pairs.T, mat.T, ranks_per_node)
    processed = flows.processed.sum(axis=0)
    sent, received = flows.sent.sum(axis=0), flows.received.sum(axis=0)
    sent_i, received_i = flows.sent_inter.sum(axis=0), flows.received_inter.sum(axis=0)
    tokens = (received - received_i, sent - sent_i, received_i, sent_i)
    replicas = mat.copy()
    replicas[np.asarray(owners, dtype=np.int64), np.arange(num_experts)] = False
    early_mask = replicas if prefetched is None else replicas & holders_matrix(prefetched, world, num_experts)
    # prefetched copies: the first level hides behind compute, the deeper ones run at the wait; calibration's, all
    # after the gate
    early, deeper, _ = replica_transfers(early_mask, owners, ranks_per_node, *costs.relays)
    late_first, late_deeper, _ = replica_transfers(replicas & ~early_mask, owners, ranks_per_node, *costs.relays)
    late = tuple(a + b + c for a, b, c in zip(deeper, late_first, late_deeper))
    times = rank_seconds(costs, ranks_per_node, processed, tokens, early, late)
    return LayerEstimate(float(times.max()), tuple(processed.tolist()), tuple(times.tolist()))


def owner_loads(counts: IntMatrix, owners: Sequence[int], world_size: int) -> List[int]:
    """Token-expert pairs per rank when every expert runs only on its owner (plain expert parallelism)."""
    per_expert = np.asarray(counts).reshape(-1, len(owners)).sum(axis=0)
    loads = np.zeros(world_size, dtype=per_expert.dtype)
    np.add.at(loads, np.asarray(owners, dtype=np.int64), per_expert)
    return loads.tolist()


def imbalance(loads: Sequence[float]) -> float:
    """max/mean of per-rank loads (1.0 when there is no load at all)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


#: backward compute over forward compute (the usual 2x of a transformer block): how much longer the window is that
#: hides the asynchronous SparseReduceScatter than T_nonMoE, which hides the gather (the simulator's t_b = 2 t_f)
BACKWARD_FACTOR = 2.0


def scheduler_costs(config: Any, measured: Mapping[str, float], world_size: int, ranks_per_node: int,
                    expert_bytes: int, token_bytes: int, overlaps_compute: bool,
                    relays_stream_ordered: Optional[bool] = None, reduce_bytes: int = 0,
                    regather: bool = False) -> StepCostModel:
    """The scheduler's cost model from the ``hecate`` config and measured values (configured values win).

    ``expert_bytes``: one expert through SparseAllGather + SparseReduceScatter, ``reduce_bytes`` of them the
    SparseReduceScatter's (priced apart, hidden behind backward: :class:`StepCostModel`; 0: not apart), ``regather``
    whether the layer re-materializes (its backward gathers again); ``token_bytes``: one token row
    through the four all-to-all passes. On one node one link prices everything (``link_gbps``). On more than one,
    two: ``link_gbps`` inside a node and ``inter_node_gbps`` (per rank, the node's NICs shared by its ranks;
    measured ``inter_node_gbps`` next, else ``link_gbps``) between nodes, each rank charged for its slowest link
    (:func:`rank_seconds`). The paper's t uses the slowest link. A measured T_nonMoE hides communication only
    where collectives run beside compute (CUDA streams); on a CPU the same cores do both, so nothing is hidden
    unless the user says otherwise. ``replica_overhead_s``: configured, else measured, else 0 (not priced).
    ``relays_stream_ordered``: whether the weight transport issues every relay
    level when a sparse collective starts (default: where collectives overlap compute, the CUDA transports).
    """
    cfg, m = config, measured
    intra_bps = (cfg.link_gbps or m.get("link_gbps", 10.0)) * 1e9
    inter_bps = None
    if world_size > ranks_per_node:
        inter_bps = (cfg.inter_node_gbps or m.get("inter_node_gbps") or cfg.link_gbps or m.get("link_gbps", 10.0)) * 1e9
    slowest_expert_s = expert_bytes / (inter_bps or intra_bps)
    measured_overlap = m.get("non_moe_time_s", 0.0) if overlaps_compute else 0.0
    overlap_s = cfg.non_moe_time_s if cfg.non_moe_time_s is not None else measured_overlap
    if cfg.overlap_degree is not None:
        overlap_s = cfg.overlap_degree * slowest_expert_s
    return StepCostModel(compute_s_per_pair=cfg.compute_s_per_pair or m.get("compute_s_per_pair", 1e-6),
                         token_transfer_s=token_bytes / intra_bps, expert_transfer_s=expert_bytes / intra_bps,
                         overlap_s=overlap_s,
                         token_transfer_inter_s=None if inter_bps is None else token_bytes / inter_bps,
                         expert_transfer_inter_s=None if inter_bps is None else expert_bytes / inter_bps,
                         fanout=cfg.fanout, relay_chunks=cfg.relay_chunks,
                         relay_stream_ordered=overlaps_compute if relays_stream_ordered is None
                         else bool(relays_stream_ordered),
                         reduce_share=reduce_bytes / expert_bytes if expert_bytes else 0.0,
                         reduce_overlap_s=BACKWARD_FACTOR * overlap_s if reduce_bytes else 0.0,
                         regather=bool(regather and reduce_bytes),
                         replica_overhead_s=(cfg.replica_overhead_s if cfg.replica_overhead_s is not None
                                             else m.get("replica_overhead_s", 0.0)))
