"""Timing on the working device.

On CUDA, kernels run asynchronously: a host clock around a launch measures the launch, not the work, and a phase
that waits (the count exchange's copy to the host) absorbs everything queued before it. Every phase of a layer
call is therefore timed with a CUDA event pair on the current stream, resolved lazily: when the statistics or the
cost model read them (one host synchronisation then, at a step boundary), and, to bound memory, pairs whose events
have already completed are folded in as calls go on (``query()``, which never waits). Elsewhere the host clock is
the device clock. Host times are kept beside (``host_time_s``: launches and planning, what the host spent).
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Tuple

import torch

RESOLVE_EVERY = 256  # pending event pairs kept before folding in the completed ones (bounds memory)


class DeviceClock:
    """Marks in the device's execution order: CUDA events on the current stream, host time elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    @staticmethod
    def seconds(start: Any, end: Any) -> float:
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    @staticmethod
    def done(end: Any) -> bool:
        """Whether the interval ending at ``end`` can be read without waiting."""
        return isinstance(end, float) or bool(end.query())


class Intervals:
    """Device-time intervals between two marks, resolved when read; ``keep`` bounds how many are remembered (0:
    only their total, as for the per-phase statistics; None: all)."""

    def __init__(self, keep: Optional[int] = None) -> None:
        self.keep = keep
        self._pending: List[Tuple[Any, Any]] = []
        self._values: List[float] = []
        self._total = 0.0

    def add(self, start: Any, end: Any) -> None:
        self._pending.append((start, end))
        if self.keep and len(self._pending) > self.keep:   # only the last ``keep`` are read: drop older ones
            self._pending = self._pending[-self.keep:]
            self._values = []
        if len(self._pending) > RESOLVE_EVERY:
            self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        """Move pending intervals into the values, oldest first; without ``wait`` only those already complete."""
        done = 0
        for start, end in self._pending:
            if not wait and not DeviceClock.done(end):
                break
            seconds = DeviceClock.seconds(start, end)
            self._values.append(seconds)
            self._total += seconds
            done += 1
        self._pending = self._pending[done:]
        if self.keep is not None:
            self._values = self._values[-self.keep:] if self.keep else []

    def values(self) -> List[float]:
        """Every remembered interval in seconds (resolves pending CUDA events: a host synchronisation)."""
        self._fold(wait=True)
        return list(self._values)

    def total(self) -> float:
        """Sum of all intervals ever added (``keep`` aside)."""
        self._fold(wait=True)
        return self._total


class PhaseTimer:
    """One phase of an MoE layer call: device time into ``binding.device_time[phase]`` (statistics and the cost
    model), host time into ``binding.host_phase_s``; names the phase as the communicator's activity (shown if a
    collective fails inside it)."""

    def __init__(self, binding: Any, phase: str) -> None:
        self.binding, self.phase = binding, phase

    def __enter__(self) -> None:
        comm = self.binding.runtime.comm
        self.previous, comm.activity = comm.activity, f"{self.phase} of MoE layer '{self.binding.shard.name}'"
        self.mark = self.binding.runtime.clock.mark()
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.binding.host_phase_s[self.phase] += time.perf_counter() - self.start
        self.binding.device_time[self.phase].add(self.mark, self.binding.runtime.clock.mark())
        self.binding.runtime.comm.activity = self.previous
