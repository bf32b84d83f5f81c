"""What a layer's calls add up to: calls, pairs processed, node traffic, the last plan.

Kept per forward call (recomputes repeat a call and are not counted), after the tokens moved; everything derived
(loads before and after, the force-balanced estimate) is computed only when ``stats()`` asks
(:meth:`~ds_hecate.runtime.layer.LayerBinding.stats`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..planning.dispatch_plan import DispatchPlan, RankDispatch
from .host import LayerSetup


class CallTally:
    """One layer's counters across calls (see the module docstring)."""

    def __init__(self, setup: LayerSetup) -> None:
        self.setup = setup
        self.calls = 0
        self.pairs_processed = 0
        self.cross_node_rows = 0
        self.avoidable_cross_node_rows = 0
        self.last_plan: Optional[DispatchPlan] = None
        self.last_counts: Optional[np.ndarray] = None
        self.top_k = 0   # routes per token, seen at the last call (for the trace header)

    def record(self, plan: DispatchPlan, mine: RankDispatch, counts: np.ndarray) -> None:
        """A forward call executed ``plan`` for ``counts``."""
        setup = self.setup
        self.last_plan, self.last_counts = plan, counts
        self.calls += 1
        self.pairs_processed += mine.tokens_processed
        if setup.ranks_per_node < setup.ep_size:   # (inside one node no row crosses one)
            crossing, avoidable = plan.node_traffic(setup.ranks_per_node)
            self.cross_node_rows += crossing
            self.avoidable_cross_node_rows += avoidable


__all__ = ["CallTally"]
