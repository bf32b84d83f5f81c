"""The per-layer planning loop, one implementation for the runtime and the simulator.

Each MoE layer call is planned in two halves, every rank computing the same thing from the same inputs:

- **before the gate** (:meth:`LayerPlanner.prefetch_placement`): the load window's prediction, the scheduler's search
  (re-used while the loads hold), the start layout when there are more ranks than experts; the runtime gathers the
  result ahead of time (SparseAllGather overlapped with the preceding layers);
- **after the gate** (:meth:`LayerPlanner.plan_call`): the exchanged counts score the prediction, calibration may
  extend the prefetched placement (:mod:`.critical_path`), and the dispatch plan is built.

``hecate`` is one placement policy among ``owner``, ``local``, ``cost``, ``shadow`` and ``all``: those need no
prediction, prefetch nothing and place from the exchanged counts alone. The runtime
(:class:`ds_hecate.runtime.layer.LayerBinding`) and the simulator (``ds_hecate.sim.systems``) both hold one
:class:`LayerPlanner` per layer, so the simulator's Hecate figures come from the code the runtime runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .cost_model import CommCostModel, StepCostModel
from .dispatch_plan import DispatchPlan
from .placement import PLACEMENT_POLICIES, POLICIES, STEP_COST_POLICIES
from .plan import Materialized, Placement, holders_matrix, owned_experts
from .predictor import LoadPredictor
from .search import AfterGate, ScheduleReuse, SearchSettings, calibration_settings, plan_after_gate
from .sharding import even_sharding


@dataclass(frozen=True)
class PlannerSettings:
    """The ``hecate`` config keys the planner reads, and the machine's node size."""

    policy: str = "hecate"
    calibration: bool = True
    replan_tolerance: float = 0.05
    load_window: int = 5
    load_predictor: str = "robust"
    search_budget_us: Optional[float] = None
    plan_budget_us: Optional[float] = None
    ranks_per_node: int = 1
    search_slice_us: Optional[float] = None

    @classmethod
    def from_config(cls, config: Any, ranks_per_node: int) -> "PlannerSettings":
        return cls(policy=config.placement, calibration=config.calibration,
                   replan_tolerance=config.replan_tolerance, load_window=config.load_window,
                   load_predictor=config.load_predictor,
                   search_budget_us=config.search_budget_us, plan_budget_us=config.plan_budget_us,
                   ranks_per_node=ranks_per_node, search_slice_us=config.search_slice_us)


@dataclass(frozen=True)
class PlanInputs:
    """What may change between calls: owners (re-sharding), measured costs (profiling), the replica budget."""

    owners: Sequence[int]
    costs: StepCostModel
    replica_budget: int
    comm_cost: Optional[CommCostModel] = None

    def search_settings(self, settings: "PlannerSettings") -> SearchSettings:
        """The prediction-driven search's settings (``hecate.search_budget_us``)."""
        return SearchSettings(self.costs, self.replica_budget, settings.ranks_per_node,
                              budget_us=settings.search_budget_us)

    def calibration_settings(self, settings: "PlannerSettings") -> SearchSettings:
        """Calibration's settings (``hecate.plan_budget_us``, on the critical path)."""
        return calibration_settings(self.costs, self.replica_budget, settings.ranks_per_node, settings.plan_budget_us)


def expert_data_parallel_start(num_experts: int, world: int, replica_budget: int,
                               owners: Sequence[int]) -> Optional[Materialized]:
    """With more ranks than experts, the layout the search starts from: expert-parallel groups of ``num_experts``
    ranks, replicated over the data-parallel dimension (what expert parallelism would hold, which FSSDP has to
    materialize anyway since only ``num_experts`` ranks own one). None when ranks <= experts or when the replica
    budget (a hard cap) cannot hold it."""
    if world <= num_experts:
        return None
    groups: List[List[int]] = [[] for _ in range(num_experts)]
    for e, o in enumerate(even_sharding(num_experts, num_experts)):
        groups[o].append(e)
    held = [tuple(g) for g in groups]
    start = tuple(held[r % num_experts] for r in range(world))
    needed = max(sum(1 for e in experts if owners[e] != r) for r, experts in enumerate(start))
    return start if replica_budget >= needed else None


def search_slice(setting: Optional[float], costs: StepCostModel) -> Optional[float]:
    """``hecate.search_slice_us`` resolved: None (the whole search in one call) for 0, and for null where the cost
    model hides nothing (``overlap_s`` 0); null otherwise: the window the preceding compute hides, in microseconds."""
    if setting is None:
        window = costs.overlap_s * 1e6
        return window if window > 0 else None
    return float(setting) if setting > 0 else None


class LayerPlanner:
    """One layer's planning state across calls: load window, schedule re-use, the last prediction."""

    def __init__(self, settings: PlannerSettings, world: int, num_experts: int) -> None:
        if settings.policy not in PLACEMENT_POLICIES:
            raise ValueError(f"unknown placement policy {settings.policy!r}; known: {list(PLACEMENT_POLICIES)}")
        self.settings = settings
        self.world = world
        self.num_experts = num_experts
        self.predictor = LoadPredictor(settings.load_window, settings.load_predictor)
        self.schedule = ScheduleReuse(settings.replan_tolerance)
        self.prediction: Optional[np.ndarray] = None   # the load window's prediction for the next call
        self._start: Tuple[Any, Optional[Materialized]] = (None, None)   # (its inputs, the start layout)
        self._start_matrix: Tuple[Any, Optional[np.ndarray]] = (None, None)   # (the start layout, its holders)
        #: whether the last prefetched placement holds replicas for a prediction (not only owners and start layout)
        self.speculative = False
        #: the last scheduled Placement: a reused schedule returns the same object, so the dispatch tables built
        #: with it (``rank_tables``, cached on the Placement) are not rebuilt on every call
        self._scheduled: Optional[Placement] = None
        #: the last unscheduled prefetch (owners and start layout) with its inputs, kept for the same reason
        self._unscheduled: Optional[Tuple[Any, Placement]] = None
        #: the last prefetch's search work (:class:`~.search.work.SearchWork` microseconds; 0 when the schedule held)
        self.last_search_us = 0.0

    @property
    def prefetches(self) -> bool:
        """Whether this policy places before the gate (only ``hecate``: the others need the call's counts)."""
        return self.settings.policy == "hecate"

    def owner_placement(self, owners: Sequence[int]) -> Placement:
        return Placement(tuple(owners), owned_experts(owners, self.world))

    def start_layout(self, inputs: PlanInputs) -> Optional[Materialized]:
        """:func:`expert_data_parallel_start`, kept while owners and budget hold: the same object on every call,
        so the schedule's reuse check compares it by identity (at 1,024 ranks rebuilding it cost milliseconds)."""
        key = (inputs.replica_budget, tuple(inputs.owners))
        if self._start[0] != key:
            self._start = (key, expert_data_parallel_start(self.num_experts, self.world, inputs.replica_budget,
                                                           inputs.owners))
        return self._start[1]

    def prefetch_placement(self, inputs: PlanInputs) -> Placement:
        """The ``hecate`` placement for the next call, from the load window. Before any observation, and with
        calibration on while the newest call disagrees with the window (a burst, or routing that just moved:
        calibration then plans from the actual counts), nothing speculative: the owners, plus the start layout with
        more ranks than experts. Why: replicas gathered for loads that do not come cost transfers and leave
        calibration less room."""
        s = self.settings
        self.speculative = False
        self.last_search_us = 0.0
        if self.world == 1:   # one rank owns every expert: there is nothing to place
            return self._unscheduled_placement(tuple(inputs.owners), None)
        predicted = self.prediction = self.predictor.predict_array()
        start = self.start_layout(inputs)
        if predicted is None or (s.calibration and not self.predictor.newest_agrees):
            # what is prefetched now is no schedule (calibration is told so: ``speculative`` False); the schedule
            # itself stays, so that routing back where it was after a burst reuses it without a search
            return self._unscheduled_placement(tuple(inputs.owners), start)
        materialized = self.schedule.schedule(predicted, inputs.owners, inputs.search_settings(s), start=start,
                                              slice_us=search_slice(s.search_slice_us, inputs.costs))
        self.speculative = True
        self.last_search_us = self.schedule.last_work_us
        last = self._scheduled
        if last is None or last.materialized is not materialized or last.owners != tuple(inputs.owners):
            last = self._scheduled = Placement(tuple(inputs.owners), materialized)
        return last

    def _unscheduled_placement(self, owners: Tuple[int, ...], start: Optional[Materialized]) -> Placement:
        """The owners, plus the start layout if any: one Placement object while both hold, so that its dispatch
        tables (``rank_tables``, cached on the Placement) are built once and not on every call that prefetches
        nothing speculative (on the replayed demo routing, most calls: 170 us a call at 2 x 8 on a CPU)."""
        key = (owners, start)
        if self._unscheduled is None or self._unscheduled[0] != key:
            if start is None:
                placement = self.owner_placement(owners)
            else:
                owned = owned_experts(owners, self.world)
                placement = Placement(owners, tuple(tuple(sorted(set(a) | set(b))) for a, b in zip(owned, start)))
            self._unscheduled = (key, placement)
        return self._unscheduled[1]

    def plan_call(self, counts: np.ndarray, inputs: PlanInputs, prefetched: Optional[Placement],
                  rank: int) -> AfterGate:
        """Plan one call from the exchanged ``counts`` (``[ranks, experts]`` int64). ``prefetched``: what
        :meth:`prefetch_placement` returned and was gathered (``hecate`` only). For the other policies the whole
        placement is new (the runtime gathers ``plan.placement`` after this call)."""
        s = self.settings
        if not self.prefetches:
            cost = inputs.costs if s.policy in STEP_COST_POLICIES else inputs.comm_cost
            placement = Placement(tuple(inputs.owners), POLICIES[s.policy](counts, inputs.owners, cost))
            plan = DispatchPlan.build(counts, placement, s.ranks_per_node)
            return AfterGate(plan, plan.for_rank(rank), None, False)
        if prefetched is None:
            raise ValueError("plan_call: the 'hecate' policy plans over the prefetched placement; pass it")
        if self.world == 1:   # nothing to calibrate: every expert is the rank's own
            plan = DispatchPlan.build(counts, prefetched, s.ranks_per_node, counted=True)
            return AfterGate(plan, plan.for_rank(rank), None)
        return plan_after_gate(counts, prefetched, self.schedule, inputs.calibration_settings(s), rank, s.calibration,
                               self.speculative, self._start_holders(inputs))

    def _start_holders(self, inputs: PlanInputs) -> Optional[np.ndarray]:
        """:meth:`start_layout` as a ``[ranks, experts]`` bool matrix, built once per layout."""
        start = self.start_layout(inputs)
        if start is None:
            return None
        if self._start_matrix[0] is not start:
            self._start_matrix = (start, holders_matrix(start, self.world, self.num_experts))
        return self._start_matrix[1]

    def restore_schedule(self, state: dict, inputs: PlanInputs) -> None:
        """Adopt a checkpointed schedule (``ScheduleReuse.state_dict``) so that a resumed run makes the same re-use
        decisions: the situation it was computed in is rebuilt as :meth:`prefetch_placement` builds it, with the
        owners the schedule was made for."""
        owners = state.get("owners", inputs.owners)
        start = expert_data_parallel_start(self.num_experts, self.world, inputs.replica_budget, owners)
        self.schedule.load_state_dict(state, inputs.search_settings(self.settings), start=start)

    def observe(self, counts: np.ndarray) -> None:
        """Feed a forward call's counts to the load window (not recomputes: they repeat a call)."""
        self.predictor.push(counts)
