"""Pure planning code (no torch.distributed): sharding, placement, dispatch and the cost model."""
from .cost_model import CommCostModel
from .dispatch import topology_aware_routes
from .placement import POLICIES, plan_layer
from .plan import LayerPlan, Placement
from .sharding import even_sharding

__all__ = ["CommCostModel", "LayerPlan", "Placement", "POLICIES", "even_sharding", "plan_layer",
           "topology_aware_routes"]
