"""Simulator calibration against a measured benchmark run: does ``ds-hecate simulate`` predict the 2-rank step time?

For every workload of a ``benchmarks/run.py`` results JSON (schema ``ds_hecate-benchmark/1``) this runs the simulator
(:func:`ds_hecate.sim.core.simulate`) on a cluster of the run's world size built from that run's measured unit
costs, with the benchmark's model shape and exactly the routing counts the benchmark forced, and compares the
predicted median step time with the measured median::

    python -m benchmarks.calibration docs/benchmark_results.json            # markdown table
    python -m benchmarks.calibration docs/benchmark_results.json --json cal.json

What the prediction may use (and what it does not):

- ``compute_s_per_pair``, ``link_gbps``, ``non_moe_time_s``: ds_hecate's own measurement at its first optimizer
  step (``engine.hecate.stats()["measured_costs"]``, recorded by the benchmark per workload). These are unit costs
  (seconds per token-expert pair forward + backward, GB/s of a gloo all-to-all, forward seconds of the non-MoE
  part of one block), not step times. ``non_moe_time_s`` covers the dense Linear + tanh, the gate and the
  framework work between two MoE calls; the simulator counts it 3x per block (forward + backward).
- ``fixed_step_s`` (per-step time outside the blocks): the optimizer phase of the ``ideal`` system in the same
  run (max over ranks): torch AdamW over one rank's share of the experts (E / world per layer) and the dense
  weights, which is the parameter set the ds_hecate and EP ranks update as well. It is the ideal's phase, never the
  predicted system's own time; it leaves out DeepSpeed's engine overhead around its optimizer (ZeRO-2 gradient
  bucketing and flattening), which the ideal does not have, so it is a lower bound. Without ``ideal`` in the run it
  is 0 (said in the notes).
- Optional unit costs the run may record beside ``measured_costs`` (``layer_overhead_s``,
  ``collective_latency_s``, see :meth:`ds_hecate.sim.presets.Cluster.from_measured`) are used when present.

Nothing is fitted: no factor depends on the workload or on the measured step time being predicted. The ``ideal``
row is a diagnostic, not an acceptance figure: it has no communication and no runtime overhead, so its error
isolates how far ``compute_s_per_pair`` (timed at the cold first step, backward assumed 2x forward) is from the warm
expert compute of the timed steps. On the 2-vCPU machine it is about 1.8x the warm cost, and that excess happens to
stand in for what this model lacks: each framework's fixed per-step work (Python, hooks, DeepSpeed's optimizer
wrapper, small collectives; tens of ms per step here).

Second model, ``alpha-beta``, used when the run also measured each system's *empty step* (``empty_step_s``: the
median step time of the system on an almost empty batch, a few tokens per rank, taken after the workloads; in
``results["systems"][S]["empty_step_s"]``, or passed as ``empty_steps``): a per-system fixed cost (alpha, measured
at ~zero work, never on the step being predicted) plus the work the simulator models (beta): ::

    predicted(S) = empty_step_s[S] + 3 x layers x non_moe_time_s + sum over layers of the simulated MoE layer time

with the expert compute per pair taken warm from the ideal system of the same workload:
``(ideal median - ideal empty_step_s - 3 x layers x non_moe_time_s) / (layers x mean pairs per rank)``. The
``ideal`` row then reproduces its measurement by construction and is marked as the calibration source.

Systems compared: simulator ``hecate`` with ``ds_hecate``; simulator ``ep`` (dropless expert parallelism) with
``autoep`` (DeepSpeed AutoEP, dropless); simulator ``ep`` on padded counts (every expert padded to the step's
largest per-rank count, what DeepSpeed's legacy layer does with ``drop_tokens=False``) with ``deepspeed-ep``;
simulator ``ideal`` with ``ideal``. The medians of the timed steps are compared (the simulator's per-step times
after the same warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

SCHEMA = "ds_hecate-calibration/1"
TOLERANCE = 0.25
REQUIRED_COSTS = ("compute_s_per_pair", "link_gbps", "non_moe_time_s")
#: measured costs the planner uses when the run recorded them (older results lack them)
OPTIONAL_COSTS = ("replica_overhead_s",)
#: (row name, simulator system, measured benchmark system, padded counts, acceptance row)
ROWS = (("hecate", "hecate", "ds_hecate", False, True),
        ("ep", "ep", "autoep", False, True),
        ("ep-padded", "ep", "deepspeed-ep", True, False),
        ("ideal", "ideal", "ideal", False, False))


class CalibrationError(ValueError):
    """A results dict the calibration cannot use (what is missing is named in the message)."""


def benchmark_model(results: dict):
    """The benchmark's model as a :class:`ModelShape`: ``layers`` blocks of (Linear hidden x hidden + tanh, top-k
    MoE of SwiGLU experts hidden x ffn), no attention and no vocabulary."""
    from ds_hecate.sim.presets import ModelShape
    cfg = _require(results, "config", "the benchmark's arguments")
    for key in ("layers", "hidden", "ffn", "experts", "top_k", "tokens", "steps", "warmup", "seed"):
        if key not in cfg:
            raise CalibrationError(f"results['config'] lacks {key!r} (expected the arguments of benchmarks/run.py)")
    hidden = int(cfg["hidden"])
    return ModelShape(name="benchmark", moe_layers=int(cfg["layers"]), hidden_size=hidden, ffn_size=int(cfg["ffn"]),
                      num_experts=int(cfg["experts"]), top_k=int(cfg["top_k"]), vocab_size=0,
                      seq_len=int(cfg["tokens"]), expert_matrices=3, attention_params=hidden * hidden + hidden,
                      description="benchmarks/run.py model: Linear + tanh, then a SwiGLU MoE, per block")


def _require(d: dict, key: str, what: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CalibrationError(f"results lack {key!r} ({what}); expected a benchmarks/run.py results JSON")
    return d[key]


def _route_sources(results: dict, world: int) -> Dict[str, Any]:
    """The benchmark's own route sources for the run's arguments, by name
    (:func:`benchmarks.routes.sources_from_results`)."""
    from benchmarks.routes import sources_from_results
    return sources_from_results(results, world)


def replayed_counts(routes: Any, steps: int, layers: int) -> List[List[List[List[int]]]]:
    """``counts[step][layer]`` ([world][experts]) of a route source for ``steps`` steps (warm-up included): what the
    benchmark forced on every system's gates at those steps."""
    return [[routes.counts(s, layer) for layer in range(layers)] for s in range(steps)]


def _padded(counts: List[List[List[List[int]]]]) -> List[List[List[List[int]]]]:
    """Legacy DeepSpeed MoE without dropping: every (rank, expert) slot padded to the step's largest count."""
    out = []
    for layers in counts:
        row = []
        for c in layers:
            cap = max(max(r) for r in c)
            row.append([[cap] * len(r) for r in c])
        out.append(row)
    return out


def _fixed_step(systems: dict) -> Optional[float]:
    ideal = systems.get("ideal")
    if not ideal or ideal.get("status") != "ok":
        return None
    phases = ideal.get("phases_s") or []
    phases = phases if isinstance(phases, list) else [phases]
    values = [p["optimizer"] for p in phases if isinstance(p, dict) and "optimizer" in p]
    return max(values) if values else None


def empty_steps_of(results: dict) -> Dict[str, float]:
    """``empty_step_s`` per system recorded in ``results["systems"]`` (empty when the run did not measure them)."""
    return {s: float(v["empty_step_s"]) for s, v in (results.get("systems") or {}).items()
            if isinstance(v, dict) and isinstance(v.get("empty_step_s"), (int, float))}


def empty_steps_from_run(results: dict) -> Dict[str, float]:
    """``empty_step_s`` per system from a separate near-empty benchmark run (e.g. ``--tokens 8 --workloads W0``):
    the median step of its first workload, per system that ran."""
    workloads = _require(results, "workloads", "per-workload measurements")
    if not workloads:
        raise CalibrationError("the empty-step run has no workloads")
    first = next(iter(workloads.values()))["systems"]
    return {s: float(v["median_step_s"]) for s, v in first.items() if v.get("status") == "ok"}


def calibrate(results: dict, tolerance: float = TOLERANCE, empty_steps: Optional[Dict[str, float]] = None) -> dict:
    """Per workload of ``results``: predicted vs measured median step time for ds_hecate, AutoEP, legacy
    DeepSpeed-MoE and the ideal, with relative error ``predicted / measured - 1`` and ``|error| <= tolerance``.

    ``empty_steps``: per-system empty-step times (see the module docstring); default: those recorded in
    ``results``. With them (for ``ideal`` and the compared system) the ``alpha-beta`` model is used, otherwise the
    ``measured-costs`` model."""
    from ds_hecate.config import HecateConfig
    from ds_hecate.sim.presets import Cluster
    from ds_hecate.sim import SimSettings, simulate

    model = benchmark_model(results)
    cfg = results["config"]
    world = int(_require(results, "world_size", "ranks of the run"))
    workloads = _require(results, "workloads", "per-workload measurements")
    steps, warmup = int(cfg["warmup"]) + int(cfg["steps"]), int(cfg["warmup"])
    sources = _route_sources(results, world)
    # the hecate section benchmarks/run.py gives ds_hecate (defaults otherwise: budget, window, calibration off)
    hecate = HecateConfig(enabled=True, placement="hecate", reshard_interval=0, log_conversion=False)
    empty = dict(empty_steps) if empty_steps is not None else empty_steps_of(results)
    alpha_beta = "ideal" in empty and any(m in empty for _, _, m, _, _ in ROWS if m != "ideal")
    out: Dict[str, Any] = {}
    from benchmarks.force_balanced import force_balanced
    measured_fb = force_balanced(results)   # per workload and system: the measured force-balanced fraction
    for wname, w in workloads.items():
        systems = w.get("systems") or {}
        ds = systems.get("ds_hecate")
        if not ds or ds.get("status") != "ok":
            raise CalibrationError(f"workload {wname}: no measured ds_hecate (systems['ds_hecate'] "
                                   f"{'missing' if not ds else 'skipped'}); its measured_costs are the simulator's "
                                   "inputs, run the benchmark with ds_hecate among --systems")
        measured = ds.get("measured_costs")
        missing = [k for k in REQUIRED_COSTS if not isinstance(measured, dict) or k not in measured]
        if missing:
            raise CalibrationError(f"workload {wname}: systems['ds_hecate']['measured_costs'] lacks {missing} "
                                   "(engine.hecate.stats()['measured_costs'] of the run)")
        if wname not in sources:
            raise CalibrationError(f"workload {wname}: not among the run's workloads/traces in results['config'] "
                                   f"({', '.join(sources) or 'none'})")
        notes: List[str] = []
        counts = replayed_counts(sources[wname], steps, model.moe_layers)
        costs = {k: float(v) for k, v in measured.items() if isinstance(v, (int, float))}
        ideal = systems.get("ideal") or {}
        if alpha_beta and ideal.get("status") == "ok":
            layers = model.moe_layers
            pairs = statistics.mean(sum(map(sum, c)) / world for layer_counts in counts[warmup:] for c in layer_counts)
            warm = (ideal["median_step_s"] - empty["ideal"] - 3 * layers * costs["non_moe_time_s"]) / (layers * pairs)
            if warm <= 0:
                raise CalibrationError(f"workload {wname}: the ideal's median step ({ideal['median_step_s']:.4f} s) "
                                       f"is not above its empty step ({empty['ideal']:.4f} s) plus the dense time; "
                                       "the empty-step figures do not belong to this machine or run")
            costs.update(compute_s_per_pair=warm, fixed_step_s=0.0, layer_overhead_s=0.0)
            model_name = "alpha-beta"
        else:
            if alpha_beta:
                notes.append(f"{wname}: no ideal measured, measured-costs model")
            fixed = _fixed_step(systems)
            if fixed is None:
                notes.append("no ideal in the run: the optimizer step is not modelled (fixed_step_s = 0)")
            costs["fixed_step_s"] = fixed or 0.0
            model_name = "measured-costs"
        cluster = Cluster.from_measured(costs, world_size=world, name="benchmark-run")
        sims = {}
        for padded in (False, True):
            settings = SimSettings(steps=steps, warmup=warmup, seed=int(cfg["seed"]), hecate=hecate, zero_stage=2,
                                   precision="fp32",
                                   planner_costs={k: float(measured[k]) for k in REQUIRED_COSTS + OPTIONAL_COSTS
                                                  if k in measured},
                                   force_balanced=not padded,   # padding a uniform routing is no counterpart
                                   # the measured empty step already holds the runtime's host planning
                                   charge_planning=False)
            sims[padded] = simulate(cluster, model, wname, settings,
                                    systems=["ep"] if padded else ["hecate", "ep", "ideal"],
                                    counts=_padded(counts) if padded else counts)
        rows: Dict[str, Any] = {}
        for row, sim_name, meas_name, padded, acceptance in ROWS:
            sim = sims[padded].systems[sim_name]
            predicted = statistics.median(sim.step_times_s[warmup:])
            m = systems.get(meas_name)
            entry: Dict[str, Any] = {"simulated": sim_name + (" (padded counts)" if padded else ""),
                                     "measured_system": meas_name, "predicted_s": predicted,
                                     "acceptance": acceptance, "breakdown_s": sim.breakdown_s,
                                     "replicas_per_layer": sim.replicas_per_layer, "imbalance": sim.imbalance}
            if model_name == "alpha-beta":
                if meas_name in empty:
                    entry["predicted_s"] = predicted = predicted + empty[meas_name]
                    entry["empty_step_s"] = empty[meas_name]
                else:
                    m = {"status": "skipped", "reason": f"no empty_step_s for {meas_name}"}
                if meas_name == "ideal":
                    entry["acceptance"] = False
                    entry["calibration_source"] = True
            alpha = entry.get("empty_step_s", 0.0)   # the simulator's force-balanced step, with the same alpha
            entry["predicted_force_balanced_fraction"] = (None if padded else (sim.force_balanced_step_s + alpha)
                                                          / (sim.step_time_s + alpha))
            if m and m.get("status") == "ok":
                error = predicted / m["median_step_s"] - 1.0
                entry.update(measured_s=m["median_step_s"], error=error, within=abs(error) <= tolerance)
                entry["measured_force_balanced_fraction"] = (
                    measured_fb[wname]["systems"].get(meas_name, {}).get("force_balanced_fraction"))
                if meas_name == "ds_hecate":   # does the replayed planner make the run's decisions?
                    entry["measured_replicas_per_layer"] = m.get("replicas_per_layer")
                    entry["measured_imbalance"] = m.get("load_max_over_mean")
            else:
                entry.update(measured_s=None, error=None, within=None,
                             reason=(m or {}).get("reason", "not in the run"))
            rows[row] = entry
        out[wname] = {"title": w.get("title", wname), "model": model_name, "costs": costs, "rows": rows,
                      "notes": notes + list(sims[False].notes)}
    return {"schema": SCHEMA, "tolerance": tolerance, "source": {"date": results.get("date"),
                                                                   "command": results.get("command")},
            "world_size": world, "empty_steps_s": empty, "workloads": out, "summary": _summary(out, tolerance)}


def _summary(workloads: Dict[str, Any], tolerance: float) -> Dict[str, Any]:
    summary: Dict[str, Any] = {}
    for row, _, meas, _, _ in ROWS:
        errors = {w: v["rows"][row]["error"] for w, v in workloads.items()
                  if v["rows"][row]["error"] is not None and not v["rows"][row].get("calibration_source")}
        acceptance = any(v["rows"][row]["acceptance"] for v in workloads.values())
        summary[row] = {"measured_system": meas, "acceptance": acceptance, "compared": len(errors),
                        "within": sum(abs(e) <= tolerance for e in errors.values()),
                        "max_abs_error": max((abs(e) for e in errors.values()), default=None),
                        "outside": sorted(w for w, e in errors.items() if abs(e) > tolerance)}
    plans = [(w, v["rows"]["hecate"]) for w, v in workloads.items()
             if "measured_replicas_per_layer" in v["rows"]["hecate"]]
    same = [w for w, r in plans if r["measured_replicas_per_layer"] is not None
            and abs(r["replicas_per_layer"] - r["measured_replicas_per_layer"]) < 1e-6
            and abs(r["imbalance"] - r["measured_imbalance"]) < 1e-3]
    summary["planner_replay"] = {"compared": len(plans), "same_decisions": len(same),
                                 "different": sorted(w for w, _ in plans if w not in same)}
    summary["models"] = sorted({v["model"] for v in workloads.values()})
    return summary


def format_markdown(cal: dict) -> str:
    """A markdown table (one row per workload and compared system) and a summary line, for docs/benchmarks.md."""
    tol = cal["tolerance"]
    lines = [f"| workload | simulated | measured | predicted ms | measured ms | error | within {tol:.0%} |",
             "|---|---|---|---|---|---|---|"]
    for wname, w in cal["workloads"].items():
        for row in w["rows"].values():
            if row["measured_s"] is None:
                lines.append(f"| {wname} | {row['simulated']} | {row['measured_system']} (not measured) | "
                             f"{1e3 * row['predicted_s']:.1f} | | | |")
                continue
            mark = ("(calibration source)" if row.get("calibration_source") else
                    "yes" if row["within"] else "**NO**")
            lines.append(f"| {wname} | {row['simulated']} | {row['measured_system']} | {1e3 * row['predicted_s']:.1f} "
                         f"| {1e3 * row['measured_s']:.1f} | {100 * row['error']:+.0f}% | {mark} |")
    parts = []
    for row, s in cal["summary"].items():
        if row in ("planner_replay", "models") or not s["compared"]:
            continue
        text = (f"{row} vs {s['measured_system']}: {s['within']}/{s['compared']} workloads within {tol:.0%}, "
                f"max |error| {100 * s['max_abs_error']:.0f}%")
        if s["outside"]:
            text += f" (outside: {', '.join(s['outside'])})"
        if not s["acceptance"]:
            text += " [diagnostic]"
        parts.append(text)
    replay = cal["summary"]["planner_replay"]
    lines += ["", f"Simulator calibration ({' / '.join(cal['summary']['models'])} model): " + "; ".join(parts) + ". "
              f"Replayed planner: replicas per layer and compute imbalance equal the run's on "
              f"{replay['same_decisions']}/{replay['compared']} workloads"
              + (f" (different: {', '.join(replay['different'])})" if replay["different"] else "") + "."]
    fb = [f"{w} {row['measured_system']} {row['predicted_force_balanced_fraction']:.2f} / "
          f"{row['measured_force_balanced_fraction']:.2f}"
          for w, v in cal["workloads"].items() for row in v["rows"].values()
          if row.get("acceptance") and row.get("measured_force_balanced_fraction") is not None
          and row.get("predicted_force_balanced_fraction") is not None]
    if fb:
        lines.append("Fraction of the force-balanced ideal, simulated / measured: " + ", ".join(fb) + ".")
    notes = sorted({n for w in cal["workloads"].values() for n in w["notes"]})
    lines += [f"Note: {n}." for n in notes]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="benchmarks/run.py results JSON (schema ds_hecate-benchmark/1)")
    p.add_argument("--json", default=None, help="also write the calibration as JSON to this file")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="relative error accepted (default 0.25)")
    p.add_argument("--empty-steps", default=None,
                   help="results JSON of a near-empty run on the same machine (e.g. benchmarks.run --tokens 8 "
                        "--workloads W0): its median steps are the systems' empty_step_s (alpha-beta model)")
    args = p.parse_args(argv)

    def load(path: str) -> dict:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"cannot read results {path!r}: {exc}")
    results = load(args.results)
    try:
        empty = empty_steps_from_run(load(args.empty_steps)) if args.empty_steps else None
        cal = calibrate(results, args.tolerance, empty)
    except CalibrationError as exc:
        raise SystemExit(f"{args.results}: {exc}")
    print(format_markdown(cal))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(cal, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
