"""What a simulation is asked for besides the cluster, the model and the routing: one frozen object.

Why one object: :func:`~ds_hecate.sim.core.simulate` took these as 18 keyword parameters and passed them all again
to its own force-balanced run; its users (``ds-hecate simulate``, :mod:`.calibration`, the
tests) now build one :class:`SimSettings`, and a variant is ``dataclasses.replace(settings, ...)``. Checked when
built, with the messages ``simulate`` always gave.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from ..config import HecateConfig
from ..errors import HecateError
from .model_state import ADAM, OptimizerStateLayout


@dataclass(frozen=True)
class SimSettings:
    """The simulation's settings.

    ``steps`` simulated training steps, the first ``warmup`` left out of the averages; ``seed`` of the named
    workloads. ``world_size``: devices (None: the cluster's). ``tokens_per_rank``: None, the model's
    ``seq_len * micro_batch``. ``hecate``: the ``hecate`` config the Hecate systems plan with (None: defaults, with
    ``materialize_budget_mb`` = 10% of device memory unless given). ``zero_stage``, ``precision``, ``optimizer``:
    the dense model state's layout, for the memory column and the wire dtypes.

    ``spag``: ``p2p`` models Hecate's SparseAllGather/SparseReduceScatter as ds_hecate runs them (the owner sends
    each replica), ``ring`` is a what-if with pipelined ring broadcasts/reductions per expert (the paper's NCCL
    Broadcast/Reduce). ``planner_costs``: the measured costs (``compute_s_per_pair``, ``link_gbps``,
    ``non_moe_time_s``) the planners decide with, when they differ from the cluster's time model: a run's runtime
    planned with its own measurement, and replaying its decisions needs those numbers even where the step time is
    modelled with other unit costs.

    ``force_balanced``: also simulate every system on the same routing forced uniform
    (:func:`ds_hecate.planning.balance.force_uniform`) and report that step time and its fraction of the
    system's own (UltraEP's metric). ``charge_planning``: Hecate's host planning, as the runtime runs it (the
    critical path in full, the search where it outlasts the non-MoE compute that hides it), is added to its step
    (``host_planning`` in the breakdown); ``planning_clock``: how it is counted, ``work`` (from what the planner
    did, in its work models' estimated microseconds: the same figures on every machine and under any load) or
    ``thread`` (this thread's CPU time as it runs here). ``charge_call_overhead``: every system's per-call runtime
    overhead (the cluster's ``call_overhead``, :mod:`.overhead`; ``call_overhead`` in the breakdown); False leaves
    it out, a what-if of runtimes as lean as a plain layer (the planners decide alike either way).
    ``call_overhead_fit``: charge the cluster the committed fit of that name instead of its own charge
    (:meth:`~ds_hecate.sim.presets.Cluster.charged_by`; None: the cluster's, the default fit on a preset).

    ``ep_size``: the group size G every system but the ideal runs in (Hecate's domain, the EP baselines'
    expert-parallel size); None: the ``hecate`` config's ``ep_size``, else the runtime's rule
    (:func:`~ds_hecate.planning.groups.resolve_ep_size`). ``planner_token_price``: a what-if, Hecate's planners
    see token traffic at this fraction of its cost (the time model charges it whole)."""

    steps: int = 30
    warmup: int = 1
    seed: int = 0
    world_size: Optional[int] = None
    tokens_per_rank: Optional[int] = None
    hecate: Optional[HecateConfig] = None
    materialize_budget_mb: Optional[float] = None
    zero_stage: int = 1
    precision: str = "bf16"
    optimizer: OptimizerStateLayout = ADAM
    spag: str = "p2p"
    planner_costs: Optional[Mapping[str, float]] = None
    force_balanced: bool = True
    charge_planning: bool = True
    charge_call_overhead: bool = True
    call_overhead_fit: Optional[str] = None
    ep_size: Optional[int] = None
    planning_clock: str = "work"
    planner_token_price: float = 1.0

    def __post_init__(self) -> None:
        if self.steps <= self.warmup:
            raise HecateError(f"simulate: steps ({self.steps}) must exceed warm-up steps ({self.warmup})")
        if self.spag not in ("p2p", "ring"):
            raise HecateError(f"simulate: spag must be 'p2p' or 'ring', got {self.spag!r}")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise HecateError(f"simulate: precision must be bf16, fp16 or fp32, got {self.precision!r}")
        if self.planning_clock not in ("work", "thread"):
            raise HecateError(f"simulate: planning_clock must be 'work' or 'thread', got {self.planning_clock!r}")
        if not 0.0 <= self.planner_token_price <= 1.0:
            raise HecateError(f"simulate: planner_token_price must be in [0, 1], got {self.planner_token_price!r}")
