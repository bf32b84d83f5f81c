"""One layer's planning across calls, as the runtime drives it: the placement prefetched before the gate, the plan
after it, and the replay of a forward's plan by its activation-checkpoint recomputes.

All decisions are :class:`~ds_hecate.planning.layer_planner.LayerPlanner`'s (the code the simulator runs too);
this module keeps what the runtime adds around it: which gathers a call's block was made of (:class:`CallPlan`), the
forward calls' plans until the next model forward (a recompute must replay its forward's plan exactly), and the
counters of what calibration did.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from ..errors import HecateError
from ..planning import Placement
from ..planning.dispatch_plan import DispatchPlan, RankDispatch, rank_tables
from ..planning.layer_planner import LayerPlanner, PlanInputs, PlannerSettings
from ..planning.search.reuse import ScheduleReuse


@dataclass(frozen=True)
class CallPlan:
    """One call's plan: the dispatch plan and this rank's part of it, the placement its block is gathered from (the
    prefetched one, or the call's own), and calibration's extras received into the block's reserved rows (None)."""

    plan: DispatchPlan
    mine: RankDispatch
    gathered: Placement
    extras: Optional[Placement]
    counts: np.ndarray

    def spare_rows(self, rank: int) -> int:
        """Rows the block reserves for the extras (a recompute gathers with the same reserve)."""
        return 0 if self.extras is None else sum(1 for _, dst in self.extras.gather_pairs if dst == rank)


class CallPlanner:
    """See the module docstring. ``world``: the group's size; ``num_experts``: the layer's."""

    def __init__(self, settings: PlannerSettings, world: int, num_experts: int, name: str) -> None:
        self.planner = LayerPlanner(settings, world, num_experts)
        self.name = name
        #: this model forward's calls (each a CallPlan), replayed by recomputes until the next model forward
        self.forward_calls: List[CallPlan] = []
        self.prefetch_hits = 0
        self.recomputes = 0
        self.remembered_calibrations = 0   # calibrations that took the remembered placement instead of searching
        self.shadow_calibrations = 0   # calibrations that took the hot experts on every rank instead of searching
        self.growth_calibrations = 0   # calibrations that took FasterMoE's growth without a search

    @property
    def prefetches(self) -> bool:
        """Whether the placement is decided before the gate (the ``hecate`` policy)."""
        return self.planner.prefetches

    @property
    def calibration(self) -> bool:
        return self.planner.settings.calibration

    def prefetch(self, inputs: PlanInputs, rank: int) -> Placement:
        """The placement to gather before the gate, with this rank's dispatch tables built now (off the critical
        path), so the call after the gate only divides counts."""
        placement = self.planner.prefetch_placement(inputs)
        rank_tables(placement, self.planner.settings.ranks_per_node, rank)
        return placement

    def after_gate(self, counts: np.ndarray, inputs: PlanInputs, prefetched: Optional[Placement],
                   rank: int) -> CallPlan:
        """Plan a forward call from the exchanged ``counts`` over ``prefetched`` (the gathered placement; None for
        the policies that place after the gate, whose whole placement is then gathered)."""
        after = self.planner.plan_call(counts, inputs, prefetched, rank)
        self.remembered_calibrations += after.remembered
        self.shadow_calibrations += after.shadowed
        self.growth_calibrations += after.grown
        gathered = prefetched if prefetched is not None else after.plan.placement
        call = CallPlan(after.plan, after.mine, gathered, after.extras, counts)
        self.forward_calls.append(call)
        return call

    def replay(self, counts: np.ndarray) -> CallPlan:
        """The plan of the forward call a recompute replays (kept until the next model forward: torch's
        non-reentrant checkpointing may recompute a region twice, backward reaching an auxiliary output such as the
        gate's l_aux before the main path, and every recompute must replay the same plan)."""
        self.recomputes += 1
        for call in self.forward_calls:
            if np.array_equal(call.counts, counts):
                return call
        raise HecateError(
            f"MoE layer '{self.name}': activation-checkpoint recompute routed tokens differently from the forward "
            "pass; recompute must reproduce the gate (keep torch.utils.checkpoint's preserve_rng_state=True and do "
            "not change the model between forward and backward)")

    def model_forward(self) -> None:
        """A new model forward: the previous one's plans are no longer replayed."""
        self.forward_calls.clear()

    def observe(self, counts: np.ndarray) -> None:
        """A forward call's counts into the load window (recomputes repeat a call and are not observed)."""
        self.planner.observe(counts)

    # -- state that checkpoints and re-sharding read -----------------------------------------------------------
    @property
    def predictor(self):
        """The layer's load window."""
        return self.planner.predictor

    @property
    def schedule(self) -> ScheduleReuse:
        """The layer's schedule re-use state."""
        return self.planner.schedule

    def check_saved_schedule(self, state: dict, world: int, num_experts: int) -> None:
        """Raise if a checkpoint's saved schedule (``ScheduleReuse.state_dict``) cannot belong to this layer."""
        if not ScheduleReuse.state_fits(state, world, num_experts):
            raise HecateError(f"MoE layer '{self.name}': the checkpoint's saved schedule does not fit this model "
                              f"({world} ranks, {num_experts} experts); the checkpoint's meta.json is damaged")

    def restore_schedule(self, state: dict, inputs: PlanInputs) -> None:
        """Adopt a checkpointed schedule (after owners and measured costs are restored): same reuse decisions."""
        self.planner.restore_schedule(state, inputs)


__all__ = ["CallPlan", "CallPlanner"]
