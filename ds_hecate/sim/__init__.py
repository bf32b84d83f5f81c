"""Cluster simulator: replay routing (named workloads W0-W7 or recorded traces) on a modelled cluster for expert
parallelism, FasterMoE-, SmartMoE- and FlexMoE-style rearrangement, Hecate, Hecate with re-materialization and the
ideal bound. Pure Python + numpy, no torch.distributed.

The placements come from the real planner (ds_hecate.planning: even_sharding, POLICIES, LoadPredictor,
schedule_materialization with the runtime's own budget and cost formulas from ds_hecate.planning.cost_model), one
planner per Hecate domain (``hecate.ep_size``, ds_hecate.planning.groups), and token routing from the planner's
topology-aware dispatch rule (``dispatch_flows``); the simulator only adds a time model of the links and devices and
the model-state accounting (``model_state``). Its model and cluster presets are in ``presets``. See
docs/simulator.md.
"""
from .core import SYSTEMS, SimResult, SystemResult, format_table, simulate
from .settings import SimSettings

__all__ = ["SYSTEMS", "SimResult", "SimSettings", "SystemResult", "format_table", "simulate"]
