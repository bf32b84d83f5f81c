"""Whether calibration's search pays on this layer: the record of what its last searches saved against their cost.

Why: calibration (:mod:`.critical_path`) runs on the critical path, so its host time adds to the layer call on every
rank. Its cheap move, FasterMoE's growth (:func:`~.critical_path.growth_calibration`: the hottest experts in turn on
every rank with room, while the estimate falls, a few estimates), takes most of what a burst offers; the greedy
search (:func:`~.greedy.schedule_materialization`, from the prefetched placement) finds what it missed, at the
price of its setup and at least two steps, and the faster of the two is taken. On some layers that pays on every
call (a hot set the growth cannot spread without flooding the links: simulated W4); on others it almost never does.
On a small layer (two CPU ranks, the demo trace's routing) the search's placement beats the growth's by about
0.05 ms for about 3 ms of host time per search: searching every call makes ds_hecate slower than FasterMoE-style
shadowing although its compute ties. So each layer keeps the net of its last :data:`RECORD_LENGTH` searches
(estimated layer time saved below the growth's placement, minus the search's work, both in microseconds of the same
call) and searches while that sum is positive; after :data:`PROBE_INTERVAL` calibrations without a search it
searches again, since the routing may have moved to where searches pay. Where a whole search (its budget) costs at
most :data:`NEGLIGIBLE_SHARE` of the layer's estimated time, the record is not consulted: one search of the few that
beat the growth repays many that lose (256 ranks x 256 experts, top-8 bursts: on a layer of about 0.9 s one search
that beats the growth can save 0.1 s, the price of five 20 ms searches, so a record of losses must not stop the
next). Deterministic: every input is identical on every rank (the counts,
the cost model, the search's work model), so every rank takes the same decision; the record travels with the
schedule in checkpoints (:meth:`~.reuse.ScheduleReuse.state_dict`) so a resumed run decides the same.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Optional

#: how many of a layer's last calibration searches decide whether the next one runs
RECORD_LENGTH = 4
#: calibrations a layer goes without a search, while its record says searches do not pay, before it searches again
PROBE_INTERVAL = 8
#: the search's budget as a share of the layer's estimated time at or below which it runs whatever the record says:
#: half the automatic budget's share (:data:`~.critical_path.AUTO_BUDGET_SHARE`), so it applies where that budget is
#: capped (layers of 0.8 s and more) or set that low; layers on the automatic budget's 5% and the simulated 32-GPU
#: cells (5% or more) keep the record
NEGLIGIBLE_SHARE = 0.025


class SearchRecord:
    """The net of a layer's last calibration searches (microseconds each: estimated layer time the search saved
    below its start, minus its work) and the calibrations since the last one."""

    def __init__(self) -> None:
        self.nets_us: Deque[float] = deque(maxlen=RECORD_LENGTH)
        self.unsearched = 0

    def pays(self, budget_share: float = float("inf")) -> bool:
        """Whether the next calibration searches: its budget is at most :data:`NEGLIGIBLE_SHARE` of the layer's
        estimate (``budget_share``), no record yet, the last searches' nets sum above zero, or :data:`PROBE_INTERVAL`
        calibrations went without one."""
        return (budget_share <= NEGLIGIBLE_SHARE or not self.nets_us or sum(self.nets_us) > 0.0
                or self.unsearched >= PROBE_INTERVAL)

    def searched(self, saved_us: float, work_us: float) -> None:
        """A calibration searched: it took ``saved_us`` off the layer's estimate below its start, for ``work_us``."""
        self.nets_us.append(float(saved_us) - float(work_us))
        self.unsearched = 0

    def skipped(self) -> None:
        """A calibration took the growth's placement without a search."""
        self.unsearched += 1

    def state_dict(self) -> dict:
        return {"nets_us": list(self.nets_us), "unsearched": self.unsearched}

    @staticmethod
    def state_fits(state: Optional[dict]) -> bool:
        """Whether a saved record (None: none saved, an older checkpoint) is well formed."""
        if state is None:
            return True
        try:
            nets = [float(v) for v in state["nets_us"]]
            return len(nets) <= RECORD_LENGTH and int(state["unsearched"]) >= 0
        except (KeyError, TypeError, ValueError):
            return False

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint from before the record) starts an empty record."""
        self.nets_us = deque((float(v) for v in (state or {}).get("nets_us", [])), maxlen=RECORD_LENGTH)
        self.unsearched = int((state or {}).get("unsearched", 0))
