"""The search's budget in work every rank counts alike, and what a search yields between its steps.

Why a module of its own: the greedy search (:mod:`.greedy`), the sliced prefetch search (:mod:`.sliced`),
calibration (:mod:`.critical_path`) and the proportional start (:mod:`.proportional`) all count their work in the
same estimated microseconds, so that every rank stops at the same step whatever its clock says.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Optional, Union, overload

import numpy as np

from .call_work import CALL_WORK
from ..plan import Materialized


@dataclass(frozen=True)
class Progress:
    """Where a search stands before its next step: estimated work so far and of that step (microseconds of
    :class:`SearchWork`, identical on every rank), the best layer time and placement (``[ranks, experts]`` bool,
    not to be modified) found so far."""

    spent_us: float
    step_us: float
    best_time_s: float
    best: np.ndarray
    last_gain_us: float = 0.0   # what the step before took off the layer's estimate (ties credited, _step_gain)


def run_to_end(steps: Generator[Progress, None, Materialized]) -> Materialized:
    """The placement a search generator returns, every step taken."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def run_metered(steps: Generator[Progress, None, Materialized], meter, silent_us: float) -> Materialized:
    """:func:`run_to_end`, adding the search's work to ``meter`` (a :class:`~.call_work.WorkMeter`): the work so far
    and of the step the last :class:`Progress` announced (a search takes the step it announces), or ``silent_us``
    where it never announced one (its setup found no move, or the budget did not pay a first step)."""
    last: Optional[Progress] = None
    while True:
        try:
            last = next(steps)
        except StopIteration as end:
            meter.add(silent_us if last is None else last.spent_us + last.step_us)
            return end.value


@dataclass(frozen=True)
class SearchWork:
    """How a search budget in microseconds becomes work every rank counts alike.

    Ranks must reach the same placement, so the search cannot stop on a clock: each rank's wall time differs.
    It counts work instead, in estimated microseconds of this module's numpy search: a setup per
    (rank, expert) cell, a fixed cost per step, and a cost per evaluated (move, rank) cell. The constants were
    fitted on a CPU to the 90th percentile of measured setups and steps (8 to 256 ranks, 8 to 256
    experts, fresh and calibration searches, the two-link objective with relay trees of issue 26), so a budget
    holds there on nine searches in ten; a faster host finishes inside it sooner, a slower one overruns it by its
    slowness, never by a different decision.
    """

    setup_us: float = 290.0
    setup_us_per_cell: float = 0.0975
    step_us: float = 680.0
    step_us_per_cell: float = 0.003
    move_us_per_cell: float = 0.115
    fill_us_per_replica: float = 30.0   # the proportional start: one replica placed (:mod:`.proportional`)

    def setup_cost_us(self, world: int, num_experts: int) -> float:
        """Building the search state: the dispatch columns of every (rank, expert) cell."""
        return self.setup_us + self.setup_us_per_cell * world * num_experts

    def step_cost_us(self, moves: int, world: int, num_experts: int) -> float:
        """One step: a fixed part, the refresh of the rank totals, and the batch of ``moves`` x ``world`` cells."""
        return self.step_us + self.step_us_per_cell * world * num_experts + self.move_us_per_cell * moves * world

    def first_step_us(self, world: int, num_experts: int, candidate_experts: int = 4,
                      candidate_ranks: int = 64) -> float:
        """Setup plus a typical first step: below this a budget cannot change the placement, so the search (and
        the estimate that decides whether to run it) is not worth starting."""
        moves = candidate_experts * (min(max(world - 1, 1), candidate_ranks) + 2)
        return self.setup_cost_us(world, num_experts) + self.step_cost_us(moves, world, num_experts)

    def fill_cost_us(self, replicas: int, world: int, num_experts: int) -> float:
        """The proportional start (:func:`~.proportional.proportional_fill`) of ``replicas`` replicas (26-31 us
        each from 32 x 64 to 256 x 256 on a CPU, 47 at 1,024 x 256) and the two estimates that judge it
        (:data:`~.call_work.CALL_WORK`'s). Each lower fill level judged beside it (:func:`~.greedy._best_fill`)
        costs its replicas and one estimate: :meth:`fill_level_cost_us`."""
        return (self.fill_us_per_replica * replicas
                + 2 * CALL_WORK.estimate_cost_us(world, num_experts))

    def fill_level_cost_us(self, replicas: int, world: int, num_experts: int) -> float:
        """A lower fill level of the proportional start judged beside the full one: its ``replicas`` and their
        estimate."""
        return self.fill_us_per_replica * replicas + CALL_WORK.estimate_cost_us(world, num_experts)


SEARCH_WORK = SearchWork()


@dataclass(frozen=True)
class RelativeBudget:
    """A search budget set by the layer it plans: ``share`` of the start placement's estimated layer time, within
    ``floor_us`` and ``cap_us``. Why: a search step costs about the same host time on any model, while what a
    re-plan can save scales with the layer. The estimate is the search's own setup (no second pass over the
    counts) and a function of inputs every rank holds alike, so every rank gets the same budget."""

    share: float
    floor_us: float
    cap_us: float

    def resolve(self, layer_s: float) -> float:
        return min(self.cap_us, max(self.floor_us, self.share * layer_s * 1e6))


Budget = Union[float, RelativeBudget, None]


def budget_upper_us(budget: Budget) -> Optional[float]:
    """The most work a budget can allow (a relative one's cap; None: unbounded), known before any estimate."""
    return budget.cap_us if isinstance(budget, RelativeBudget) else budget


@overload
def budget_us_for(budget: Union[float, RelativeBudget], layer_s: float) -> float: ...
@overload
def budget_us_for(budget: None, layer_s: float) -> None: ...
@overload
def budget_us_for(budget: Budget, layer_s: float) -> Optional[float]: ...
def budget_us_for(budget: Budget, layer_s: float) -> Optional[float]:
    """The budget of a search for a layer estimated at ``layer_s`` seconds: a relative one resolved, a number as it
    is, None (unbounded) as None."""
    return budget.resolve(layer_s) if isinstance(budget, RelativeBudget) else budget
