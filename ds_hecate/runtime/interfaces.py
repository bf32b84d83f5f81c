"""What the runtime's parts that span layers see of the runtime, as interfaces below them all.

:class:`~ds_hecate.runtime.hecate.HecateRuntime` calls the expert-data-parallel work (:mod:`.edp`), re-sharding
(:mod:`.resharding`) and cost profiling (:mod:`.profiling`), and the glue installs its expert optimizer. Those parts
need a few things back from the runtime that owns them (its group's communicator, its layout, its device and dtypes,
its layers); typed as the :class:`RuntimeView` protocol here, they depend on this module, not on ``hecate.py``, so
the files form no circle (``tests/test_layout.py``): the shared piece below, the callers above.
Likewise :class:`ExpertStepper` is what the runtime calls of the optimizer the glue builds
(``deepspeed_glue.expert_optimizer.ExpertOptimizer``), without importing the glue.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence

import torch
from torch import nn


class ExpertStepper(Protocol):
    """The expert optimizer as the runtime drives it (``deepspeed_glue.expert_optimizer.ExpertOptimizer``). A
    parameter is added under its layer's key (``runtime.layer_group[layer_id]``, the layer's own id in the
    optimizer), which says from which param groups its pieces take their settings."""

    @property
    def param_groups(self) -> List[Dict[str, Any]]: ...

    def step(self, grad_scale: float, hyperparameters: Sequence[Dict[str, Any]]) -> None: ...

    def current_hyperparameters(self) -> List[Dict[str, Any]]: ...

    def state_of(self, param: nn.Parameter) -> Dict[str, Any]: ...

    def remove(self, param: nn.Parameter) -> None: ...

    def add(self, key: int, param: nn.Parameter, state: Dict[str, Any]) -> None: ...

    def state_bytes(self) -> int: ...


class RuntimeView(Protocol):
    """The runtime as the parts that span its layers read it (the expert-data-parallel work, re-sharding, cost
    profiling): one rank's :class:`~ds_hecate.runtime.hecate.HecateRuntime`; ``rank`` is the index in its group,
    ``ep_size`` the group's size, the whole world is ``layout.world``. A layer reads less
    (:class:`~ds_hecate.runtime.host.LayerHost`)."""

    comm: Any                      # the group's Communicator
    layout: Any                    # edp.GroupLayout: the world, the expert-data-parallel peers, tensor parallelism
    rank: int
    ep_size: int
    ranks_per_node: int
    device: torch.device
    compute_dtype: torch.dtype
    edp_reduce_dtype: torch.dtype
    optimizer: Optional[ExpertStepper]
    layer_group: Dict[int, int]
    bindings: List[Any]
    store: Any
    global_steps: int

    def step_costs(self, binding: Any) -> Any: ...
