"""What a layer reads of the runtime that owns it: :class:`LayerHost`, a handful of members.

A layer (:class:`~ds_hecate.runtime.layer.LayerBinding`) owns its own state (its planner, its gathers, its
counters); the runtime (:class:`~ds_hecate.runtime.hecate.HecateRuntime`, which implements :class:`LayerHost`) holds
what spans layers. The layer reads, and calls, only this: the fixed setup of the rank's group, the call sequence
(which layer prefetches next), the queue its backward hands SparseReduceScatters to, the instruments that watch
its calls, and two answers that change between calls (the scheduler's costs, the layer's replica budget).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from ..comm.collectives import Communicator
from ..config import HecateConfig
from ..planning.cost_model import StepCostModel
from ..planning.replica_pool import LayerGrant
from .call_monitor import CallMonitor
from .call_sequence import CallSequence
from .reductions import ReductionQueue
from .stops import Stops


@dataclass(frozen=True)
class LayerSetup:
    """The rank's group as every layer call sees it, fixed once the runtime is built: the group's communicator
    (``rank`` and ``ep_size`` are its), the node layout its planner assumes, the working device and dtypes (compute;
    the SparseReduceScatter's wire), the ``hecate`` config, the tensor-parallel peers (None without), the stops,
    and whether relay trees run stream-ordered."""

    comm: Communicator
    rank: int
    ep_size: int
    ranks_per_node: int
    device: torch.device
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    config: HecateConfig
    tensor_parallel: Optional[Communicator]
    stops: Stops
    relays_stream_ordered: bool


class LayerHost(Protocol):
    """The runtime as a layer reads it (see the module docstring)."""

    setup: LayerSetup
    sequence: CallSequence
    reductions: ReductionQueue
    monitor: CallMonitor

    def step_costs(self, layer: Any) -> StepCostModel: ...

    def grant(self, layer: Any) -> LayerGrant: ...


__all__ = ["LayerHost", "LayerSetup"]
