"""``ds-hecate report RUN_DIR``: PNG plots of what the experts did, from a run's trace and/or CSV monitor files.

Inputs, found anywhere under RUN_DIR:

- routing traces (``*.jsonl`` whose first line is a ds_hecate trace header; ``hecate.trace_file``): per forward call
  the gate counts and the executed plan, from which the expert-load heatmap, the per-rank compute before/after
  balancing and the replicas per expert are drawn (recomputed with the same pure planning code the runtime uses);
- DeepSpeed CSV monitor files ``Hecate_layer<L>_<metric>.csv`` (``csv_monitor`` in the DeepSpeed config, with
  ``hecate.monitor`` on): imbalance per step, bytes per collective per step, time per phase per step.

Each plot is one PNG; with several traces or monitor directories the file names get a prefix. matplotlib with the
Agg backend (no display needed).
"""
from __future__ import annotations

import csv
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import HecateError
from ..planning.cost_model import owner_loads
from ..runtime.phases import PHASE_LABELS
from ..trace import TRACE_FORMAT, Trace, read_trace

MAX_LAYERS_SHOWN = 8
_CSV_NAME = re.compile(r"^Hecate_layer(\d+)_(.+)\.csv$")


class ReportError(HecateError):
    """RUN_DIR holds nothing to plot, or an input cannot be read."""


# -- inputs ----------------------------------------------------------------------------------------------------------
@dataclass
class MonitorRun:
    """Hecate's series from one CSV monitor directory: ``series[layer][metric] = (steps, values)``."""
    directory: str
    x_label: str
    series: Dict[int, Dict[str, Tuple[List[float], List[float]]]] = field(default_factory=dict)

    def layers(self) -> List[int]:
        return sorted(self.series)

    def get(self, layer: int, metric: str) -> Tuple[List[float], List[float]]:
        return self.series.get(layer, {}).get(metric, ([], []))


def _is_trace(path: str) -> bool:
    try:
        with open(path, "r", encoding="utf-8") as handle:
            first = handle.readline(4096)
    except OSError:
        return False
    return f'"format":"{TRACE_FORMAT}"' in first.replace(" ", "")


def _read_csv_series(path: str) -> Tuple[List[float], List[float]]:
    """(x, value) rows of a DeepSpeed CSV monitor file; a repeated header (a second run appending to the same
    file) starts over, so the last run wins."""
    xs: List[float] = []
    ys: List[float] = []
    with open(path, "r", encoding="utf-8", newline="") as handle:
        for row in csv.reader(handle):
            if len(row) < 2:
                continue
            try:
                x, y = float(row[0]), float(row[1])
            except ValueError:
                xs, ys = [], []  # header row
                continue
            xs.append(x)
            ys.append(y)
    return xs, ys


def read_monitor_dir(directory: str) -> MonitorRun:
    """Read every ``Hecate_*`` CSV of one monitor directory; x becomes the optimizer step when
    ``Hecate_global_step.csv`` maps DeepSpeed's sample counts to steps."""
    mapping: Dict[float, float] = {}
    step_file = os.path.join(directory, "Hecate_global_step.csv")
    if os.path.isfile(step_file):
        xs, steps = _read_csv_series(step_file)
        mapping = dict(zip(xs, steps))
    run = MonitorRun(directory, "optimizer step" if mapping else "samples (DeepSpeed global_samples)")
    for name in sorted(os.listdir(directory)):
        match = _CSV_NAME.match(name)
        if not match:
            continue
        xs, ys = _read_csv_series(os.path.join(directory, name))
        if mapping:
            xs = [mapping.get(x, math.nan) for x in xs]
        run.series.setdefault(int(match.group(1)), {})[match.group(2)] = (xs, ys)
    return run


def find_inputs(run_dir: str) -> Tuple[List[str], List[str]]:
    """(trace files, CSV monitor directories holding Hecate metrics) under ``run_dir``, sorted."""
    if not os.path.isdir(run_dir):
        raise ReportError(f"report: {run_dir!r} is not a directory (give the run directory, e.g. the example's "
                          "--monitor-dir)")
    traces: List[str] = []
    monitors: List[str] = []
    for root, _dirs, files in os.walk(run_dir):
        if any(_CSV_NAME.match(f) for f in files):
            monitors.append(root)
        traces.extend(os.path.join(root, f) for f in files if f.endswith(".jsonl")
                      and _is_trace(os.path.join(root, f)))
    return sorted(traces), sorted(monitors)


# -- derived series from a trace -------------------------------------------------------------------------------------
@dataclass
class LayerHistory:
    """One layer's recorded forward calls as plot-ready arrays."""
    name: str
    x: List[float]
    x_label: str
    expert_load: List[List[int]]              # [call][expert], summed over ranks
    compute_before: Optional[List[List[int]]]  # [call][rank]; None without owners in the trace
    compute_after: Optional[List[List[int]]]   # None without materialized sets
    replicas: Optional[List[List[int]]]        # [call][expert]: ranks holding a copy besides the owner
    owners: Optional[Tuple[int, ...]] = None   # at the start of the trace (re-sharding may change them)


def layer_histories(trace: Trace) -> List[LayerHistory]:
    """Per layer: loads per expert, per-rank compute before (owners only) and after (the executed plan), and
    replicas per expert, per recorded call; recomputed with ds_hecate.planning as the runtime does."""
    from ..planning import Placement
    from ..planning.dispatch_plan import DispatchPlan

    owners_meta = trace.meta.get("owners")
    rpn = int(trace.meta.get("ranks_per_node") or trace.world_size)
    out = []
    for index, layer in enumerate(trace.layers):
        records = [r for r in trace.records if r.layer == index]
        steps = [r.step for r in records]
        unique = len(set(steps)) == len(steps)
        x = [float(s) for s in steps] if unique else [float(i) for i in range(len(records))]
        x_label = "optimizer step" if unique else "forward call (several per optimizer step)"
        owners = (tuple(int(o) for o in owners_meta[index]) if isinstance(owners_meta, list)
                  and index < len(owners_meta) and len(owners_meta[index]) == layer.num_experts else None)
        load, before, after, replicas = [], [], [], []
        for record in records:
            load.append([sum(row[e] for row in record.counts) for e in range(layer.num_experts)])
            if owners is not None:
                before.append(owner_loads(record.counts, owners, trace.world_size))
            if record.materialized is not None:
                holders = [0] * layer.num_experts
                for experts in record.materialized:
                    for e in set(experts):
                        holders[e] += 1
                if owners is not None:
                    materialized = tuple(tuple(sorted(set(m))) for m in record.materialized)
                    plan = DispatchPlan.build(record.counts, Placement(tuple(owners), materialized), rpn)
                    after.append(plan.loads())
                    replicas.append([holders[e] - (e in materialized[owners[e]]) for e in range(layer.num_experts)])
                else:
                    replicas.append([max(h - 1, 0) for h in holders])
        full = len(records)
        out.append(LayerHistory(layer.name, x, x_label, load, before if len(before) == full and full else None,
                                after if len(after) == full and full else None,
                                replicas if len(replicas) == full and full else None, owners))
    return out


# -- plotting helpers ------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _shown(indices: Sequence[int]) -> List[int]:
    """At most MAX_LAYERS_SHOWN layers, evenly spread (first and last included)."""
    indices = list(indices)
    if len(indices) <= MAX_LAYERS_SHOWN:
        return indices
    picks = {round(i * (len(indices) - 1) / (MAX_LAYERS_SHOWN - 1)) for i in range(MAX_LAYERS_SHOWN)}
    return [indices[i] for i in sorted(picks)]


def _layers_note(shown: int, total: int) -> str:
    return "" if shown == total else f" ({shown} of {total} layers shown)"


def _edges(x: Sequence[float]) -> List[float]:
    """Cell edges around the centres ``x`` for pcolormesh."""
    if len(x) == 1:
        return [x[0] - 0.5, x[0] + 0.5]
    mids = [(a + b) / 2 for a, b in zip(x, x[1:])]
    return [x[0] - (mids[0] - x[0])] + mids + [x[-1] + (x[-1] - mids[-1])]


def _byte_unit(max_bytes: float) -> Tuple[float, str]:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if max_bytes >= scale:
            return float(scale), unit
    return 1.0, "bytes"


def _save(fig, path: str) -> str:
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _expert_ticks(ax, experts: int, owners: Optional[Sequence[int]]) -> None:
    """Every expert labelled (with its owner rank when known) when there are few enough to read."""
    if experts > 16:
        return
    ax.set_yticks(range(experts))
    if owners is not None:
        ax.set_yticklabels([f"{e} (rank {owners[e]})" for e in range(experts)], fontsize=8)
        ax.set_ylabel("expert (owner)")


def _integer_x(ax) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


# -- plots from a trace ----------------------------------------------------------------------------------------------
def plot_expert_load(histories: List[LayerHistory], path: str, top_k: int) -> str:
    """Heatmap per layer: token-expert pairs per expert (all ranks) over iterations."""
    plt = _pyplot()
    shown = _shown(range(len(histories)))
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.2 + 2.6 * len(shown)), squeeze=False,
                             constrained_layout=True)
    for ax, index in zip(axes[:, 0], shown):
        h = histories[index]
        experts = len(h.expert_load[0]) if h.expert_load else 0
        grid = [[h.expert_load[c][e] for c in range(len(h.x))] for e in range(experts)]
        mesh = ax.pcolormesh(_edges(h.x), [e - 0.5 for e in range(experts + 1)], grid, cmap="viridis",
                             shading="flat")
        ax.set_ylim(experts - 0.5, -0.5)
        ax.set_title(f"layer {index} ({h.name})")
        ax.set_ylabel("expert")
        ax.set_xlabel(h.x_label)
        _integer_x(ax)
        _expert_ticks(ax, experts, h.owners)
        fig.colorbar(mesh, ax=ax, label="tokens routed\n(token-expert pairs, all ranks)", pad=0.01)
    fig.suptitle(f"Expert load over training (top-{top_k} routing){_layers_note(len(shown), len(histories))}",
                 fontsize=13)
    return _save(fig, path)


def plot_rank_compute(histories: List[LayerHistory], path: str, world_size: int) -> Optional[str]:
    """Per layer: each rank's expert compute (token-expert pairs) under plain expert parallelism and under the
    executed plan; bands (min..max) instead of per-rank lines above 8 ranks."""
    usable = [i for i, h in enumerate(histories) if h.compute_before is not None and h.compute_after is not None]
    if not usable:
        return None
    plt = _pyplot()
    shown = _shown(usable)
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.2 + 3.0 * len(shown)), squeeze=False,
                             constrained_layout=True)
    colors = plt.get_cmap("tab10").colors
    for ax, index in zip(axes[:, 0], shown):
        h = histories[index]
        before, after = h.compute_before, h.compute_after
        assert before is not None and after is not None   # a usable layer's
        mean = [sum(row) / world_size for row in before]
        if world_size <= 8:
            ax.fill_between(h.x, [min(row) for row in before], [max(row) for row in before], color="tab:red",
                            alpha=0.1, label="spread over ranks, before")
            for r in range(world_size):
                ax.plot(h.x, [row[r] for row in before], color=colors[r % 10], linestyle="--", linewidth=1.2,
                        alpha=0.7)
                ax.plot(h.x, [row[r] for row in after], color=colors[r % 10], linewidth=2.0, label=f"rank {r}")
        else:
            ax.fill_between(h.x, [min(row) for row in before], [max(row) for row in before], color="tab:red",
                            alpha=0.25, label="min..max over ranks, before")
            ax.fill_between(h.x, [min(row) for row in after], [max(row) for row in after], color="tab:blue",
                            alpha=0.45, label="min..max over ranks, after")
        ax.plot(h.x, mean, color="black", linestyle=":", linewidth=1.5, label="mean (ideal balance)")
        imb_b = sum(max(row) for row in before) / max(sum(mean), 1e-9)
        imb_a = sum(max(row) for row in after) / max(sum(mean), 1e-9)
        ax.set_title(f"layer {index} ({h.name}): max/mean {imb_b:.2f} before, {imb_a:.2f} after balancing")
        ax.set_ylabel("token-expert pairs\nprocessed per rank")
        ax.set_xlabel(h.x_label)
        ax.grid(alpha=0.3)
        _integer_x(ax)
        handles, labels = ax.get_legend_handles_labels()
        if world_size <= 8:
            from matplotlib.lines import Line2D
            handles += [Line2D([], [], color="grey", linestyle="--"), Line2D([], [], color="grey", linewidth=2)]
            labels += ["before: owners only (plain EP)", "after: Hecate's plan"]
        if ax is axes[0, 0]:  # one legend: every panel uses the same styles
            ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(f"Per-rank expert compute before / after balancing{_layers_note(len(shown), len(usable))}",
                 fontsize=13)
    return _save(fig, path)


def plot_replicas(histories: List[LayerHistory], path: str, world_size: int) -> Optional[str]:
    """Heatmap per layer: how many ranks besides its owner hold each expert, over iterations."""
    replicas = {i: h.replicas for i, h in enumerate(histories) if h.replicas is not None}
    usable = list(replicas)
    if not usable:
        return None
    plt = _pyplot()
    from matplotlib.colors import BoundaryNorm
    shown = _shown(usable)
    top = max(1, max(max(max(row) for row in replicas[i]) for i in shown))
    cmap = plt.get_cmap("Blues", top + 1)
    norm = BoundaryNorm([v - 0.5 for v in range(top + 2)], cmap.N)
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.2 + 2.6 * len(shown)), squeeze=False,
                             constrained_layout=True)
    for ax, index in zip(axes[:, 0], shown):
        h, rows = histories[index], replicas[index]
        experts = len(rows[0])
        grid = [[rows[c][e] for c in range(len(h.x))] for e in range(experts)]
        mesh = ax.pcolormesh(_edges(h.x), [e - 0.5 for e in range(experts + 1)], grid, cmap=cmap, norm=norm,
                             shading="flat", edgecolors="white", linewidth=0.3 if len(h.x) <= 100 else 0)
        ax.set_ylim(experts - 0.5, -0.5)
        total = sum(sum(row) for row in rows)
        ax.set_title(f"layer {index} ({h.name}): {total / max(len(h.x), 1):.1f} replicas per iteration on average")
        ax.set_ylabel("expert")
        ax.set_xlabel(h.x_label)
        _integer_x(ax)
        _expert_ticks(ax, experts, h.owners)
        bar = fig.colorbar(mesh, ax=ax, label="replicas\n(ranks besides the owner)", pad=0.01,
                           ticks=range(top + 1))
        bar.ax.tick_params(labelsize=8)
    fig.suptitle(f"Experts materialized on other ranks ({world_size} ranks)"
                 f"{_layers_note(len(shown), len(usable))}", fontsize=13)
    return _save(fig, path)


# -- plots from the CSV monitor --------------------------------------------------------------------------------------
def _summed(run: MonitorRun, metric: str) -> Tuple[List[float], List[float]]:
    """A metric summed over layers, per x."""
    totals: Dict[float, float] = {}
    for layer in run.layers():
        for x, y in zip(*run.get(layer, metric)):
            totals[x] = totals.get(x, 0.0) + y
    xs = sorted(x for x in totals if x == x)
    return xs, [totals[x] for x in xs]


def plot_communication(run: MonitorRun, path: str) -> Optional[str]:
    """Stacked bars per step: bytes rank 0 sent per sparse collective, all MoE layers together; plus token rows
    crossing nodes when any did."""
    kinds = [("bytes_allgather", "SparseAllGather (experts)", "tab:blue"),
             ("bytes_reducescatter", "SparseReduceScatter (expert grads)", "tab:orange"),
             ("bytes_dispatch", "token dispatch + combine (fwd + bwd)", "tab:green")]
    data = {k: _summed(run, k) for k, _, _ in kinds}
    xs = sorted({x for k in data for x in data[k][0]})
    if not xs:
        return None
    cross_x, cross = _summed(run, "cross_node_tokens")
    crossing = any(cross)
    plt = _pyplot()
    fig, axes = plt.subplots(2 if crossing else 1, 1, figsize=(10, 7 if crossing else 4.5), squeeze=False,
                             constrained_layout=True)
    ax = axes[0, 0]
    values = {k: dict(zip(*data[k])) for k in data}
    peak = max(sum(values[k].get(x, 0.0) for k in values) for x in xs)
    scale, unit = _byte_unit(peak)
    bottom = [0.0] * len(xs)
    width = 0.8 * (min(b - a for a, b in zip(xs, xs[1:])) if len(xs) > 1 else 1.0)
    for key, label, color in kinds:
        heights = [values[key].get(x, 0.0) / scale for x in xs]
        ax.bar(xs, heights, width=width, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel(f"sent by rank 0 ({unit})")
    ax.set_xlabel(run.x_label)
    ax.set_title(f"Communication volume per step, {len(run.layers())} MoE layer(s) together (rank 0's sends)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(axis="y", alpha=0.3)
    _integer_x(ax)
    if crossing:
        ax2 = axes[1, 0]
        ax2.bar(cross_x, cross, width=width, color="tab:purple")
        ax2.set_ylabel("token rows")
        ax2.set_xlabel(run.x_label)
        ax2.set_title("Tokens crossing nodes per step (all ranks)")
        ax2.grid(axis="y", alpha=0.3)
        _integer_x(ax2)
    return _save(fig, path)


def plot_imbalance(run: MonitorRun, path: str) -> Optional[str]:
    """Per layer: max/mean per-rank expert load per step, plain expert parallelism vs Hecate's plan."""
    usable = [l for l in run.layers() if run.get(l, "imbalance_before")[0]]
    if not usable:
        return None
    plt = _pyplot()
    shown = _shown(usable)
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.2 + 2.6 * len(shown)), squeeze=False,
                             constrained_layout=True, sharex=True)
    for ax, layer in zip(axes[:, 0], shown):
        xb, before = run.get(layer, "imbalance_before")
        xa, after = run.get(layer, "imbalance_after")
        ax.plot(xb, before, color="tab:red", linestyle="--", marker=".", label="before: owners only (plain EP)")
        ax.plot(xa, after, color="tab:blue", linewidth=2, marker=".", label="after: Hecate's plan")
        if list(xa) == list(xb):   # the imbalance the plan took away, as an area
            ax.fill_between(xb, after, before, where=[b >= a for a, b in zip(after, before)], interpolate=True,
                            color="tab:green", alpha=0.25, label="removed by balancing")
            ax.fill_between(xb, 1.0, after, color="tab:blue", alpha=0.08, label="left after balancing")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":", label="perfect balance")
        mb = sum(before) / len(before)
        ma = sum(after) / len(after) if after else float("nan")
        ax.set_title(f"layer {layer}: mean {mb:.2f} before, {ma:.2f} after")
        ax.set_ylabel("max / mean load\nper rank")
        ax.grid(alpha=0.3)
        if ax is axes[0, 0]:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        _integer_x(ax)
    axes[-1, 0].set_xlabel(run.x_label)
    fig.suptitle(f"Expert load imbalance per step{_layers_note(len(shown), len(usable))}", fontsize=13)
    return _save(fig, path)


def plot_phase_time(run: MonitorRun, path: str) -> Optional[str]:
    """Stacked bars per step: rank 0's time in each runtime phase, all MoE layers together."""
    series = {p: _summed(run, f"time_ms_{p}") for p in PHASE_LABELS}
    series = {p: s for p, s in series.items() if s[0] and any(v > 0 for v in s[1])}
    if not series:
        return None
    plt = _pyplot()
    xs = sorted({x for s in series.values() for x in s[0]})
    width = 0.8 * (min(b - a for a, b in zip(xs, xs[1:])) if len(xs) > 1 else 1.0)
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(10, 4.5), constrained_layout=True)
    bottom = [0.0] * len(xs)
    for i, (phase, (px, py)) in enumerate(series.items()):
        values = dict(zip(px, py))
        heights = [values.get(x, 0.0) for x in xs]
        ax.bar(xs, heights, width=width, bottom=bottom, label=PHASE_LABELS[phase], color=colors[i % 10])
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("milliseconds (rank 0)")
    ax.set_xlabel(run.x_label)
    ax.set_title(f"Time per MoE runtime phase per step, {len(run.layers())} layer(s) together")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(axis="y", alpha=0.3)
    _integer_x(ax)
    return _save(fig, path)


# -- entry point -----------------------------------------------------------------------------------------------------
def _prefix(path: str, root: str, many: bool) -> str:
    if not many:
        return ""
    rel = os.path.relpath(path, root)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.splitext(rel)[0]).strip("_") + "_"


def report(run_dir: str, out_dir: Optional[str] = None) -> List[str]:
    """Write the PNG plots for ``run_dir`` into ``out_dir`` (default: ``run_dir/report``); returns their paths."""
    traces, monitors = find_inputs(run_dir)
    if not traces and not monitors:
        raise ReportError(
            f"report: found neither a ds_hecate trace (*.jsonl) nor Hecate CSV monitor files (Hecate_layer*_*.csv) "
            f"under {run_dir!r}; enable them with hecate.trace_file and DeepSpeed's csv_monitor section, or run "
            "the example with --monitor-dir")
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    written: List[str] = []
    for path in traces:
        trace = read_trace(path)
        if not trace.records:
            continue
        histories = layer_histories(trace)
        prefix = _prefix(path, run_dir, len(traces) > 1)
        written.append(plot_expert_load(histories, os.path.join(out_dir, f"{prefix}expert_load.png"), trace.top_k))
        for made in (plot_rank_compute(histories, os.path.join(out_dir, f"{prefix}rank_compute.png"),
                                       trace.world_size),
                     plot_replicas(histories, os.path.join(out_dir, f"{prefix}replicas.png"), trace.world_size)):
            if made:
                written.append(made)
    for directory in monitors:
        run = read_monitor_dir(directory)
        prefix = _prefix(directory, run_dir, len(monitors) > 1)
        for plot, name in ((plot_communication, "communication"), (plot_imbalance, "imbalance"),
                           (plot_phase_time, "phase_time")):
            made = plot(run, os.path.join(out_dir, f"{prefix}{name}.png"))
            if made:
                written.append(made)
    if not written:
        raise ReportError(f"report: the inputs under {run_dir!r} hold no records yet (a run that stopped before its "
                          "first MoE forward call?)")
    return written
