"""The prediction-driven search spread over layer calls, one slice of work at a time.

Why: the search runs on the host before the gate, after the previous layer's kernels were launched, and what it
takes beyond the window the preceding compute hides (T_nonMoE) delays the step. A fresh search costs tens of
milliseconds (simulated a100-4x8 bert-moe, 32 ranks x 64 experts: 16 ms; DeepSeek-V3 at 1,024 GPUs, 256-rank groups:
40-60 ms) against a window of about a millisecond, so every change of routing (a rotating hot spot, the first
prediction of a run) charged the difference to one step. Sliced, a search takes at most its slice of work per call
(at least one step, so that it ends) and goes on at the layer's next call while its prediction holds; until it ends
the call prefetches its best placement so far (the search is anytime). Where calibration last placed for the same
routing (:attr:`ScheduleReuse.calibrated`), the search starts from that placement, so its best is never worse.

Every rank slices at the same steps (the work is the search's work model, :class:`~.greedy.SearchWork`, not a
clock), so every rank prefetches the same placement at every call. A checkpoint records how many steps a search in
progress has taken; a resumed run replays them (:meth:`SlicedSearch.replay`) and goes on as the original.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Optional

import numpy as np

from ..plan import Materialized, materialized_of
from .work import Progress


@dataclass
class SlicedSearch:
    """One search in progress: its generator (:func:`~.greedy.search_steps`), the loads it plans for, the
    placement it began from where that is the remembered calibration, how many steps it has taken, where it
    stands."""

    steps: Generator[Progress, None, Materialized]
    loads: np.ndarray
    loads_total: float
    key: tuple
    begun_from: Optional[Materialized] = None      # the remembered calibration it started from (None: the start)
    taken: int = 0                                 # steps taken (what a checkpoint records)
    progress: Optional[Progress] = None            # before the next step; None before the first slice
    result: Optional[Materialized] = None          # set once the search ended
    _frozen: tuple = (None, None)                  # (the best matrix, it as expert lists): one freeze per best
    last_slice_us: float = 0.0                     # the work of the last advance (what the simulator charges)

    def advance(self, slice_us: float) -> bool:
        """Take steps while this call's work stays within ``slice_us`` (at least one step), and beyond it while the
        step just taken took more off the layer's estimate than it cost (its gain on this very call pays for the
        delay: later calls would have it anyway, one call later); True once the search ended (:attr:`result`).
        Why the second rule: the first steps of a search on skewed routing gain milliseconds each; deferred one a
        call they left DeepSeek-V3 W3 at 1,024 GPUs (simulated) running a poor placement for tens of steps."""
        used = self._setup()
        stepped = False
        while self.result is None:
            assert self.progress is not None   # _setup and _step leave a progress wherever there is no result
            if (stepped and used + self.progress.step_us > slice_us
                    and self.progress.last_gain_us <= self.progress.step_us):
                self.last_slice_us = used
                return False
            used += self.progress.step_us
            self._step()
            stepped = True
        self.last_slice_us = used
        return True

    def replay(self, taken: int) -> None:
        """Take ``taken`` steps at once (a resumed run catching up with the checkpointed search): the same
        generator states as the run that took them, whatever slices it took them in."""
        self._setup()
        while self.taken < taken and self.result is None:
            self._step()

    def _setup(self) -> float:
        """Build the search (its first yield) if not yet; the work that cost (0 when built already)."""
        if self.progress is not None or self.result is not None:
            return 0.0
        try:
            self.progress = next(self.steps)
        except StopIteration as end:   # a budget below the first step: the start, unsearched
            self.result = end.value
            return 0.0
        return self.progress.spent_us

    def _step(self) -> None:
        """One search step, to the next yield or the end."""
        self.taken += 1
        try:
            self.progress = next(self.steps)
        except StopIteration as end:
            self.result = end.value

    def interim(self) -> Materialized:
        """What the call prefetches while the search goes on: its best placement so far."""
        best = self.progress
        assert best is not None, "interim is asked after advance, which yields before the first step or ends"
        if self._frozen[0] is not best.best:   # a new best (the search copies its matrix when it improves)
            self._frozen = (best.best, materialized_of(best.best))
        return self._frozen[1]
