"""Reuse of the last schedule, and the score of the load prediction after each gate.

Why a module of its own: the search (:mod:`.greedy`) is what runs; this decides *whether* it runs: before the
gate (is the last placement still good for the predicted loads?) and after it (did the prediction hold; can
calibration pay?). Everything here is a deterministic function of loads every rank holds alike.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from ..plan import FloatMatrix, IntMatrix, Materialized, holders_matrix
from .call_work import CALL_WORK, WorkMeter
from ..cost_model import imbalance
from ..dispatch import dispatch_flows
from .greedy import schedule_materialization, search_steps
from .record import SearchRecord
from .settings import SearchSettings
from .sliced import SlicedSearch


def load_shift(before: FloatMatrix, after: FloatMatrix,
               before_total: Optional[float] = None) -> float:
    """How far the (source rank, expert) loads moved: L1 distance over the total of ``before`` (0 = unchanged).

    An empty ``before`` counts as moved entirely unless ``after`` is empty too. Arrays are used as they are (no
    copy): this runs on every layer call, over ranks x experts numbers; ``before_total`` is ``before``'s sum when
    the caller keeps it (one pass fewer).
    """
    a = before if isinstance(before, np.ndarray) else np.asarray(before, dtype=np.float64)
    b = after if isinstance(after, np.ndarray) else np.asarray(after, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    total = float(a.sum()) if before_total is None else before_total
    moved = np.subtract(b, a, dtype=np.float64)
    diff = float(np.abs(moved, out=moved).sum())
    if total <= 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / total


#: A call misses its prediction only beyond this multiple of the sampling noise a correct prediction still has.
NOISE_FACTOR = 1.5


def compute_imbalance(counts: np.ndarray, materialized, ranks_per_node: int) -> float:
    """Max/mean expert compute per rank when ``counts`` (``[ranks, experts]``) are dispatched over ``materialized``
    (one dispatch estimate: :func:`~.dispatch.dispatch_flows`)."""
    holders = holders_matrix(materialized, *counts.shape)
    return imbalance(dispatch_flows(counts.T, holders.T, ranks_per_node).processed.sum(axis=0).tolist())


def sampling_noise(loads) -> float:
    """Expected L1 shift (over the total) of fresh counts drawn around ``loads``: cells are multinomial draws, so
    even a perfect prediction misses each by about sqrt(2 * load / pi). With many ranks and experts and few pairs per
    cell (1,024 ranks x 256 experts, top-2: 64 pairs a cell, 10% noise) this alone exceeds ``replan_tolerance``;
    without it calibration would fire, and cost the critical path, on every call for nothing."""
    a = np.asarray(loads, dtype=np.float64)
    total = float(a.sum())
    return float(np.sqrt(a * (2.0 / np.pi)).sum()) / total if total > 0 else 0.0


class ScheduleReuse:
    """The last schedule and what it was computed for, so an unchanged situation does not pay for a new search.

    Why: the greedy search costs milliseconds per layer and call, while the predicted loads (a window average) move
    by about a percent a step once routing settles; re-planning then returns the same placement, or one whose
    estimate differs by noise. A schedule is reused while the owners, the cost model and the replica budget are
    unchanged (its :class:`~.settings.SearchSettings` and start) and the loads moved by at most ``tolerance``
    (:func:`load_shift`) from the loads it was computed for;
    ``tolerance`` 0 re-plans on every change. All inputs are identical on every rank, so every rank makes the same
    choice. ``planned_for`` tells calibration which loads the prefetched placement assumed.

    After each gate it scores the prediction (:meth:`after_gate`) to decide whether calibration can pay. Whether a
    prediction is worth prefetching for at all is the load window's own judgement
    (:attr:`~.predictor.LoadPredictor.newest_agrees`).

    It also remembers the last placement calibration made and the counts it was made for (:attr:`calibrated`).
    Why: after routing moves for good (W6, a rotating hot spot) the window needs a few calls to follow, and each
    of them, and then the first search on the new prediction, would plan again for the same routing: three
    critical-path searches and one fresh search per move (simulated a100-4x8 bert-moe W6: 6 ms and 16 ms of host
    time per layer call). Calibration takes the remembered placement without a search while the counts stay
    within the miss threshold of what it was made for. The search before the gate does not adopt it: calibration
    stops where a step costs more host time than it saves on this call, the search goes on while a step pays
    over the calls the schedule serves (adopted, the steady state of simulated v100-4x8 bert-moe W1 ran 4%
    slower, 6.94x of EP instead of 7.17x).
    """

    def __init__(self, tolerance: float) -> None:
        if not 0.0 <= tolerance <= 1.0:
            raise ValueError(f"ScheduleReuse: tolerance must be in [0, 1], got {tolerance}")
        self.tolerance = tolerance
        self.planned_for: Optional[np.ndarray] = None
        self.placement: Optional[Materialized] = None
        self._key: Optional[tuple] = None
        self.searches = 0
        self.reuses = 0
        self._noise: Optional[float] = None   # sampling_noise(planned_for), computed with the search
        self._planned_total: Optional[float] = None   # planned_for's sum, scored against on every call
        #: a search spread over calls, in progress (:mod:`.sliced`)
        self.pending: Optional[SlicedSearch] = None
        #: (placement, counts it was made for, owners) of the last calibration that changed the prefetched placement
        self.calibrated: Optional[Tuple[Materialized, np.ndarray, Tuple[int, ...]]] = None
        #: whether the last :meth:`after_gate` estimated the dispatch's imbalance; the work of the last
        #: :meth:`schedule` call's search (:class:`~.work.SearchWork` microseconds, 0 when reused)
        self.scored = False
        self.last_work_us = 0.0
        #: whether calibration's search pays on this layer (:mod:`.record`)
        self.search_record = SearchRecord()
        #: (placement, the loads it was planned for, its compute imbalance): :meth:`planned_imbalance`'s answer
        self._imbalance: Tuple[Optional[Materialized], Optional[np.ndarray], float] = (None, None, 1.0)

    def schedule(self, counts: FloatMatrix, owners: Sequence[int], settings: SearchSettings,
                 start: Optional[IntMatrix] = None, slice_us: Optional[float] = None) -> Materialized:
        """:func:`schedule_materialization` of ``counts``, or the previous result when it still applies.

        ``slice_us``: spread a search over calls, at most this much of its work per call (at least one step,
        :mod:`.sliced`); until it ends each call gets its interim placement, planned for the loads the
        search started on. A search in progress goes on while the situation holds and the loads stay within
        ``tolerance`` of those; else it is dropped. None: the whole search in this call."""
        key = self._situation(owners, settings, start)
        self.last_work_us = 0.0
        pending = self.pending
        if pending is not None and (pending.key != key
                                    or load_shift(pending.loads, counts, pending.loads_total) > self.tolerance):
            self.pending = pending = None   # planned for a situation that no longer holds
        if pending is None:
            if (self.placement is not None and key == self._key and self.planned_for is not None
                    and load_shift(self.planned_for, counts, self._planned_total) <= self.tolerance):
                self.reuses += 1
                return self.placement
            self.searches += 1
            loads = counts if isinstance(counts, np.ndarray) else np.array(counts, dtype=np.float64)
            if slice_us is None:
                meter = WorkMeter()
                self.placement = schedule_materialization(counts, owners, settings, start=start, meter=meter)
                self.last_work_us = meter.us
                self._plan_for(loads)
                self._key = key
                return self.placement
            pending = self.pending = self._start_search(
                loads, owners, settings, start, key, self._search_start(loads, owners, settings.replica_budget, start))
        assert slice_us is not None   # a search in progress exists only where the calls slice it
        ended = pending.advance(slice_us)
        self.last_work_us = pending.last_slice_us
        if ended:
            assert pending.result is not None   # advance says the search ended once it has its result
            self.pending = None
            self.placement = pending.result
        else:
            self.placement = pending.interim()
        if self.planned_for is not pending.loads:
            self._plan_for(pending.loads)
        self._key = key
        return self.placement

    def planned_imbalance(self, ranks_per_node: int, meter: Optional[WorkMeter] = None) -> float:
        """Max/mean expert compute of the current schedule on the loads it was planned for (1.0 without one).

        Why: a schedule that keeps tokens on their node (the search's node exchange) runs the compute a little
        imbalanced on purpose, and calibration's shadow move is judged balanced against this, not against 1.0.
        Computed when first asked for a schedule (one dispatch estimate, added to ``meter``), so only on the calls
        that try the shadow move, a burst's: computed with every search it added 0.2 ms of host work to each, a
        millisecond a step where the routing keeps moving (simulated a100-4x8 gpt-moe-s W6)."""
        if self.placement is None or self.planned_for is None:
            return 1.0
        if self._imbalance[0] is not self.placement or self._imbalance[1] is not self.planned_for:
            loads = np.asarray(self.planned_for, dtype=np.float64)
            self._imbalance = (self.placement, self.planned_for,
                               max(1.0, compute_imbalance(loads, self.placement, ranks_per_node)))
            if meter is not None:
                meter.add(CALL_WORK.score_cost_us(*loads.shape))
        return self._imbalance[2]

    def _start_search(self, loads: np.ndarray, owners, settings: SearchSettings, start, key: tuple,
                      begun_from: Optional[Materialized]) -> SlicedSearch:
        """A sliced search for ``loads`` from ``begun_from`` (the remembered calibration, where it fits them:
        :meth:`_search_start`; a checkpointed search's own), else from ``start``.

        Why from the remembered calibration: it was placed for these very routings, so the search only refines it
        instead of rebuilding it replica by replica (simulated a100-4x8 bert-moe W6: a fresh search after each move
        of the hot spot took 9 ms of host time on a CPU beyond what the non-MoE compute
        hides; from the remembered placement a step or two), and its best is never worse than that placement."""
        steps = search_steps(loads, owners, settings, start=start if begun_from is None else begun_from)
        return SlicedSearch(steps, loads, float(loads.sum()), key, begun_from)

    def _search_start(self, loads: np.ndarray, owners, budget_per_rank: int, start) -> Optional[Materialized]:
        """The remembered calibration where it serves ``loads`` as a schedule would (a search then starts from it),
        else None."""
        fits = self._remembered(loads, owners, budget_per_rank, self.tolerance, start=start) is not None
        return self.calibrated[0] if fits and self.calibrated is not None else None

    def _remembered(self, counts: np.ndarray, owners, budget_per_rank: int, threshold: float,
                    joined: Optional[np.ndarray] = None, start=None) -> Optional[np.ndarray]:
        """The remembered calibration's holders (``[ranks, experts]`` bool, joined with ``joined`` if given) where it
        serves ``counts``: same owners, made for counts within ``threshold`` (an L1 share) of them, at most
        ``budget_per_rank`` replicas per rank, holding ``start`` if given; else None."""
        if self.calibrated is None:
            return None
        placement, made_for_counts, made_for = self.calibrated
        if made_for != tuple(int(o) for o in owners) or made_for_counts.shape != counts.shape:
            return None
        if load_shift(made_for_counts, counts) > threshold:
            return None
        holders = holders_matrix(placement, *counts.shape)
        if joined is not None:
            holders = holders | joined
        owned = np.bincount(np.asarray(made_for, dtype=np.int64), minlength=counts.shape[0])
        if int((holders.sum(axis=1) - owned).max()) > budget_per_rank:
            return None
        if start is not None and (holders_matrix(start, *counts.shape) & ~holders).any():
            return None
        return holders

    def remember_calibration(self, placement: Materialized, counts: np.ndarray, owners: Sequence[int]) -> None:
        """Keep what calibration placed for ``counts`` (see the class docstring)."""
        self.calibrated = (placement, np.asarray(counts, dtype=np.float64), tuple(int(o) for o in owners))

    def calibrated_fit(self, counts: np.ndarray, owners: Sequence[int], prefetched: np.ndarray,
                       budget_per_rank: int) -> Optional[np.ndarray]:
        """The remembered calibration's holders joined with ``prefetched`` (``[ranks, experts]`` bool), when
        ``counts`` are within the miss threshold of the counts it was made for (the tolerance, or the sampling
        noise a correct prediction still has), the owners are the same and the join fits ``budget_per_rank``
        replicas per rank; else None. Calibration then places without a search."""
        if self.calibrated is None:
            return None
        threshold = max(self.tolerance, NOISE_FACTOR * sampling_noise(self.calibrated[1]))
        return self._remembered(np.asarray(counts, dtype=np.float64), owners, budget_per_rank, threshold,
                                joined=prefetched)

    def _plan_for(self, loads: Optional[np.ndarray]) -> None:
        """Take ``loads`` as what the schedule was planned for, with their sum and sampling noise computed here,
        with the search: computed on the first call that scored against them, the noise cost that call 2x the
        others' critical path (256 x 256 balanced: 241 against 124 us on a CPU), the
        critical path's p99 at 3x its median."""
        self.planned_for = loads
        self._noise = None if loads is None else sampling_noise(loads)
        self._planned_total = None if loads is None else float(loads.sum())

    @staticmethod
    def _situation(owners, settings: SearchSettings, start=None) -> tuple:
        """What a schedule was computed for besides the loads: reused only while all of it is unchanged."""
        if start is None or isinstance(start, tuple):   # the planner's start layout: a tuple, reused as is
            start_key = start
        else:
            start_key = tuple(tuple(int(e) for e in r) for r in start)
        return (tuple(int(o) for o in owners), settings, start_key)

    def miss_threshold(self) -> float:
        """How far actual counts may move from the loads a placement was planned for and still count as predicted:
        ``tolerance``, or :data:`NOISE_FACTOR` times those loads' sampling noise if larger."""
        return max(self.tolerance, NOISE_FACTOR * (self._noise or 0.0))

    def still_fits(self, counts: FloatMatrix) -> bool:
        """Whether ``counts`` are within :meth:`miss_threshold` of the loads the current schedule was computed for."""
        return (self.planned_for is not None
                and load_shift(self.planned_for, counts, self._planned_total) <= self.miss_threshold())

    def after_gate(self, counts: FloatMatrix, materialized: IntMatrix,
                   ranks_per_node: int, scheduled: bool = True) -> bool:
        """Score this call's prefetched placement and say whether calibration (a re-plan after the gate) can pay.

        Calibration can pay when the actual ``counts`` left :meth:`miss_threshold` of the loads the prefetched
        placement was planned for (the tolerance, or the sampling noise a correct prediction still has) *and* under
        that placement they leave the ranks' expert compute imbalanced (max/mean) by more
        than the tolerance: a balanced step has nothing to fix, and the search would only cost time (about a
        millisecond per layer on a CPU). Only the loads the placement was planned for decide: after a search they are
        the window's prediction for this call; while the schedule is reused, older loads, and how far the call moved
        from the newer prediction decides nothing (scoring it too cost a second L1 pass, 20-50 us of a 64 x 256 call
        on a CPU, and an imbalance estimate whose answer was dropped).

        ``scheduled`` False: the prefetched placement is not this schedule (only the owners and the start layout
        were prefetched, the window's newest call being an outlier), so it was planned for no loads at all and only
        the imbalance decides; the schedule itself stays for the calls after the outlier."""
        # the counts as they came (int64 from the exchange: load_shift subtracts in float64 without a converted
        # copy, 15 us of a 64 x 256 call on a CPU); a float copy only for the estimate below
        actual = counts if isinstance(counts, np.ndarray) else np.asarray(counts, dtype=np.float64)
        off_plan = not scheduled or not self.still_fits(actual)
        imbalanced = False
        self.scored = off_plan   # the dispatch estimate below ran (work the simulator charges)
        if self.scored:   # the usual case, a held prediction, needs no dispatch estimate
            imbalanced = compute_imbalance(actual, materialized, ranks_per_node) > 1.0 + self.tolerance
        return off_plan and imbalanced

    def reset(self) -> None:
        self.placement, self._key, self.pending = None, None, None
        self._plan_for(None)

    def state_dict(self) -> dict:
        """What a resumed run needs to make the same reuse decisions (bitwise resume)."""
        state: dict = {}
        if self.placement is not None:
            assert self._key is not None   # set with every placement
            state.update(planned_for=np.asarray(self.planned_for).tolist(),
                         placement=[list(r) for r in self.placement],
                         owners=list(self._key[0]))
        if self.calibrated is not None:
            placement, loads, owners = self.calibrated
            state["calibrated"] = {"placement": [list(r) for r in placement], "counts": loads.tolist(),
                                   "owners": list(owners)}
        if self.search_record.nets_us or self.search_record.unsearched:
            state["search_record"] = self.search_record.state_dict()
        if self.pending is not None:   # replayed on load: the same steps, so the same interim placements after
            p = self.pending
            state["pending"] = {"loads": p.loads.tolist(), "taken": p.taken, "owners": list(p.key[0]),
                                "begun_from": None if p.begun_from is None else [list(r) for r in p.begun_from]}
        return state

    @staticmethod
    def state_fits(state: dict, world_size: int, num_experts: int) -> bool:
        """Whether ``state`` (from :meth:`state_dict`, e.g. read back from a checkpoint) can belong to a layer of
        ``num_experts`` experts on ``world_size`` ranks: shapes, expert and rank ranges, owners inside the
        placement."""
        try:
            if not all(isinstance(m, bool) for m in state.get("misses", [])):
                return False
            if not SearchRecord.state_fits(state.get("search_record")):
                return False
            if "calibrated" in state and not ScheduleReuse._placement_fits(state["calibrated"]["placement"],
                                                                           state["calibrated"]["counts"],
                                                                           state["calibrated"]["owners"],
                                                                           world_size, num_experts):
                return False
            if "pending" in state:
                pending = state["pending"]
                if int(pending["taken"]) < 0 or not ScheduleReuse._placement_fits(
                        pending.get("begun_from"), pending["loads"], pending["owners"], world_size, num_experts):
                    return False
            if "placement" not in state:
                return True
            return ScheduleReuse._placement_fits(state["placement"], state["planned_for"], state["owners"],
                                                 world_size, num_experts)
        except (AttributeError, KeyError, TypeError, ValueError):
            return False

    @staticmethod
    def _placement_fits(placement, loads, owners, world_size: int, num_experts: int) -> bool:
        """A saved placement (None: none saved) with the loads it was made for and its owners: shapes, ranges,
        owners inside it (raises on malformed entries; :meth:`state_fits` turns that into False)."""
        loads = [[float(v) for v in row] for row in loads]
        owners = [int(o) for o in owners]
        if not (len(loads) == world_size and len(owners) == num_experts and all(0 <= o < world_size for o in owners)
                and all(len(row) == num_experts for row in loads)):
            return False
        if placement is None:
            return True
        placement = [{int(e) for e in r} for r in placement]
        return (len(placement) == world_size and all(0 <= e < num_experts for r in placement for e in r)
                and all(e in placement[o] for e, o in enumerate(owners)))

    def load_state_dict(self, state: dict, settings: SearchSettings,
                        start: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Restore :meth:`state_dict`; the owners come from the state (the schedule may predate a re-sharding, which
        the next call then notices), the rest of the situation (``start`` included) from the caller."""
        self.reset()   # an older checkpoint's "misses" record (a retired rule) is ignored
        if "placement" in state:
            self._plan_for(np.array(state["planned_for"], dtype=np.float64))
            self.placement = tuple(tuple(int(e) for e in r) for r in state["placement"])
            self._key = self._situation(state["owners"], settings, start)
        self.search_record.load_state_dict(state.get("search_record"))
        self.calibrated = None
        if "calibrated" in state:
            saved = state["calibrated"]
            self.remember_calibration(tuple(tuple(int(e) for e in r) for r in saved["placement"]),
                                      np.array(saved["counts"], dtype=np.float64), saved["owners"])
        if "pending" in state:
            saved = state["pending"]
            loads = np.array(saved["loads"], dtype=np.float64)
            owners = tuple(int(o) for o in saved["owners"])
            key = self._situation(owners, settings, start)
            # a search checkpointed before searches began from the remembered calibration (its "fallback", only
            # prefetched while estimated faster) began from the start: replayed so, the same steps
            begun = saved.get("begun_from")
            begun_from = None if begun is None else tuple(tuple(int(e) for e in r) for r in begun)
            self.pending = self._start_search(loads, owners, settings, start, key, begun_from)
            self.pending.replay(int(saved["taken"]))
            self._plan_for(self.pending.loads)
