"""The simulated setting: cluster, model, world, Hecate domain, precision and the cost model the runtime would build
there."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional

from ..config import HecateConfig
from ..planning.cost_model import StepCostModel, scheduler_costs
from ..planning.groups import ExpertGroups
from .model_state import OptimizerStateLayout
from .presets import Cluster, ModelShape


@dataclass
class SimContext:
    cluster: Cluster
    model: ModelShape
    world: int
    rpn: int
    tokens: int
    compute_b: int
    grad_b: int                         # bytes per gradient element in SparseReduceScatter
    edp_grad_b: int                     # ... in the reduction over expert-data-parallel peers
    s_per_pair: float
    t_fwd: float                        # non-MoE forward time per block (T_nonMoE)
    hecate: HecateConfig
    optimizer: OptimizerStateLayout
    zero_stage: int
    precision: str
    spag: str = "p2p"                   # how Hecate's sparse collectives travel: "p2p" (as collectives.py) or "ring"
    planner_costs: Optional[Dict[str, float]] = None   # what the planners see, when not the time model's costs
    charge_planning: bool = True        # add Hecate's host planning time (critical path, exposed search)
    planning_clock: str = "work"        # how it is counted: "work" (the planner's work models), "thread" (CPU time)
    charge_call_overhead: bool = True   # add each system's per-call runtime overhead (the cluster's call_overhead)
    ep_size: int = 0                    # G: Hecate's domain and the EP baselines' expert-parallel size; 0: the world
    planner_token_price: float = 1.0    # what-if: Hecate's planners see token traffic at this fraction of its cost

    def __post_init__(self) -> None:
        if not self.ep_size:
            self.ep_size = self.world

    @property
    def numel(self) -> int:
        return self.model.expert_params

    @property
    def row_bytes(self) -> int:
        return self.model.hidden_size * self.compute_b

    @property
    def groups(self) -> ExpertGroups:
        """``world / ep_size`` groups of consecutive ranks (expert-parallel groups, Hecate domains)."""
        return ExpertGroups(self.world, self.ep_size, self.rpn)

    @property
    def owned_per_rank(self) -> int:
        """Experts of one layer on the rank that owns the most (every group is sharded alike, evenly)."""
        base, extra = divmod(self.model.num_experts, self.ep_size)
        return base + (1 if extra else 0)

    @property
    def edp_size(self) -> int:
        """R: expert-data-parallel copies of every expert (one per group)."""
        return self.world // self.ep_size

    @property
    def state_bytes_per_param(self) -> int:
        """fp32 master + fp32 grad + optimizer state: what an owned expert costs (and what migration moves)."""
        return 4 + 4 + self.optimizer.bytes_per_param

    def measured(self, world: int) -> Dict[str, float]:
        """The measured costs a runtime planning a ``world``-rank domain would hold: the link inside a node, and
        the inter-node bandwidth per device when the domain spans nodes."""
        if self.planner_costs is not None:
            return dict(self.planner_costs)
        out = {"link_gbps": self.cluster.intra_node_gbps, "compute_s_per_pair": self.s_per_pair,
               "non_moe_time_s": self.t_fwd}
        if world > self.rpn:
            out["inter_node_gbps"] = self.cluster.inter_node_gbps_per_device
        if self.cluster.replica_overhead_s:
            out["replica_overhead_s"] = self.cluster.replica_overhead_s
        return out

    def step_costs(self, world: int, rematerialize: bool = False) -> StepCostModel:
        """The cost model the runtime would build for a ``world``-rank domain on this cluster (the runtime's own
        formula; a group's planner sees only its group's ranks), for a layer that re-materializes or not."""
        return scheduler_costs(self.hecate, self.measured(world), world, self.rpn,
                               expert_bytes=self.numel * (self.compute_b + self.grad_b),
                               token_bytes=4 * self.row_bytes, overlaps_compute=self.cluster.overlaps_compute,
                               reduce_bytes=self.numel * self.grad_b, regather=rematerialize)

    def hecate_step_costs(self, world: int, rematerialize: bool = False) -> StepCostModel:
        """:meth:`step_costs` as Hecate's planners see it: token traffic priced at ``planner_token_price`` of its
        cost (1: the runtime's model). A what-if only: a price below 1 makes the search trade token traffic for
        compute balance, while the time model still charges every row whole."""
        costs, price = self.step_costs(world, rematerialize), self.planner_token_price
        inter = costs.token_transfer_inter_s
        return replace(costs, token_transfer_s=costs.token_transfer_s * price,
                       token_transfer_inter_s=None if inter is None else inter * price)
