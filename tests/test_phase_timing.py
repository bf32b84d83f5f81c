"""The layer calls' phase timers: a forward call's phases tile it, and the profiler ranges exist only while a profiler
records them (ds_hecate.runtime.timing, ds_hecate.runtime.call_monitor)."""
import time
from types import SimpleNamespace

import torch

from ds_hecate.runtime import timing
from ds_hecate.runtime.call_monitor import CallMonitor, LayerPhases
from ds_hecate.runtime.phases import PHASES
from ds_hecate.runtime.timing import PhaseTimes

GLUE_S = 0.02   # host work between two phases, long enough to stand out of a loaded host's noise


def _layer(monitor: CallMonitor):
    times = PhaseTimes(PHASES)
    return times, LayerPhases(monitor, SimpleNamespace(activity=None), times, "l")


def test_a_forward_calls_phases_tile_it():
    """Inside a forward call the host work before and between phases is counted in the phase after it; outside
    one (the next layer's prefetch between model forwards, say) a phase counts only itself."""
    monitor = CallMonitor(torch.device("cpu"), profiling=True)
    times, phases = _layer(monitor)
    start = time.perf_counter()
    monitor.layer_starts(times)
    time.sleep(GLUE_S)
    with phases("counts"):
        pass
    time.sleep(GLUE_S)
    with phases("plan"):
        with phases("gather"):   # nested: its own marks, so nothing is counted twice
            pass
    monitor.layer_ends()
    call = time.perf_counter() - start
    seconds = times.seconds()
    assert seconds["counts"] >= GLUE_S and seconds["plan"] >= GLUE_S   # each took the glue before it
    assert seconds["gather"] < GLUE_S
    assert seconds["counts"] + seconds["plan"] <= call   # and nothing twice
    time.sleep(GLUE_S)
    with phases("bookkeeping"):   # after the call: the sleep before it is no phase's
        pass
    assert times.seconds()["bookkeeping"] < GLUE_S


def test_a_layers_own_gate_starts_the_tiling_and_the_gap_still_ends_at_the_call():
    """ds_hecate.MoE's gate runs before the call: its ``route`` phase starts where the layer started routing, the
    call's first phase where the gate ended, and the gap to the previous layer (the prefetch's overlap, the
    cost model's non-MoE time) still runs to the call's start, the gate in it."""
    monitor = CallMonitor(torch.device("cpu"), profiling=True)
    times, phases = _layer(monitor)
    monitor.model_forward()
    phases.route_starts()
    time.sleep(GLUE_S)
    with phases("route"):
        pass
    time.sleep(GLUE_S)
    monitor.layer_starts(times)
    with phases("counts"):
        pass
    monitor.layer_ends()
    seconds = times.seconds()
    assert seconds["route"] >= GLUE_S and seconds["counts"] >= GLUE_S
    assert times.gap.total() >= 2 * GLUE_S


def test_a_call_cut_short_leaves_no_start_to_the_next():
    """A call that an error ended before its end (no ``layer_ends``) leaves its cursor behind: the next call, of this
    layer or another, starts its own tiling rather than counting from the stale mark."""
    monitor = CallMonitor(torch.device("cpu"), profiling=True)
    times, _ = _layer(monitor)
    other, other_phases = _layer(monitor)
    for layer in (times, other):   # the gate of ``times`` started, then its call cut short; or its call itself
        if layer is times:
            monitor.route_starts(times)
        else:
            monitor.layer_starts(times)
        time.sleep(GLUE_S)
        monitor.layer_starts(other)
        with other_phases("counts"):
            pass
        monitor.layer_ends()
        assert other.seconds()["counts"] < GLUE_S


def test_phases_open_profiler_ranges_only_while_a_profiler_records(monkeypatch):
    monitor = CallMonitor(torch.device("cpu"), profiling=True)
    times, phases = _layer(monitor)
    opened = []
    real = torch.profiler.record_function

    def record(name: str):
        opened.append(name)
        return real(name)
    monkeypatch.setattr(torch.profiler, "record_function", record)
    with phases("counts"):
        pass
    assert not opened and not timing.profiler_records()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phases("counts"):
            torch.ones(2).sum()
    assert opened == ["counts of MoE layer 'l'"]
    assert any(e.name == "counts of MoE layer 'l'" for e in prof.events())
