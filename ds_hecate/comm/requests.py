"""A layer call's sparse collectives bound to everything but what backward produces, so the expert compute can issue
them without knowing the layer.

The layer call decides in forward what its backward's SparseReduceScatter will be (the plan's placement, the call's
experts, the accumulator it adds into, the relay trees) and, with re-materialization, what its backward re-gathers;
the expert compute's backward only supplies the gradients (:meth:`ReduceScatterRequest.start`) or asks for the rows
again (:meth:`GatherRequest.start`). The requests call the :class:`~.collectives.Communicator` and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

import torch

from ..planning import Placement
from ..planning.fanout import RelayPlan
from .buffers import Accumulator, CommCounters, GatheredExperts, PendingGather

if TYPE_CHECKING:
    from .collectives import Communicator


@dataclass(frozen=True)
class ReduceScatterRequest:
    """spRS(P', P) of one layer call: every materialized copy's gradient into its owner's accumulator."""

    comm: "Communicator"
    placement: Placement
    experts: Sequence[int]
    wire_dtype: torch.dtype
    counters: CommCounters
    accumulator: Accumulator
    relay: Optional[RelayPlan]

    def start(self, own_grads: Optional[torch.Tensor], replica_grads: torch.Tensor) -> Callable[[], None]:
        """Issue it (asynchronously); the returned function completes it. ``own_grads``: the owned rows' gradients,
        None when the expert compute wrote them into the accumulator already; ``replica_grads``: the replica rows'."""
        return self.comm.start_sparse_reduce_scatter(self.placement, self.experts, own_grads, replica_grads,
                                                     self.wire_dtype, self.counters, self.accumulator,
                                                     relay=self.relay)


@dataclass(frozen=True)
class GatherRequest:
    """spAG(P, P') of one layer call's placement, from the owners' resident weights (re-materialization's second
    gather, in backward). ``track`` notes the gathered block (replica memory statistics)."""

    comm: "Communicator"
    placement: Placement
    owned: Mapping[int, torch.Tensor]
    numel: int
    dtype: torch.dtype
    counters: CommCounters
    relay: Optional[RelayPlan]
    resident: Optional[torch.Tensor]
    track: Callable[[GatheredExperts], GatheredExperts] = lambda gathered: gathered

    def start(self, async_op: bool = False, spare_rows: int = 0) -> PendingGather:
        pending = self.comm.start_sparse_all_gather(self.placement, self.owned, self.numel, self.dtype,
                                                    self.counters, async_op=async_op, spare_rows=spare_rows,
                                                    relay=self.relay, resident=self.resident)
        return PendingGather(self.placement, lambda: self.track(pending.wait()))


__all__ = ["GatherRequest", "ReduceScatterRequest"]
