"""Timing on the working device.

On CUDA, kernels run asynchronously: a host clock around a launch measures the launch, not the work, and a phase
that waits (the count exchange's copy to the host) absorbs everything queued before it. Every phase of a layer
call is therefore timed with a CUDA event pair on the current stream, resolved lazily: when the statistics or the
cost model read them (one host synchronisation then, at a step boundary), and, to bound memory, pairs whose events
have already completed are folded in as calls go on (``query()``, which never waits). Elsewhere the host clock is
the device clock. Host times are kept beside (``host_time_s``: launches and planning, what the host spent).

Phases are timed only while profiling (:class:`~ds_hecate.runtime.call_monitor.CallMonitor`): a timer, a CUDA event
pair and an autograd boundary per phase are host work in every layer call, which a call that is not measured must
not pay.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

RESOLVE_EVERY = 256  # pending event pairs kept before folding in the completed ones (bounds memory)


def in_backward_pass() -> bool:
    """True while autograd runs a backward pass (activation-checkpoint recompute happens there)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


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


class PhaseTimes:
    """One layer's timed phases: device time per phase (CUDA events, resolved when read: statistics and the cost
    model), host time per phase (launches and planning), and the device time between the previous MoE layer and
    this one (the cost model's T_nonMoE)."""

    def __init__(self, phases: Iterable[str]) -> None:
        names = tuple(phases)
        self.device = {p: Intervals(keep=0) for p in names}
        self.host = {p: 0.0 for p in names}
        self.gap = Intervals(keep=16)

    def record(self, phase: str, mark: Any, host_start: float, clock: "DeviceClock") -> Tuple[Any, float]:
        """An interval of ``phase`` from ``mark`` / ``host_start`` to now; returns now (device mark, host time)."""
        end, host_end = clock.mark(), time.perf_counter()
        self.host[phase] += host_end - host_start
        self.device[phase].add(mark, end)
        return end, host_end

    def seconds(self) -> Dict[str, float]:
        """Device seconds per phase so far (resolving CUDA events is a host synchronisation: step boundaries and
        statistics only)."""
        return {p: v.total() for p, v in self.device.items()}


class BackwardPhases:
    """The backward of the layer calls as phases: a layer call puts :class:`PhaseBoundary` nodes on its tensors
    (output, expert outputs, received rows, input), and in backward each one that autograd reaches ends the phase
    running since the one before and starts the next. One interval is open at a time per runtime (a layer's
    backward runs its nodes in a row); a :class:`PhaseTimer` inside it (the SparseReduceScatter's issue, a re-gather,
    another layer's reduce-scatter wait) pauses it, so no time is counted twice and the phases add up to the call."""

    def __init__(self, clock: "DeviceClock") -> None:
        self.clock = clock
        self.open: Optional[Tuple[PhaseTimes, str, Any, float]] = None   # (times, phase, device mark, host start)

    def cross(self, times: PhaseTimes, ends: Optional[str], starts: Optional[str]) -> None:
        """At a boundary in backward: close ``ends`` (if it is the interval open for ``times``' layer; a stale one,
        of a boundary autograd did not reach, is dropped) and open ``starts``."""
        if self.open is not None:
            owner, phase, mark, host_start = self.open
            if owner is times and phase == ends:
                owner.record(phase, mark, host_start, self.clock)
        self.open = None
        if starts is not None:
            self.open = (times, starts, self.clock.mark(), time.perf_counter())

    def pause(self) -> Optional[Tuple[PhaseTimes, str]]:
        """Close the open interval (recorded) for a nested timer; returns what to :meth:`resume`."""
        if self.open is None:
            return None
        owner, phase, mark, host_start = self.open
        owner.record(phase, mark, host_start, self.clock)
        self.open = None
        return owner, phase

    def resume(self, paused: Optional[Tuple[PhaseTimes, str]]) -> None:
        if paused is not None:
            owner, phase = paused
            self.open = (owner, phase, self.clock.mark(), time.perf_counter())


class PhaseBoundary(torch.autograd.Function):
    """Identity; in backward, the boundary between two backward phases of a layer call (:class:`BackwardPhases`)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, phases: BackwardPhases, times: PhaseTimes, ends: Optional[str],
                starts: Optional[str]) -> torch.Tensor:
        ctx.phases, ctx.times, ctx.ends, ctx.starts = phases, times, ends, starts
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.phases.cross(ctx.times, ctx.ends, ctx.starts)
        return grad, None, None, None, None


#: torch's check of a recording profiler (private; a torch without it: assume one records, the ranges as before)
_PROFILER_ENABLED = getattr(torch._C._autograd, "_profiler_enabled", None)


def profiler_records() -> bool:
    """Whether a torch profiler (``torch.profiler.profile``, ``emit_nvtx``) is recording ranges now."""
    return _PROFILER_ENABLED is None or bool(_PROFILER_ENABLED())


class CallCursor:
    """Where the last timed phase of the forward layer call in progress ended (``at``: device mark, host time; None
    outside a forward call). The next phase of the call starts there rather than at its own entry, so a forward
    call's phases tile it: the host work between two phases (the call's glue, the profiler range's entry, the
    autograd boundaries) is counted in the later one, and the phases add up to the call. ``gate``: the layer (its
    :class:`PhaseTimes`) whose own gate started the tiling before its call (ds_hecate.MoE), which the call then
    continues; any other cursor a call finds is a stale one (a call cut short by an error) and starts anew."""

    __slots__ = ("at", "gate")

    def __init__(self) -> None:
        self.at: Optional[Tuple[Any, float]] = None
        self.gate: Optional[object] = None


class PhaseTimer:
    """One timed phase of an MoE layer call (:meth:`PhaseTimes.record`), around a
    ``torch.profiler.record_function`` range of the same name while a profiler records; pauses a backward phase it
    runs inside (:class:`BackwardPhases`); in a forward call it starts where the call's previous phase ended
    (``cursor``)."""

    def __init__(self, times: PhaseTimes, phase: str, phases: BackwardPhases, label: str,
                 cursor: Optional[CallCursor] = None) -> None:
        self.times, self.phase, self.phases, self.label, self.cursor = times, phase, phases, label, cursor

    def __enter__(self) -> None:
        self.paused = self.phases.pause()
        cursor = self.cursor
        self.took = cursor is not None and cursor.at is not None
        if self.took:   # (a phase nested in this one takes its own marks: the cursor is this one's until it ends)
            assert cursor is not None and cursor.at is not None
            (self.mark, self.start), cursor.at = cursor.at, None
        else:
            self.mark, self.start = self.phases.clock.mark(), time.perf_counter()
        # the range only where a profiler records it (a range costs about 10 microseconds, recorded or not); its
        # entry and exit are inside the phase's marks, so what profiling adds is counted in the phases
        self.range = torch.profiler.record_function(self.label) if profiler_records() else None
        if self.range is not None:
            self.range.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.range is not None:
            self.range.__exit__(*exc)
        end = self.times.record(self.phase, self.mark, self.start, self.phases.clock)
        if self.took:
            assert self.cursor is not None
            self.cursor.at = end
        self.phases.resume(self.paused)
