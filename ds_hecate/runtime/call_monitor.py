"""What the layer calls report, kept apart from what they do: phase times, replica memory, observers.

- **Phases** (:mod:`.phases`) are timed only while :attr:`CallMonitor.profiling` is on: from the start of training
  until the scheduler's cost model has measured the steady state (``runtime/profiling.py``, step
  :data:`~.profiling.WARM_PROFILE_STEP`), and throughout with ``hecate.profile``. Each timed phase is a CUDA event
  pair (the host clock on the CPU), and a ``torch.profiler.record_function`` range while a profiler records; the
  backward's phases are cut by autograd boundaries (:mod:`.timing`). A forward call's phases tile it: each starts
  where the call's previous one ended (:class:`~.timing.CallCursor`), so the glue between them is counted too. Off,
  a phase costs an attribute write: it still names what the layer is doing for a collective that fails inside it
  (``Communicator.activity``).
- **Replica memory**: bytes of materialized replicas alive over every layer and each layer's own, and their peaks,
  each gathered block counted until it is freed (:class:`ReplicaMemory`).
- **Observers**: called after each forward call with its plan and counts (step metrics, the routing trace).
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable, List, Optional

import torch

from .timing import BackwardPhases, CallCursor, DeviceClock, PhaseBoundary, PhaseTimer, PhaseTimes, in_backward_pass


class ReplicaBytes:
    """Bytes of replicas alive and their peak, for one layer or for all of them."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live

    def release(self, nbytes: int) -> None:
        self.live -= nbytes


class ReplicaMemory:
    """Every layer's gathered replica blocks, counted from their gather until they are freed (a finalizer on the
    block: nothing to scan per call)."""

    def __init__(self) -> None:
        self.total = ReplicaBytes()

    def track(self, block: torch.Tensor, nbytes: int, layer: ReplicaBytes) -> None:
        """Count ``block`` (``nbytes`` of replica rows, reserved rows included) for ``layer`` and the total until it
        is freed."""
        if nbytes <= 0:
            return
        layer.add(nbytes)
        self.total.add(nbytes)
        weakref.finalize(block, _release, layer, self.total, nbytes)


def _release(layer: ReplicaBytes, total: ReplicaBytes, nbytes: int) -> None:
    layer.release(nbytes)
    total.release(nbytes)


class _Activity:
    """A phase that is not timed: names the communicator's activity for its duration."""

    __slots__ = ("comm", "label", "previous")

    def __init__(self, comm: Any, label: str) -> None:
        self.comm, self.label = comm, label

    def __enter__(self) -> None:
        self.previous, self.comm.activity = self.comm.activity, self.label

    def __exit__(self, *exc: Any) -> None:
        self.comm.activity = self.previous


class _TimedActivity(_Activity):
    __slots__ = ("timer",)

    def __init__(self, comm: Any, label: str, timer: PhaseTimer) -> None:
        super().__init__(comm, label)
        self.timer = timer

    def __enter__(self) -> None:
        super().__enter__()
        self.timer.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.timer.__exit__(*exc)
        super().__exit__(*exc)


class LayerPhases:
    """One layer's phases as the parts of its call enter them: ``phases("counts")`` is the context of that phase
    (its label names the layer, for a collective that fails inside it)."""

    def __init__(self, monitor: "CallMonitor", comm: Any, times: PhaseTimes, layer: str) -> None:
        self.monitor, self.comm, self.times = monitor, comm, times
        self.labels = {name: f"{name} of MoE layer '{layer}'" for name in times.host}
        #: while not profiling, one context per phase (a phase never runs inside itself)
        self._untimed = {name: _Activity(comm, label) for name, label in self.labels.items()}

    def __call__(self, name: str) -> Any:
        if not self.monitor.profiling:
            return self._untimed[name]
        return self.monitor.phase(self.comm, self.labels[name], self.times, name)

    def boundary(self, tensor: torch.Tensor, ends: Optional[str], starts: Optional[str]) -> torch.Tensor:
        return self.monitor.boundary(tensor, self.times, ends, starts)

    def route_starts(self) -> None:
        """The layer's own gate is about to run (``ds_hecate.MoE``): while profiling, its ``route`` phase and the
        call's phases after it tile the layer from here (not in a recompute, whose phases take their own marks)."""
        if self.monitor.profiling and not in_backward_pass():
            self.monitor.route_starts(self.times)


class CallMonitor:
    """One rank's instruments around its layer calls (see the module docstring)."""

    def __init__(self, device: torch.device, profiling: bool = True) -> None:
        self.clock = DeviceClock(device)
        self.backward_phases = BackwardPhases(self.clock)
        self.profiling = profiling
        self.memory = ReplicaMemory()
        #: called as observe(layer, plan, counts) after each forward call's plan (not recomputes)
        self.observers: List[Callable[..., None]] = []
        self.last_layer_end: Optional[object] = None   # a DeviceClock mark, while profiling
        #: the end of the forward call's last phase, where its next phase starts (while profiling)
        self.cursor = CallCursor()

    def phase(self, comm: Any, label: str, times: PhaseTimes, name: str) -> Any:
        """A context for one phase of a layer call: names ``label`` as ``comm``'s activity, and times phase
        ``name`` into ``times`` while profiling."""
        if not self.profiling:
            return _Activity(comm, label)
        return _TimedActivity(comm, label, PhaseTimer(times, name, self.backward_phases, label, self.cursor))

    def boundary(self, tensor: torch.Tensor, times: PhaseTimes, ends: Optional[str],
                 starts: Optional[str]) -> torch.Tensor:
        """``tensor`` with a backward phase boundary on it while profiling (as it is otherwise, or where it needs no
        gradient)."""
        if not self.profiling or not tensor.requires_grad:
            return tensor
        return PhaseBoundary.apply(tensor, self.backward_phases, times, ends, starts)

    def model_forward(self) -> None:
        """A model forward starts: the gap to the first layer counts from here (a call an error cut short left no
        cursor behind)."""
        self.last_layer_end = self.clock.mark() if self.profiling else None
        self.cursor.at = self.cursor.gate = None

    def route_starts(self, times: PhaseTimes) -> None:
        """The gate of the layer timed into ``times`` starts, before its call: the gate's phase starts here, and the
        call's first phase where the gate's ended (:meth:`layer_starts` keeps this layer's cursor)."""
        if self.profiling:
            self.cursor.at = (self.clock.mark(), time.perf_counter())
            self.cursor.gate = times

    def layer_starts(self, times: PhaseTimes) -> None:
        """A forward layer call starts: the device time since the previous layer's end is this layer's gap (its
        gate in it: the prefetched gather overlaps the gate too), and the call's first phase starts here, or where
        the layer's gate ended (:class:`~.timing.CallCursor`)."""
        if self.profiling:
            start = self.clock.mark()
            if self.last_layer_end is not None:
                times.gap.add(self.last_layer_end, start)
            cursor = self.cursor
            if cursor.at is None or cursor.gate is not times:   # (not this layer's gate: stale, or none)
                cursor.at = (start, time.perf_counter())
            cursor.gate = None

    def layer_ends(self) -> None:
        """A layer call ends (a forward's or a recompute's): phases outside a call take their own marks again."""
        if self.profiling:
            self.cursor.at = None
            self.last_layer_end = self.clock.mark()

    def observe(self, layer: Any, plan: Any, counts: Any) -> None:
        for observe in self.observers:
            observe(layer, plan, counts)


__all__ = ["CallMonitor", "LayerPhases", "ReplicaBytes", "ReplicaMemory"]
