"""Per-step metrics through DeepSpeed's own monitor, and the optional routing trace.

Why here and not in the runtime: the runtime keeps cumulative counters (``engine.hecate.stats()``); this module turns
them, once per optimizer step, into per-step monitor events, and records per forward call what a step-level view
would lose (several micro-batches per step). It does no collective: every value is either identical on all ranks
(counts, plans) or rank 0's own counter, and only rank 0 writes, like DeepSpeed's monitor. The one collective is
at installation (:func:`install_recorders`): every rank learns whether rank 0 can write the trace file, so that all
stop together if it cannot.

Event names (``L`` = index of the MoE layer in ``engine.hecate.layer_names``), written at DeepSpeed's own x value
``engine.global_samples`` so they line up with ``Train/Samples/*`` (and Weights & Biases' monotonic step holds):

- ``Hecate/global_step``: the optimizer step (maps samples to steps);
- ``Hecate/layerL/{imbalance_before, imbalance_after, max_load_before, max_load_after, mean_load}``:
  token-expert pairs per rank, plain expert parallelism (before) and the executed plan (after);
- ``Hecate/layerL/{replicas, lambda}``: expert replicas materialized by SparseAllGather, share of experts moved;
- ``Hecate/layerL/{bytes_allgather, bytes_reducescatter, bytes_dispatch}``: bytes rank 0 sent this step;
- ``Hecate/layerL/cross_node_tokens``: token rows sent to another node this step (all ranks);
- ``Hecate/layerL/time_ms_<phase>``: rank 0's milliseconds per runtime phase this step (steps whose calls
  were timed: every step with ``hecate.profile``, else the first ones, see ``HecateConfig.profile``).

With ``hecate.monitor_interval`` N > 1 the events are written every N steps, as per-step means over them.
See docs/stats.md for the exact definitions and the measured overhead.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from ..errors import HecateConfigError
from ..planning.cost_model import owner_loads
from ..trace import TraceLayer, TraceWriter

from ..runtime.phases import PHASES

if TYPE_CHECKING:  # the builder of the runtime installs these observers (install_recorders)
    from ..planning import LayerPlan
    from ..runtime.hecate import HecateRuntime, LayerBinding

EVENT_PREFIX = "Hecate"
#: Per-layer metrics in the order they are written.
LOAD_METRICS = ("imbalance_before", "imbalance_after", "max_load_before", "max_load_after", "mean_load",
                "replicas", "lambda")
TRAFFIC_METRICS = ("bytes_allgather", "bytes_reducescatter", "bytes_dispatch", "cross_node_tokens")

Event = Tuple[str, float, int]
Observer = Callable[["LayerBinding", "LayerPlan", List[List[int]]], None]


def event_name(layer: int, metric: str) -> str:
    """``Hecate/layer{layer}/{metric}``; DeepSpeed's CSV monitor stores it as ``Hecate_layer{layer}_{metric}.csv``."""
    return f"{EVENT_PREFIX}/layer{layer}/{metric}"


@dataclass
class _LayerStep:
    """One layer's forward calls within the current optimizer step."""
    calls: int = 0
    max_before: int = 0
    max_after: int = 0
    mean: float = 0.0
    replicas: int = 0
    moved_share: float = 0.0


class StepMetrics:
    """Accumulates every forward call of every layer, and writes one set of events per optimizer step.

    Installed on every rank; at the first step a rank that will not write (not global rank 0, or no monitor
    configured, or ``hecate.monitor`` false) unhooks itself, so the per-call cost disappears there.
    """

    def __init__(self, runtime: "HecateRuntime") -> None:
        self.runtime = runtime
        self.active = True
        self._index: Dict[int, int] = {}
        self._steps: Dict[int, _LayerStep] = {}
        self._last: Dict[int, Tuple[float, ...]] = {}
        self._pending_steps = 0

    def layer_index(self, binding: "LayerBinding") -> int:
        index = self._index.get(id(binding))
        if index is None:
            index = self._index[id(binding)] = self.runtime.bindings.index(binding)
        return index

    def observe(self, binding: "LayerBinding", plan: "LayerPlan", counts: List[List[int]]) -> None:
        """Runtime observer: one forward call (not a recompute) of ``binding`` executed ``plan`` for ``counts``."""
        world = plan.world_size
        before = owner_loads(counts, binding.shard.owners, world)
        after = plan.loads()
        acc = self._steps.setdefault(self.layer_index(binding), _LayerStep())
        acc.calls += 1
        acc.max_before += max(before)
        acc.max_after += max(after)
        acc.mean += sum(before) / world
        acc.replicas += plan.num_moved
        acc.moved_share += len({e for e, _ in plan.gather_pairs}) / plan.num_experts

    def _cumulative(self, binding: "LayerBinding") -> Tuple[float, ...]:
        c = binding.counters
        return (c.allgather_bytes, c.reducescatter_bytes, c.dispatch_bytes, binding.tally.cross_node_rows,
                *binding.phase_seconds().values())   # device time per phase, in PHASES order

    def events(self, x: int, global_step: int, steps: int = 1) -> List[Event]:
        """Events at x value ``x`` for the ``steps`` optimizer steps since the last write (per-step means when more
        than one); resets the accumulators."""
        out: List[Event] = [(f"{EVENT_PREFIX}/global_step", global_step, x)]
        phases = PHASES
        for index, binding in enumerate(self.runtime.bindings):
            self._index.setdefault(id(binding), index)
            acc = self._steps.pop(index, None)
            if acc is not None and acc.calls:
                mean = acc.mean
                values = {"imbalance_before": acc.max_before / mean if mean > 0 else 1.0,
                          "imbalance_after": acc.max_after / mean if mean > 0 else 1.0,
                          "max_load_before": acc.max_before / steps, "max_load_after": acc.max_after / steps,
                          "mean_load": mean / steps,
                          "replicas": acc.replicas / acc.calls, "lambda": acc.moved_share / acc.calls}
                out.extend((event_name(index, k), values[k], x) for k in LOAD_METRICS)
            now = self._cumulative(binding)
            last = self._last.get(index, (0,) * len(now))
            self._last[index] = now
            delta = [(a - b) / steps for a, b in zip(now, last)]
            out.extend((event_name(index, k), int(v) if steps == 1 else v, x) for k, v in zip(TRAFFIC_METRICS, delta))
            times = delta[len(TRAFFIC_METRICS):]
            if any(times):   # (steps whose calls were not timed, outside hecate.profile, report no phase times)
                out.extend((event_name(index, f"time_ms_{p}"), v * 1e3, x) for p, v in zip(phases, times))
        return out

    def end_step(self, engine: Any) -> None:
        """Called by ``HecateEngine.step`` at each optimizer step, after the expert update."""
        if not self.active:
            return
        monitor = getattr(engine, "monitor", None)
        if not (self.runtime.config.monitor and monitor is not None and monitor.enabled
                and engine.global_rank == 0):
            self.active = False
            self._steps.clear()
            if self.observe in self.runtime.monitor.observers:
                self.runtime.monitor.observers.remove(self.observe)
            return
        self._pending_steps += 1
        if self._pending_steps >= self.runtime.config.monitor_interval:
            monitor.write_events(self.events(engine.global_samples, engine.global_steps, self._pending_steps))
            self._pending_steps = 0


class TraceRecorder:
    """Runtime observer writing one trace record per layer forward call (rank 0 only; counts are the exchanged
    ones, identical on every rank). The file opens at the first call, when every layer is known.

    ``step`` in the records is the optimizer step the call belongs to (``engine.global_steps + 1``), the step
    number of the monitor's ``Hecate/global_step`` for the same iteration.
    """

    def __init__(self, runtime: "HecateRuntime", path: str) -> None:
        self.runtime = runtime
        self.path = os.path.abspath(path)
        directory = os.path.dirname(self.path)
        if os.path.isdir(self.path):
            raise HecateConfigError(f"hecate.trace_file={path!r} is a directory; give a file path "
                                    "(e.g. 'run/trace.jsonl')")
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise HecateConfigError(f"hecate.trace_file={path!r}: cannot create its directory ({exc})") from None
        if not os.access(directory, os.W_OK):
            raise HecateConfigError(f"hecate.trace_file={path!r}: directory {directory!r} is not writable")
        self.writer: Optional[TraceWriter] = None
        self._index: Dict[int, int] = {}

    def _open(self) -> TraceWriter:
        rt = self.runtime
        layers = [TraceLayer(name, b.shard.num_experts, b.hidden_size, b.shard.kernel.numel)
                  for name, b in zip(rt.layer_names, rt.bindings)]
        top_k = max([b.tally.top_k for b in rt.bindings] + [1])
        meta = {"source": "ds_hecate runtime", "placement": rt.config.placement,
                "ranks_per_node": rt.ranks_per_node, "owners": [list(b.shard.owners) for b in rt.bindings],
                "compute_dtype": str(rt.compute_dtype).replace("torch.", ""),
                "step": "optimizer step the call belongs to (engine.global_steps + 1)"}
        return TraceWriter(self.path, rt.ep_size, top_k, layers, meta)

    def observe(self, binding: "LayerBinding", plan: "LayerPlan", counts: List[List[int]]) -> None:
        if self.writer is None:
            self.writer = self._open()
        index = self._index.get(id(binding))
        if index is None:
            index = self._index[id(binding)] = self.runtime.bindings.index(binding)
        self.writer.write(self.runtime.global_steps + 1, index, counts, plan.materialized)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def install_recorders(runtime: "HecateRuntime") -> None:
    """Hook the step metrics (every rank, until the first step decides) and the trace (rank 0, if configured)."""
    metrics = runtime.metrics = StepMetrics(runtime)
    runtime.monitor.observers.append(metrics.observe)
    runtime.trace = None
    if not runtime.config.trace_file:
        return
    problem = None
    world = runtime.layout.world
    if world.rank == 0:   # rank 0 of the world (with groups it records its group's calls)
        try:
            recorder = runtime.trace = TraceRecorder(runtime, runtime.config.trace_file)
            runtime.monitor.observers.append(recorder.observe)
        except HecateConfigError as exc:
            problem = str(exc)
    # Only rank 0 writes, but every rank must stop if it cannot (the others would wait in the next collective).
    if world.world_size > 1:
        problem = world.all_gather_object(problem)[0]
    if problem is not None:
        raise HecateConfigError(problem)


def end_step(engine: Any) -> None:
    """Engine glue: write this step's metrics (no-op where nothing is written)."""
    metrics = getattr(engine.hecate, "metrics", None)
    if metrics is not None:
        metrics.end_step(engine)
