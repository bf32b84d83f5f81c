"""The simulated setting: cluster, model, world, precision and the cost model the runtime would build there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from ..config import HecateConfig
from ..planning.cost_model import StepCostModel, scheduler_costs
from ..tools.memory_plan import OptimizerStateLayout
from ..tools.presets import Cluster, ModelShape


@dataclass
class SimContext:
    cluster: Cluster
    model: ModelShape
    world: int
    rpn: int
    tokens: int
    compute_b: int
    grad_b: int
    s_per_pair: float
    t_fwd: float                        # non-MoE forward time per block (T_nonMoE)
    hecate: HecateConfig
    optimizer: OptimizerStateLayout
    zero_stage: int
    precision: str
    spag: str = "p2p"                   # how Hecate's sparse collectives travel: "p2p" (as collectives.py) or "ring"
    planner_costs: Optional[Dict[str, float]] = None   # what the planners see, when not the time model's costs
    charge_planning: bool = True        # add Hecate's measured host planning time (critical path, exposed search)

    @property
    def numel(self) -> int:
        return self.model.expert_params

    @property
    def row_bytes(self) -> int:
        return self.model.hidden_size * self.compute_b

    @property
    def ep_size(self) -> int:
        return min(self.world, self.model.num_experts)

    @property
    def state_bytes_per_param(self) -> int:
        """fp32 master + fp32 grad + optimizer state: what an owned expert costs (and what migration moves)."""
        return 4 + 4 + self.optimizer.bytes_per_param

    def measured(self, world: int) -> Dict[str, float]:
        if self.planner_costs is not None:
            return dict(self.planner_costs)
        link = self.cluster.inter_node_gbps_per_device if world > self.rpn else self.cluster.intra_node_gbps
        return {"link_gbps": link, "compute_s_per_pair": self.s_per_pair, "non_moe_time_s": self.t_fwd}

    def step_costs(self, world: int) -> StepCostModel:
        """The cost model the runtime would build on this cluster (the runtime's own formula)."""
        return scheduler_costs(self.hecate, self.measured(world), world, self.rpn,
                               expert_bytes=self.numel * (self.compute_b + self.grad_b),
                               token_bytes=4 * self.row_bytes, overlaps_compute=self.cluster.overlaps_compute)
