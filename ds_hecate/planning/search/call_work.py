"""The host work of a layer call's planning after the gate, in estimated microseconds every run counts alike.

Why: the simulator charges Hecate's host planning to its step. Timed where the simulation runs (thread CPU time),
the charge of one cell moves by a quarter from run to run, and more under load: enough to flip cells within 0.5% of
a baseline.
Counted here instead, from what the call did (the prediction scored, the imbalance estimated, the shadow move's
estimates, calibration's search in :class:`~.work.SearchWork` units, the new placement's dispatch tables),
the same command gives the same tables on every machine and under any load.

The constants fit the medians of the runtime's own code timed on a CPU, caches swept between
trials, rounded up: a per-call part and a part per
(rank, expert) cell of the exchanged counts for each piece of work. The search's constants
(:class:`~.work.SearchWork`) are 90th percentiles, so the search is charged on the safe side.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallWork:
    """Microseconds of each piece of a call's planning: ``*_us`` per occurrence plus ``*_us_per_cell`` per
    (rank, expert) cell of the ``[ranks, experts]`` counts."""

    call_us: float = 100.0                  # the prediction's score and this rank's sends, receives and order
    call_us_per_cell: float = 0.003
    score_us: float = 100.0                 # the dispatch estimate of the imbalance check (a missed prediction)
    score_us_per_cell: float = 0.03
    estimate_us: float = 250.0              # one estimate_layer (the shadow move's)
    estimate_us_per_cell: float = 0.046
    tables_us: float = 350.0                # a placement made after the gate: its dispatch tables, this rank's part
    tables_us_per_cell: float = 0.046

    def call_cost_us(self, world: int, num_experts: int) -> float:
        return self.call_us + self.call_us_per_cell * world * num_experts

    def score_cost_us(self, world: int, num_experts: int) -> float:
        return self.score_us + self.score_us_per_cell * world * num_experts

    def estimate_cost_us(self, world: int, num_experts: int) -> float:
        return self.estimate_us + self.estimate_us_per_cell * world * num_experts

    def tables_cost_us(self, world: int, num_experts: int) -> float:
        return self.tables_us + self.tables_us_per_cell * world * num_experts


CALL_WORK = CallWork()


class WorkMeter:
    """What one call's planning did, summed in estimated microseconds (:class:`CallWork`, and the search's
    :class:`~.work.SearchWork` for calibration)."""

    def __init__(self) -> None:
        self.us = 0.0

    def add(self, us: float) -> None:
        self.us += us
