"""The cost model: what a layer call costs, read by the runtime's planner, the simulator and the reports.

Two views of the same volumes (paper section 4): :class:`CommCostModel` counts bytes on the wire for the two ways of
bringing a token-expert pair together (move tokens or move the expert); :class:`StepCostModel` turns work into
seconds (profiled or configured, identical on every rank) and :func:`estimate_layer` gives a placement's layer time
as the scheduler sees it. :func:`scheduler_costs` and :func:`replica_budget` derive both from the ``hecate`` config;
the report and the memory plan read them from here, never the reverse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .dispatch import rank_loads


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
    """

    compute_s_per_pair: float
    token_transfer_s: float
    expert_transfer_s: float
    overlap_s: float = 0.0

    @property
    def overlap_degree(self) -> int:
        """t in the paper: experts a rank can move while the preceding non-MoE compute runs."""
        if self.expert_transfer_s <= 0:
            return 1 << 30
        return int(self.overlap_s / self.expert_transfer_s)


@dataclass(frozen=True)
class LayerEstimate:
    time_s: float
    compute_pairs: Tuple[float, ...]   # token-expert pairs processed per rank
    rank_time_s: Tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """max/mean of per-rank expert compute (1.0 = perfectly balanced)."""
        return imbalance(self.compute_pairs)


def estimate_layer(counts: Sequence[Sequence[float]], owners: Sequence[int], materialized: Sequence[Sequence[int]],
                   costs: StepCostModel, ranks_per_node: int,
                   prefetched: Optional[Sequence[Sequence[int]]] = None) -> LayerEstimate:
    """Estimated time of one layer under a placement.

    Replicas listed in ``prefetched`` were gathered ahead of time (hidden up to ``overlap_s``); others are gathered
    on the critical path (calibration), fully exposed.
    """
    world = len(counts)
    per_expert, sent, received = rank_loads(counts, materialized, ranks_per_node)
    processed = [sum(row) for row in per_expert]
    moved_in = [0] * world
    moved_out = [0] * world
    exposed_in = [0] * world
    exposed_out = [0] * world
    for r, experts in enumerate(materialized):
        early = set(prefetched[r]) if prefetched is not None else None
        for e in experts:
            o = owners[e]
            if o == r:
                continue
            if early is None or e in early:
                moved_in[r] += 1
                moved_out[o] += 1
            else:
                exposed_in[r] += 1
                exposed_out[o] += 1
    times = []
    for r in range(world):
        hidden_comm = max(moved_in[r], moved_out[r]) * costs.expert_transfer_s
        exposed = max(0.0, hidden_comm - costs.overlap_s)
        exposed += max(exposed_in[r], exposed_out[r]) * costs.expert_transfer_s
        tokens = max(sent[r], received[r]) * costs.token_transfer_s
        times.append(processed[r] * costs.compute_s_per_pair + tokens + exposed)
    return LayerEstimate(max(times), tuple(processed), tuple(times))


def owner_loads(counts: Sequence[Sequence[int]], owners: Sequence[int], world_size: int) -> List[int]:
    """Token-expert pairs per rank when every expert runs only on its owner (plain expert parallelism)."""
    per_expert = np.asarray(counts).reshape(-1, len(owners)).sum(axis=0)
    loads = np.zeros(world_size, dtype=per_expert.dtype)
    np.add.at(loads, np.asarray(owners, dtype=np.int64), per_expert)
    return loads.tolist()


def imbalance(loads: Sequence[float]) -> float:
    """max/mean of per-rank loads (1.0 when there is no load at all)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


# -- budgets from the config ---------------------------------------------------------------------------------------
def resolve_rematerialize(setting: Optional[bool], materialize_budget_mb: float, expert_bytes: Sequence[int],
                          experts_per_rank: Sequence[int]) -> bool:
    """``hecate.rematerialize`` for a model whose layers' experts are ``expert_bytes`` each (compute dtype) and whose
    ranks own up to ``experts_per_rank`` experts of each layer: as set, or (null) true exactly when keeping every
    layer's replicas resident leaves each layer fewer replica slots per rank than a quarter of the experts a rank
    owns, while one layer at a time leaves more.

    Why a quarter: a hot rank's load is spread over the experts it owns, so relieving it takes replicas of a good
    share of them; below a quarter the resident slots cannot take enough of it for the planner to keep them (its
    ``min_gain``: DeepSeek-V3 at ``ep_size`` 8 gets 1 slot for 32 owned experts and places nothing), and the one
    more SparseAllGather per replica that re-materialization costs in backward buys slots that do. Simulated at
    1,024 H100s with the default 8 GiB budget (``ds-hecate simulate --config`` with ``rematerialize`` false against
    ``hecate-rm``): DeepSeek-V3 at ``ep_size`` 8 (1 slot for 32 experts) W3 1.00x of EP resident, 1.08x
    re-materialized, W1 1.11x both; at 64 (1 slot for 4) W3 1.46x against 1.44x, W1 1.87x both; at 256 (1 for 1)
    W3 1.82x against 1.79x; Mixtral-8x7B (no resident slot) 1.00x against 1.46x. One decision
    for every layer, so the budget's split stays what ``replica_budget`` assumes."""
    if setting is not None or not expert_bytes:
        return bool(setting)
    layers = len(expert_bytes)
    resident = [replica_budget(materialize_budget_mb, b, layers, False) for b in expert_bytes]
    one_layer = [replica_budget(materialize_budget_mb, b, layers, True) for b in expert_bytes]
    return (all(4 * r < k for r, k in zip(resident, experts_per_rank))
            and any(o > r for o, r in zip(one_layer, resident)))


def replica_budget(materialize_budget_mb: float, expert_bytes: int, num_layers: int, rematerialize: bool) -> int:
    """Replicas one layer may hold per rank: the budget split over the layers resident at once (all layers, or
    one with re-materialization), in experts of ``expert_bytes`` (compute dtype)."""
    resident_layers = 1 if rematerialize else max(1, num_layers)
    return int(materialize_budget_mb * (1 << 20) // (resident_layers * expert_bytes))


def scheduler_costs(config: Any, measured: Mapping[str, float], world_size: int, ranks_per_node: int,
                    expert_bytes: int, token_bytes: int, overlaps_compute: bool) -> StepCostModel:
    """The scheduler's cost model from the ``hecate`` config and measured values (configured values win).

    ``expert_bytes``: one expert through SparseAllGather + SparseReduceScatter; ``token_bytes``: one token row
    through the four all-to-all passes. Bandwidth is the inter-node one on more than one node (the paper's t uses
    the slowest link). A measured T_nonMoE hides communication only where collectives run beside compute (CUDA
    streams); on a CPU the same cores do both, so nothing is hidden unless the user says otherwise.
    """
    cfg, m = config, measured
    bw = (cfg.inter_node_gbps if world_size > ranks_per_node and cfg.inter_node_gbps else
          cfg.link_gbps) or m.get("link_gbps", 10.0)
    bytes_per_s = bw * 1e9
    expert_s = expert_bytes / bytes_per_s
    measured_overlap = m.get("non_moe_time_s", 0.0) if overlaps_compute else 0.0
    overlap_s = cfg.non_moe_time_s if cfg.non_moe_time_s is not None else measured_overlap
    if cfg.overlap_degree is not None:
        overlap_s = cfg.overlap_degree * expert_s
    return StepCostModel(compute_s_per_pair=cfg.compute_s_per_pair or m.get("compute_s_per_pair", 1e-6),
                         token_transfer_s=token_bytes / bytes_per_s, expert_transfer_s=expert_s,
                         overlap_s=overlap_s)
