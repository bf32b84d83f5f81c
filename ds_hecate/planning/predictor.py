"""Load prediction: the next iteration's per-(rank, expert) token-expert pairs from a sliding window.

The paper (§4.2) averages the last w iterations (w = 5). The window holds the all-gathered counts, so every rank
holds the same window and predicts the same loads.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional, Sequence

import numpy as np

Matrix = List[List[float]]


class LoadPredictor:
    """Sliding-window average of count matrices ``[world][experts]``, kept as numpy arrays: the window is
    ranks x experts x w numbers, which Python lists turn into tens of milliseconds per layer at 1,024 ranks."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"load window must be >= 1, got {window}")
        self.window = window
        self._history: Deque[np.ndarray] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._history)

    def push(self, counts: Sequence[Sequence[float]]) -> None:
        matrix = np.array(counts, dtype=np.float64)
        if matrix.ndim != 2 or (self._history and matrix.shape != self._history[0].shape):
            raise ValueError("LoadPredictor.push: count matrix shape changed within the window")
        self._history.append(matrix)

    def predict_array(self) -> Optional[np.ndarray]:
        """Average count matrix over the window as a ``[world, experts]`` array; None before the first observation."""
        if not self._history:
            return None
        return np.mean(np.stack(self._history), axis=0) if len(self._history) > 1 else self._history[0].copy()

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
