"""The simulator against a measured run: does it predict the step times of ``python -m benchmarks.step``?

For every workload of a run record (schema ``ds_hecate-benchmark/1``) this simulates a cluster of the run's world
size built from that run's measured unit costs, with the run's model and exactly the routing counts it forced, and
compares the predicted median step with the measured one. Nothing is fitted to the step being predicted.

- ``compute_s_per_pair``, ``link_gbps``, ``non_moe_time_s`` (and ``replica_overhead_s`` when recorded): ds_hecate's
  own measurement at its first steps (``engine.hecate.stats()["measured_costs"]``): unit costs, not step times.
- **alpha-beta** model, when the run measured each system's *empty step* (its median step on an almost empty batch,
  ``empty_step_s``): the system's fixed cost per step (alpha) plus the work the simulator models (beta),
  ``empty_step_s[S] + 3 x layers x non_moe_time_s + the simulated MoE layers``, with the expert compute per pair
  taken warm from the ``ideal`` system of the same workload; the ``ideal`` row then reproduces its measurement by
  construction and is marked as the calibration source.
- **measured-costs** model otherwise: the unit costs as measured (the cold first steps'), the per-step time outside
  the blocks the ``ideal`` system's optimizer phase (a lower bound: DeepSpeed's engine work around its optimizer is
  left out).

Rows: simulator ``hecate`` against ``ds_hecate``; ``ep`` (dropless expert parallelism) against ``autoep``; ``ep`` on
padded counts (every expert padded to the step's largest count, DeepSpeed's legacy layer with
``drop_tokens=False``) against ``deepspeed-ep`` (a diagnostic); ``ideal`` against ``ideal``.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Mapping, Optional, Tuple

SCHEMA = "ds_hecate-calibration/1"
TOLERANCE = 0.25
REQUIRED_COSTS = ("compute_s_per_pair", "link_gbps", "non_moe_time_s")
OPTIONAL_COSTS = ("replica_overhead_s",)
#: (row, simulator system, measured system, padded counts, acceptance row)
ROWS = (("hecate", "hecate", "ds_hecate", False, True), ("ep", "ep", "autoep", False, True),
        ("ep-padded", "ep", "deepspeed-ep", True, False), ("ideal", "ideal", "ideal", False, False))
Counts = List[List[List[List[int]]]]   # [step][layer][rank][expert]


class CalibrationError(ValueError):
    """A run record the calibration cannot use (the message names what is missing)."""


def benchmark_model(results: dict):
    """The run's model: ``layers`` blocks of (Linear hidden x hidden + tanh, top-k MoE of SwiGLU experts)."""
    from .presets import ModelShape
    cfg = _require(results, "config", "the benchmark's arguments")
    for key in ("layers", "hidden", "ffn", "experts", "top_k", "tokens", "steps", "warmup", "seed"):
        if key not in cfg:
            raise CalibrationError(f"results['config'] lacks {key!r} (expected the arguments of benchmarks.step)")
    hidden = int(cfg["hidden"])
    return ModelShape(name="benchmark", moe_layers=int(cfg["layers"]), hidden_size=hidden, ffn_size=int(cfg["ffn"]),
                      num_experts=int(cfg["experts"]), top_k=int(cfg["top_k"]), vocab_size=0,
                      seq_len=int(cfg["tokens"]), expert_matrices=3, attention_params=hidden * hidden + hidden,
                      description="the step benchmark's model: Linear + tanh, then a SwiGLU MoE, per block")


def _require(d: dict, key: str, what: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CalibrationError(f"results lack {key!r} ({what}); expected a benchmarks.step run record")
    return d[key]


def padded(counts: Counts) -> Counts:
    """DeepSpeed's legacy layer without dropping: every (rank, expert) slot padded to the call's largest count."""
    return [[[[max(max(r) for r in c)] * len(row) for row in c] for c in layers] for layers in counts]


def _fixed_step(systems: dict) -> Optional[float]:
    ideal = systems.get("ideal") or {}
    phases = (ideal.get("phases_s") or []) if ideal.get("status") == "ok" else []
    values = [p["optimizer"] for p in (phases if isinstance(phases, list) else [phases]) if "optimizer" in p]
    return max(values) if values else None


def empty_steps_of(results: dict) -> Dict[str, float]:
    """``empty_step_s`` per system of a run record (empty when the run did not measure them)."""
    return {s: float(v["empty_step_s"]) for s, v in (results.get("systems") or {}).items()
            if isinstance(v, dict) and isinstance(v.get("empty_step_s"), (int, float))}


def _costs(wname: str, systems: dict, counts: Counts, empty: Dict[str, float], alpha_beta: bool, layers: int,
           warmup: int, world: int) -> Tuple[Dict[str, float], str, List[str]]:
    """(the cluster's unit costs, the model's name, notes) of one workload."""
    measured = (systems.get("ds_hecate") or {}).get("measured_costs")
    missing = [k for k in REQUIRED_COSTS if not isinstance(measured, dict) or k not in measured]
    if missing or not isinstance(measured, dict):
        raise CalibrationError(f"workload {wname}: systems['ds_hecate']['measured_costs'] lacks {missing} "
                               "(engine.hecate.stats()['measured_costs'] of the run)")
    costs = {k: float(v) for k, v in measured.items() if isinstance(v, (int, float))}
    ideal = systems.get("ideal") or {}
    if alpha_beta and ideal.get("status") == "ok":
        pairs = statistics.mean(sum(map(sum, c)) / world for call in counts[warmup:] for c in call)
        warm = (ideal["median_step_s"] - empty["ideal"] - 3 * layers * costs["non_moe_time_s"]) / (layers * pairs)
        if warm <= 0:
            raise CalibrationError(f"workload {wname}: the ideal's median step ({ideal['median_step_s']:.4f} s) is "
                                   f"not above its empty step ({empty['ideal']:.4f} s) plus the dense time; the "
                                   "empty-step figures do not belong to this machine or run")
        return {**costs, "compute_s_per_pair": warm, "fixed_step_s": 0.0, "layer_overhead_s": 0.0}, "alpha-beta", []
    notes = [f"{wname}: no ideal measured, measured-costs model"] if alpha_beta else []
    fixed = _fixed_step(systems)
    if fixed is None:
        notes.append("no ideal in the run: the optimizer step is not modelled (fixed_step_s = 0)")
    return {**costs, "fixed_step_s": fixed or 0.0}, "measured-costs", notes


def _simulate(results: dict, wname: str, costs: Dict[str, float], counts: Counts) -> Dict[bool, Any]:
    """The simulations of one workload: unpadded (hecate, ep, ideal) and padded (ep)."""
    from ..config import HecateConfig
    from . import SimSettings, simulate
    from .presets import Cluster
    cfg, world = results["config"], int(results["world_size"])
    steps, warmup = int(cfg["warmup"]) + int(cfg["steps"]), int(cfg["warmup"])
    measured = results["workloads"][wname]["systems"]["ds_hecate"]["measured_costs"]
    # the hecate section the benchmark gives ds_hecate (defaults otherwise)
    hecate = HecateConfig(enabled=True, placement="hecate", reshard_interval=0, log_conversion=False)
    cluster = Cluster.from_measured(costs, world_size=world, name="benchmark-run")
    sims = {}
    for pad in (False, True):
        settings = SimSettings(steps=steps, warmup=warmup, seed=int(cfg["seed"]), hecate=hecate, zero_stage=2,
                               precision="fp32", force_balanced=not pad,   # padding a uniform routing is no counterpart
                               planner_costs={k: float(measured[k]) for k in REQUIRED_COSTS + OPTIONAL_COSTS
                                              if k in measured},
                               charge_planning=False)   # the measured empty step already holds the host planning
        sims[pad] = simulate(cluster, benchmark_model(results), wname, settings,
                             systems=["ep"] if pad else ["hecate", "ep", "ideal"],
                             counts=padded(counts) if pad else counts)
    return sims


def _row(sim: Any, systems: dict, row: Tuple, model: str, empty: Dict[str, float], warmup: int, tolerance: float,
         measured_fb: Mapping[Tuple[str, str], float], wname: str) -> Dict[str, Any]:
    name, sim_name, meas_name, pad, acceptance = row
    predicted = statistics.median(sim.step_times_s[warmup:])
    m = systems.get(meas_name)
    entry: Dict[str, Any] = {"simulated": sim_name + (" (padded counts)" if pad else ""), "measured_system": meas_name,
                             "predicted_s": predicted, "acceptance": acceptance, "breakdown_s": sim.breakdown_s,
                             "replicas_per_layer": sim.replicas_per_layer, "imbalance": sim.imbalance}
    if model == "alpha-beta":
        if meas_name in empty:
            entry["predicted_s"] = predicted = predicted + empty[meas_name]
            entry["empty_step_s"] = empty[meas_name]
        else:
            m = {"status": "skipped", "reason": f"no empty_step_s for {meas_name}"}
        if meas_name == "ideal":
            entry.update(acceptance=False, calibration_source=True)
    alpha = entry.get("empty_step_s", 0.0)   # the simulator's force-balanced step, with the same alpha
    entry["predicted_force_balanced_fraction"] = (None if pad else (sim.force_balanced_step_s + alpha)
                                                  / (sim.step_time_s + alpha))
    if m and m.get("status") == "ok":
        error = predicted / m["median_step_s"] - 1.0
        entry.update(measured_s=m["median_step_s"], error=error, within=abs(error) <= tolerance,
                     measured_force_balanced_fraction=measured_fb.get((wname, meas_name)))
        if meas_name == "ds_hecate":   # does the replayed planner make the run's decisions?
            entry.update(measured_replicas_per_layer=m.get("replicas_per_layer"),
                         measured_imbalance=m.get("load_max_over_mean"))
    else:
        entry.update(measured_s=None, error=None, within=None, reason=(m or {}).get("reason", "not in the run"))
    return entry


def calibrate(results: dict, counts: Mapping[str, Counts], tolerance: float = TOLERANCE,
              empty_steps: Optional[Dict[str, float]] = None,
              measured_fb: Optional[Mapping[Tuple[str, str], float]] = None) -> dict:
    """Per workload of ``results``: predicted against measured median step of ds_hecate, AutoEP, DeepSpeed's legacy
    MoE and the ideal, the relative error ``predicted / measured - 1`` and whether it is within ``tolerance``.

    ``counts``: per workload the counts the run forced (``[step][layer][rank][expert]``, warm-up included);
    ``empty_steps``: per-system empty steps (default: the record's); ``measured_fb``: the run's force-balanced
    fractions per (workload, system), reported beside the simulator's."""
    model_shape = benchmark_model(results)
    cfg = results["config"]
    world = int(_require(results, "world_size", "ranks of the run"))
    workloads = _require(results, "workloads", "per-workload measurements")
    warmup = int(cfg["warmup"])
    empty = dict(empty_steps) if empty_steps is not None else empty_steps_of(results)
    alpha_beta = "ideal" in empty and any(m in empty for _, _, m, _, _ in ROWS if m != "ideal")
    out: Dict[str, Any] = {}
    for wname, w in workloads.items():
        systems = w.get("systems") or {}
        ds = systems.get("ds_hecate")
        if not ds or ds.get("status") != "ok":
            raise CalibrationError(f"workload {wname}: no measured ds_hecate (systems['ds_hecate'] "
                                   f"{'missing' if not ds else 'skipped'}); its measured_costs are the simulator's "
                                   "inputs, run the benchmark with ds_hecate among --systems")
        if wname not in counts:
            raise CalibrationError(f"workload {wname}: no routing counts given for it")
        costs, model, notes = _costs(wname, systems, counts[wname], empty, alpha_beta, model_shape.moe_layers,
                                     warmup, world)
        sims = _simulate(results, wname, costs, counts[wname])
        rows = {row[0]: _row(sims[row[3]].systems[row[1]], systems, row, model, empty, warmup, tolerance,
                             measured_fb or {}, wname) for row in ROWS}
        out[wname] = {"title": w.get("title", wname), "model": model, "costs": costs, "rows": rows,
                      "notes": notes + list(sims[False].notes)}
    return {"schema": SCHEMA, "tolerance": tolerance, "source": {k: results.get(k) for k in ("date", "command")},
            "world_size": world, "empty_steps_s": empty, "workloads": out, "summary": _summary(out, tolerance)}


def _summary(workloads: Dict[str, Any], tolerance: float) -> Dict[str, Any]:
    summary: Dict[str, Any] = {}
    for row, _, meas, _, _ in ROWS:
        errors = {w: v["rows"][row]["error"] for w, v in workloads.items()
                  if v["rows"][row]["error"] is not None and not v["rows"][row].get("calibration_source")}
        summary[row] = {"measured_system": meas, "acceptance": any(v["rows"][row]["acceptance"]
                                                                   for v in workloads.values()),
                        "compared": len(errors), "within": sum(abs(e) <= tolerance for e in errors.values()),
                        "max_abs_error": max((abs(e) for e in errors.values()), default=None),
                        "outside": sorted(w for w, e in errors.items() if abs(e) > tolerance)}
    plans = [(w, v["rows"]["hecate"]) for w, v in workloads.items()
             if v["rows"]["hecate"].get("measured_replicas_per_layer") is not None]
    same = [w for w, r in plans if abs(r["replicas_per_layer"] - r["measured_replicas_per_layer"]) < 1e-6
            and abs(r["imbalance"] - r["measured_imbalance"]) < 1e-3]
    summary["planner_replay"] = {"compared": len(plans), "same_decisions": len(same),
                                 "different": sorted(w for w, _ in plans if w not in same)}
    summary["models"] = sorted({v["model"] for v in workloads.values()})
    return summary


def summary_line(cal: dict) -> str:
    """The calibration in one sentence: per compared system how many workloads were within the tolerance, the
    largest error, and whether the replayed planner made the run's decisions."""
    tol, parts = cal["tolerance"], []
    for row, s in cal["summary"].items():
        if row in ("planner_replay", "models") or not s["compared"]:
            continue
        parts.append(f"{row} vs {s['measured_system']}: {s['within']}/{s['compared']} workloads within {tol:.0%}, "
                     f"max |error| {100 * s['max_abs_error']:.0f}%" + (f" (outside: {', '.join(s['outside'])})"
                                                                      if s["outside"] else "")
                     + ("" if s["acceptance"] else " [diagnostic]"))
    replay = cal["summary"]["planner_replay"]
    return (f"Simulator calibration ({' / '.join(cal['summary']['models'])} model): " + "; ".join(parts) + ". "
            f"Replayed planner: replicas per layer and compute imbalance equal the run's on "
            f"{replay['same_decisions']}/{replay['compared']} workloads"
            + (f" (different: {', '.join(replay['different'])})" if replay["different"] else "") + ".")


def format_markdown(cal: dict) -> str:
    """One row per workload and compared system, then :func:`summary_line` and the notes."""
    tol = cal["tolerance"]
    lines = [f"| workload | simulated | measured | predicted ms | measured ms | error | within {tol:.0%} |",
             "|---|---|---|---|---|---|---|"]
    for wname, w in cal["workloads"].items():
        for row in w["rows"].values():
            if row["measured_s"] is None:
                lines.append(f"| {wname} | {row['simulated']} | {row['measured_system']} (not measured) | "
                             f"{1e3 * row['predicted_s']:.1f} | | | |")
                continue
            mark = "(calibration source)" if row.get("calibration_source") else "yes" if row["within"] else "**NO**"
            lines.append(f"| {wname} | {row['simulated']} | {row['measured_system']} | {1e3 * row['predicted_s']:.1f} "
                         f"| {1e3 * row['measured_s']:.1f} | {100 * row['error']:+.0f}% | {mark} |")
    fb = [f"{w} {row['measured_system']} {row['predicted_force_balanced_fraction']:.2f} / "
          f"{row['measured_force_balanced_fraction']:.2f}" for w, v in cal["workloads"].items()
          for row in v["rows"].values() if row.get("acceptance") and row.get("measured_force_balanced_fraction")
          is not None and row.get("predicted_force_balanced_fraction") is not None]
    lines += ["", summary_line(cal)]
    if fb:
        lines.append("Fraction of the force-balanced ideal, simulated / measured: " + ", ".join(fb) + ".")
    return "\n".join(lines + [f"Note: {n}." for n in sorted({n for w in cal["workloads"].values()
                                                               for n in w["notes"]})])
