"""What a search is asked for besides the loads and the placement it starts from: one frozen object.

Why one object: the search's entry (:func:`~.greedy.schedule_materialization`), its generator
(:func:`~.greedy.search_steps`), its passes, the sliced search (:class:`~.reuse.ScheduleReuse`) and calibration
(:mod:`.critical_path`) all pass the same settings down; as a parameter list they were fourteen names repeated at
every level. Frozen and compared by value, so a schedule computed under equal settings is reused
(:meth:`~.reuse.ScheduleReuse.schedule`). Every field is identical on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost_model import StepCostModel
from .work import SEARCH_WORK, Budget, SearchWork


@dataclass(frozen=True)
class SearchSettings:
    """The search's settings.

    ``costs``: the cost model the search estimates the layer with. ``replica_budget``: extra experts a rank may
    hold (``materialize_budget_mb`` in experts). ``ranks_per_node``: the node size of the dispatch rule and the
    links. ``budget_us``: the work budget (estimated microseconds of :class:`~.work.SearchWork`, a
    :class:`~.work.RelativeBudget`, or None: unbounded). ``candidate_experts`` / ``candidate_ranks``: how many of
    the bottleneck's experts, and of the least-loaded open ranks, a step tries (:func:`~.moves.candidate_moves`).
    ``min_gain``: the fraction a result must beat its start by to be kept (predicted loads are noisy).
    ``work``: the work model that prices steps. ``critical_path``: every rank waits for this search (calibration
    after the gate): it stops once its last steps cost more than they saved, and never proposes the node exchange
    (:func:`~.greedy.greedy_steps`)."""

    costs: StepCostModel
    replica_budget: int
    ranks_per_node: int
    budget_us: Budget = None
    candidate_experts: int = 4
    candidate_ranks: int = 64
    min_gain: float = 0.05
    work: SearchWork = SEARCH_WORK
    critical_path: bool = False
