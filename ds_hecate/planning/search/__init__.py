"""Algorithm 1, sparse materialization: the search for the replicas each layer call gathers, and what drives it.

Pure numpy on inputs every rank holds alike, budgets counted in work units: every rank reaches the same placement.

- :mod:`.greedy`: the search (:func:`schedule_materialization`, a cost-driven greedy reworking the paper's
  Algorithm 1; :func:`search_steps`, the same as a generator of :class:`~.work.Progress`), its state
  (:mod:`.state`) and its moves (:mod:`.moves`); :mod:`.proportional`: the paper's proportional replicas, judged
  as one more start; :mod:`.settings`: :class:`SearchSettings`, what a search is asked for.
- :mod:`.work`, :mod:`.call_work`: the search's and the call's work models (estimated microseconds, not a clock).
- :mod:`.reuse`: whether the search re-runs (:class:`ScheduleReuse`); :mod:`.sliced`: a search spread over layer
  calls; :mod:`.record`: whether calibration's searches pay; :mod:`.critical_path`: what a call plans after its
  gate (:func:`plan_after_gate`: calibration and the dispatch plan).

Above it, :mod:`ds_hecate.planning.layer_planner` runs it per layer for the runtime and the simulator.
"""
from .call_work import CALL_WORK, CallWork, WorkMeter
from .critical_path import (AUTO_PLAN_BUDGET, AfterGate, calibration_affordable, calibration_extras,
                            calibration_settings, growth_calibration, plan_after_gate, shadow_calibration)
from .greedy import greedy_pass, schedule_materialization, search_steps
from .proportional import proportional_fill
from .record import SearchRecord
from .reuse import ScheduleReuse, load_shift
from .settings import SearchSettings
from .sliced import SlicedSearch
from .work import SEARCH_WORK, Progress, RelativeBudget, SearchWork

__all__ = ["AUTO_PLAN_BUDGET", "AfterGate", "CALL_WORK", "CallWork", "Progress", "RelativeBudget", "SEARCH_WORK",
           "ScheduleReuse", "SearchRecord", "SearchSettings", "SearchWork", "SlicedSearch", "WorkMeter",
           "calibration_affordable", "calibration_extras", "calibration_settings", "greedy_pass",
           "growth_calibration", "load_shift", "plan_after_gate", "proportional_fill", "schedule_materialization",
           "search_steps", "shadow_calibration"]
