"""The order the MoE layers run in a model pass, learnt from the first pass, and the prefetch it drives.

A layer's SparseAllGather is issued ahead of its call, right after the previous layer's call ends (or, for the first
layer, when the model forward starts), so that the weights travel while the layers in between compute. Which layer
is next is learnt from the first forward: the layers in the order they ran until one runs a second time, or the
next forward starts. Recomputes (activation checkpointing) replay calls and teach nothing.
"""
from __future__ import annotations

from typing import Generic, List, Optional, Sequence, TypeVar

Layer = TypeVar("Layer")


class CallSequence(Generic[Layer]):
    """``layers``: the runtime's layers in registration order (held, not copied: layers added later count)."""

    def __init__(self, layers: Sequence[Layer]) -> None:
        self.layers = layers
        self.order: List[int] = []
        self.fixed = False

    def called(self, index: int, recompute: bool) -> None:
        """Layer ``index`` runs a forward call (a recompute when ``recompute``)."""
        if recompute or self.fixed:
            return
        if index in self.order:
            self.fixed = True   # a layer called twice: the order of one pass is known
        else:
            self.order.append(index)

    def first(self) -> Optional[Layer]:
        """A model forward starts: the order learnt so far is the order; the layer that runs first."""
        if not self.order:
            return None
        self.fixed = True
        return self.layers[self.order[0]]

    def after(self, index: int) -> Optional[Layer]:
        """The layer that runs after layer ``index``, if known."""
        if index not in self.order:
            return None
        position = self.order.index(index)
        return self.layers[self.order[position + 1]] if position + 1 < len(self.order) else None


__all__ = ["CallSequence"]
