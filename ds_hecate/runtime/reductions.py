"""The SparseReduceScatters a backward issues, completed in issue order: where the expert compute hands them.

A layer call's backward ends with its experts' weight gradients in place (the owned ones in the owner's accumulator,
the replicas' in the rows to send) and one SparseReduceScatter issued on every rank (:class:`ReductionQueue.issue`),
asynchronously: the rest of backward runs while it is in flight. ``engine.backward`` completes them
(:meth:`ReductionQueue.flush`), adding the received copies into the owners' accumulators. At the accumulation
boundary with expert state partitioned over expert-data-parallel peers, each completed layer goes on to its
reduction over the peers at once (``on_complete``), and every issue completes the ones before it: the whole fp32
gradient rows of a layer then live only until its peers have reduced them, as ZeRO-2 reduces gradients during
backward instead of keeping them whole.

The queue knows nothing of layers beyond what it is handed: a completion function per reduction and the shard it
fills. Every rank issues and completes the same reductions in the same order (each is a collective).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

#: ``(owner, finish)``: the layer that issued it (named in timings) and the function that completes it
Pending = Tuple[Any, Callable[[], None]]


class ReductionQueue:
    """SparseReduceScatters in flight, oldest first.

    ``eager()``: whether a completed layer goes on to ``on_complete(owner)`` at once and every issue completes the
    ones issued before it (the accumulation boundary with partitioned expert state; the engine decides per
    backward). ``timed(owner)``: a context timing the wait (the layer's ``reduce_wait`` phase when profiling)."""

    def __init__(self, eager: Callable[[], bool], on_complete: Callable[[Any], None],
                 timed: Optional[Callable[[Any], Any]] = None) -> None:
        self.pending: List[Pending] = []
        self._eager = eager
        self._on_complete = on_complete
        self._timed = timed

    def issue(self, owner: Any, finish: Callable[[], None]) -> None:
        """A reduction was just started (collective, in backward order): queue its completion; when eager,
        complete the ones issued before it (the newest stays in flight beside the rest of backward)."""
        self.pending.append((owner, finish))
        if self._eager():
            self.flush(keep=1)

    def flush(self, keep: int = 0) -> None:
        """Complete all but the ``keep`` newest reductions, in issue order (when eager, each layer then goes on to
        ``on_complete``)."""
        count = max(0, len(self.pending) - keep)
        if not count:
            return
        done, self.pending = self.pending[:count], self.pending[count:]
        eager = self._eager()
        for owner, finish in done:
            if self._timed is None:
                finish()
            else:
                with self._timed(owner):
                    finish()
            if eager:
                self._on_complete(owner)

    def __len__(self) -> int:
        return len(self.pending)


__all__ = ["ReductionQueue"]
