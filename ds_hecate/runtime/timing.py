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


def record(binding: Any, phase: str, mark: Any, host_start: float) -> None:
    """An interval of ``phase`` from ``mark`` / ``host_start`` to now: device time into
    ``binding.device_time[phase]`` (statistics and the cost model), host time into ``binding.host_phase_s``."""
    binding.host_phase_s[phase] += time.perf_counter() - host_start
    binding.device_time[phase].add(mark, binding.runtime.clock.mark())


class BackwardPhases:
    """The backward of the layer calls as phases: a layer call puts :class:`PhaseBoundary` nodes on its tensors
    (output, expert outputs, received rows, input), and in backward each one that autograd reaches ends the phase
    running since the one before and starts the next. One interval is open at a time per runtime (a layer's
    backward runs its nodes in a row); a :class:`PhaseTimer` inside it (the SparseReduceScatter's issue, a re-gather,
    another layer's reduce-scatter wait) pauses it, so no time is counted twice and the phases add up to the call."""

    def __init__(self) -> None:
        self.open: Optional[Tuple[Any, str, Any, float]] = None   # (binding, phase, device mark, host start)

    def cross(self, binding: Any, ends: Optional[str], starts: Optional[str]) -> None:
        """At a boundary in backward: close ``ends`` (if it is the interval open for ``binding``; a stale one, of a
        boundary autograd did not reach, is dropped) and open ``starts``."""
        if self.open is not None:
            owner, phase, mark, host_start = self.open
            if owner is binding and phase == ends:
                record(binding, phase, mark, host_start)
        self.open = None
        if starts is not None:
            self.open = (binding, starts, binding.runtime.clock.mark(), time.perf_counter())

    def pause(self) -> Optional[Tuple[Any, str]]:
        """Close the open interval (recorded) for a nested timer; returns what to :meth:`resume`."""
        if self.open is None:
            return None
        owner, phase, mark, host_start = self.open
        record(owner, phase, mark, host_start)
        self.open = None
        return owner, phase

    def resume(self, paused: Optional[Tuple[Any, str]]) -> None:
        if paused is not None:
            owner, phase = paused
            self.open = (owner, phase, owner.runtime.clock.mark(), time.perf_counter())


class PhaseBoundary(torch.autograd.Function):
    """Identity; in backward, the boundary between two backward phases of a layer call (:class:`BackwardPhases`)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, binding: Any, ends: Optional[str], starts: Optional[str]) -> torch.Tensor:
        ctx.binding, ctx.ends, ctx.starts = binding, ends, starts
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.binding.runtime.backward_phases.cross(ctx.binding, ctx.ends, ctx.starts)
        return grad, None, None, None


def boundary(tensor: torch.Tensor, binding: Any, ends: Optional[str], starts: Optional[str]) -> torch.Tensor:
    """``tensor`` with a :class:`PhaseBoundary` on it (as it is where it needs no gradient)."""
    if not tensor.requires_grad:
        return tensor
    return PhaseBoundary.apply(tensor, binding, ends, starts)


class PhaseTimer:
    """One phase of an MoE layer call (:func:`record`); names the phase as the communicator's activity (shown if a
    collective fails inside it); pauses a backward phase it runs inside (:class:`BackwardPhases`)."""

    def __init__(self, binding: Any, phase: str) -> None:
        self.binding, self.phase = binding, phase

    def __enter__(self) -> None:
        runtime = self.binding.runtime
        comm = runtime.comm
        self.previous, comm.activity = comm.activity, f"{self.phase} of MoE layer '{self.binding.shard.name}'"
        self.paused = runtime.backward_phases.pause()
        self.mark = runtime.clock.mark()
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        record(self.binding, self.phase, self.mark, self.start)
        runtime = self.binding.runtime
        runtime.comm.activity = self.previous
        runtime.backward_phases.resume(self.paused)
