"""Timing on the working device.

On CUDA, kernels run asynchronously: a host clock around a launch measures the launch, not the work. The cost model
(expert compute per pair, the non-MoE time that hides a prefetch) therefore reads CUDA event pairs, resolved lazily
(one host synchronisation when the figures are read, at the profiling step). Elsewhere the host clock is the device
clock.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Tuple

import torch

RESOLVE_EVERY = 256  # pending event pairs kept before resolving the oldest (bounds memory; they are long done)


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


class Intervals:
    """Device-time intervals between two marks, resolved when read; ``keep`` bounds how many are remembered."""

    def __init__(self, keep: Optional[int] = None) -> None:
        self.keep = keep
        self._pending: List[Tuple[Any, Any]] = []
        self._values: List[float] = []
        self._total = 0.0

    def add(self, start: Any, end: Any) -> None:
        self._pending.append((start, end))
        if self.keep is not None and len(self._pending) > self.keep:
            self._pending = self._pending[-self.keep:]
            self._values = []
        if len(self._pending) > RESOLVE_EVERY:
            self.values()

    def values(self) -> List[float]:
        """Every remembered interval in seconds (resolves pending CUDA events: a host synchronisation)."""
        for start, end in self._pending:
            seconds = DeviceClock.seconds(start, end)
            self._values.append(seconds)
            self._total += seconds
        self._pending = []
        if self.keep is not None:
            self._values = self._values[-self.keep:]
        return list(self._values)

    def total(self) -> float:
        """Sum of all intervals ever added (``keep`` aside)."""
        self.values()
        return self._total


class PhaseTimer:
    """Host time of one phase of an MoE layer call into ``binding.phase_s`` (statistics), device time into
    ``binding.device_time[phase]`` when that phase is tracked (the cost model), and names the phase as the
    communicator's activity (shown if a collective fails inside it)."""

    def __init__(self, binding: Any, phase: str) -> None:
        self.binding, self.phase = binding, phase

    def __enter__(self) -> None:
        comm = self.binding.runtime.comm
        self.previous, comm.activity = comm.activity, f"{self.phase} of MoE layer '{self.binding.shard.name}'"
        self.tracked = self.binding.device_time.get(self.phase)
        self.mark = self.binding.runtime.clock.mark() if self.tracked is not None else None
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.binding.phase_s[self.phase] += time.perf_counter() - self.start
        if self.tracked is not None:
            self.tracked.add(self.mark, self.binding.runtime.clock.mark())
        self.binding.runtime.comm.activity = self.previous
