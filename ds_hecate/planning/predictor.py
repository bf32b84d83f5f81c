"""Load prediction: the next iteration's per-(rank, expert) token-expert pairs from a sliding window.

The paper (§4.2) averages the last w iterations (w = 5): ``load_predictor: "mean"``. The default, ``"robust"``,
averages only the window's observations that agree with its majority, so that

- a one-step burst (benchmark W7) does not leak a fifth of itself into the next four predictions, each of which
  would prefetch replicas for a hot expert that is no longer hot, and
- after the routing moves for good (W6, a rotating hot spot) the prediction follows as soon as most of the window
  has seen the new routing (3 of 5 calls), where the plain mean mixes old and new for all 5.

Agreement is judged on each observation's marginals (pairs per source rank and per expert: ``world + experts``
numbers, not ``world x experts``, so the check costs far less than the average itself at 1,024 x 256) against their
elementwise median over the window. Whether the newest observation agrees (:attr:`LoadPredictor.newest_agrees`) is
what the planner uses to decide if a prediction is worth prefetching for: a window whose latest call is an outlier
(a burst, or the first calls after a move) does not predict the next one. The window holds the all-gathered
counts, so every rank holds the same window and predicts the same loads.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional

import numpy as np

from .plan import FloatMatrix

Matrix = List[List[float]]

#: ``hecate.load_predictor`` values
PREDICTORS = ("robust", "mean")

#: an observation agrees with the window when its marginals are within this L1 share of the median's (or of
#: NOISE_FACTOR times their sampling noise, if larger: tests and small worlds have few pairs per rank)
AGREEMENT_TOLERANCE = 0.05
NOISE_FACTOR = 1.5


def window_median(margins: np.ndarray) -> np.ndarray:
    """Elementwise median over the first axis, as ``np.median(margins, axis=0)`` computes it (the middle value, or
    the mean of the two middle ones): one sort of a few rows, where ``np.median``'s generic reduction costs ten times
    as much on these small windows (35 us against 3.5 us for 5 x 10 values on a CPU; the
    prediction runs on every layer call)."""
    ordered = np.sort(margins, axis=0)
    n = ordered.shape[0]
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2.0


def _marginals(matrix: np.ndarray) -> np.ndarray:
    """Pairs per source rank, then per expert: what a burst or a moved hot spot changes."""
    return np.concatenate([matrix.sum(axis=1), matrix.sum(axis=0)])


class LoadPredictor:
    """Sliding window of count matrices ``[world][experts]`` kept as numpy arrays (ranks x experts x w numbers,
    which Python lists turn into tens of milliseconds per layer at 1,024 ranks), predicting their average:
    of every observation (``statistic="mean"``, the paper's, which the simulated baselines keep) or of those that
    agree with the window's majority (``"robust"``, what Hecate's planner uses by default; see the module
    docstring)."""

    def __init__(self, window: int, statistic: str = "mean") -> None:
        if window < 1:
            raise ValueError(f"load window must be >= 1, got {window}")
        if statistic not in PREDICTORS:
            raise ValueError(f"load predictor must be one of {PREDICTORS}, got {statistic!r}")
        self.window = window
        self.statistic = statistic
        self._history: Deque[np.ndarray] = deque(maxlen=window)
        #: each observation's marginals, computed when agreement is first judged (None until then: the plain mean,
        #: short windows and a planner that predicts nothing never need them)
        self._margins: Deque[Optional[np.ndarray]] = deque(maxlen=window)
        #: whether the newest observation agrees with the window (set by :meth:`predict_array`)
        self.newest_agrees = True

    def __len__(self) -> int:
        return len(self._history)

    def push(self, counts: FloatMatrix) -> None:
        matrix = np.array(counts, dtype=np.float64)
        if matrix.ndim != 2 or (self._history and matrix.shape != self._history[0].shape):
            raise ValueError("LoadPredictor.push: count matrix shape changed within the window")
        self._history.append(matrix)
        self._margins.append(None)

    def agreeing(self) -> np.ndarray:
        """Bool per observation (oldest first): within the agreement share of the window's median marginals. All
        true for the plain mean and for windows of at most two observations (no majority to speak of)."""
        n = len(self._history)
        if self.statistic == "mean" or n <= 2:
            return np.ones(n, dtype=bool)
        margins = np.stack([m if m is not None else _marginals(h) for m, h in zip(self._margins, self._history)])
        self._margins = deque(margins, maxlen=self.window)
        median = window_median(margins)
        total = float(median.sum())
        if total <= 0.0:
            return margins.sum(axis=1) <= 0.0
        noise = float(np.sqrt(median * (2.0 / np.pi)).sum()) / total
        distance = np.abs(margins - median).sum(axis=1) / total
        return distance <= max(AGREEMENT_TOLERANCE, NOISE_FACTOR * noise)

    def predict_array(self) -> Optional[np.ndarray]:
        """Average count matrix over the window's agreeing observations (all of them when none agrees: routing
        without a majority) as a ``[world, experts]`` array; None before the first observation. Sets
        :attr:`newest_agrees`."""
        if not self._history:
            self.newest_agrees = True
            return None
        keep = self.agreeing()
        self.newest_agrees = bool(keep[-1])
        chosen = [m for m, k in zip(self._history, keep) if k] if keep.any() else list(self._history)
        return np.mean(np.stack(chosen), axis=0) if len(chosen) > 1 else chosen[0].copy()

    def predict(self) -> Optional[Matrix]:
        """:meth:`predict_array` as nested lists."""
        pred = self.predict_array()
        return None if pred is None else pred.tolist()

    def expert_loads(self) -> Optional[List[float]]:
        """Predicted global load per expert (summed over source ranks)."""
        pred = self.predict_array()
        return None if pred is None else pred.sum(axis=0).tolist()

    def state_dict(self) -> dict:
        return {"window": self.window, "history": [m.tolist() for m in self._history]}

    def load_state_dict(self, state: dict) -> None:
        self._history = deque((np.array(m, dtype=np.float64) for m in state["history"]), maxlen=self.window)
        self._margins = deque((None for _ in self._history), maxlen=self.window)
