"""What the runtime's parts see of each other, as interfaces below them all.

:class:`~ds_hecate.runtime.hecate.HecateRuntime` owns the layer bindings (:mod:`.layer`), calls the expert-data-
parallel work (:mod:`.edp`) and re-sharding (:mod:`.resharding`), and the glue installs its expert optimizer. Those
parts need a few things back from the runtime that owns them (its group's communicator, its layout, its device and
dtypes, its clocks); typed as the :class:`RuntimeView` protocol here, they depend on this module, not on
``hecate.py``, so the files form no circle (``tests/test_layout.py``): the shared piece below, the callers above.
Likewise :class:`ExpertStepper` is what the runtime calls of the optimizer the glue builds
(``deepspeed_glue.expert_optimizer.ExpertOptimizer``), without importing the glue.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

import torch
from torch import nn


class ExpertStepper(Protocol):
    """The expert optimizer as the runtime drives it (``deepspeed_glue.expert_optimizer.ExpertOptimizer``)."""

    param_groups: List[Dict[str, Any]]

    def step(self, grad_scale: float, hyperparameters: Sequence[Dict[str, Any]]) -> None: ...

    def current_hyperparameters(self) -> List[Dict[str, Any]]: ...

    def state_of(self, param: nn.Parameter) -> Dict[str, Any]: ...

    def remove(self, param: nn.Parameter) -> None: ...

    def add(self, group_index: int, param: nn.Parameter, state: Dict[str, Any]) -> None: ...

    def state_bytes(self) -> int: ...


class RuntimeView(Protocol):
    """The runtime as its layers, the expert-data-parallel work and re-sharding read it (one rank's
    :class:`~ds_hecate.runtime.hecate.HecateRuntime`; ``rank`` is the index in its group, ``ep_size`` the group's size;
    the whole world is ``layout.world``)."""

    config: Any
    comm: Any                      # the group's Communicator
    layout: Any                    # edp.GroupLayout: the world, the expert-data-parallel peers, tensor parallelism
    rank: int
    ep_size: int
    ranks_per_node: int
    device: torch.device
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    edp_reduce_dtype: torch.dtype
    optimizer: Optional[ExpertStepper]
    layer_group: Dict[int, int]
    bindings: List[Any]
    store: Any
    stops: Any
    clock: Any
    backward_phases: Any
    autograd_anchor: torch.Tensor
    last_layer_end: Optional[object]
    pending_reductions: List[Any]
    observers: List[Callable[..., None]]
    relays_stream_ordered: bool

    def step_costs(self, binding: Any) -> Any: ...

    def grant(self, binding: Any) -> Any: ...

    def comm_cost_model(self, shard: Any, hidden_size: int) -> Any: ...

    def note_layer_call(self, binding: Any, recompute: bool) -> None: ...

    def note_replica_bytes(self) -> None: ...

    def prefetch_after(self, binding: Any) -> None: ...

    def issued_reduction(self) -> None: ...
