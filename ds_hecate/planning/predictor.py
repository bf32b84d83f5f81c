"""Load prediction: the next iteration's per-(rank, expert) token-expert pairs from a sliding window.

The paper (§4.2) averages the last w iterations (w = 5). The window holds the all-gathered counts, so every rank
holds the same window and predicts the same loads.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional, Sequence

Matrix = List[List[float]]


class LoadPredictor:
    """Sliding-window average of count matrices ``[world][experts]``."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"load window must be >= 1, got {window}")
        self.window = window
        self._history: Deque[List[List[float]]] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._history)

    def push(self, counts: Sequence[Sequence[float]]) -> None:
        matrix = [list(row) for row in counts]
        if self._history and (len(matrix) != len(self._history[0])
                              or any(len(row) != len(self._history[0][0]) for row in matrix)):
            raise ValueError("LoadPredictor.push: count matrix shape changed within the window")
        self._history.append(matrix)

    def predict(self) -> Optional[Matrix]:
        """Average count matrix over the window; None before the first observation."""
        if not self._history:
            return None
        n = len(self._history)
        world, experts = len(self._history[0]), len(self._history[0][0])
        return [[sum(h[r][e] for h in self._history) / n for e in range(experts)] for r in range(world)]

    def expert_loads(self) -> Optional[List[float]]:
        """Predicted global load per expert (summed over source ranks)."""
        pred = self.predict()
        if pred is None:
            return None
        return [sum(row[e] for row in pred) for e in range(len(pred[0]))]

    def state_dict(self) -> dict:
        return {"window": self.window, "history": [[list(row) for row in m] for m in self._history]}

    def load_state_dict(self, state: dict) -> None:
        self._history = deque(([list(row) for row in m] for m in state["history"]), maxlen=self.window)
