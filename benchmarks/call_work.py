"""How well :class:`~ds_hecate.planning.search.call_work.CallWork` predicts a layer call's planning on this machine.

    python -m benchmarks.call_work [--trials 15] [--fit]

The simulator charges Hecate's host planning from what the planner did (``planning_clock: work``): per call, the
prediction's score and the rank's dispatch; where the prediction missed, the imbalance estimate; the shadow move's
estimates; a placement made after the gate, its dispatch tables; calibration's search in
:class:`~ds_hecate.planning.search.work.SearchWork` units. This times each of those pieces as the runtime's code runs
them (thread CPU time, a cache-sized buffer swept between trials, since a layer call finds its caches cold after the
model's compute) for 8 to 1,024 ranks and 8 to 256 experts, and prints measured / estimated medians per setting.
``--fit`` prints the constants (per piece: a part per call and one per (rank, expert) cell) that fit the medians by
least squares, how the defaults were chosen.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, List, Tuple

import numpy as np

from ds_hecate.planning.search.call_work import CALL_WORK, CallWork
from ds_hecate.planning.cost_model import estimate_layer, imbalance
from ds_hecate.planning.search import SearchSettings, calibration_affordable, calibration_settings, plan_after_gate
from ds_hecate.planning.dispatch import dispatch_flows
from ds_hecate.planning.dispatch_plan import DispatchPlan, rank_tables
from ds_hecate.planning.plan import Placement, holders_matrix, materialized_of
from ds_hecate.planning.search.reuse import ScheduleReuse
from ds_hecate.planning.sharding import even_sharding

from .planner import COSTS, RANKS_PER_NODE, REPLICAS_PER_RANK, draw_counts, zipf

SETTINGS = ((8, 8), (32, 64), (64, 64), (64, 256), (256, 256), (1024, 256))
PIECES = ("call", "score", "estimate", "tables")
_SWEEP = np.zeros(4 << 20, dtype=np.uint8)   # 4 MiB: more than this host's L2, swept between trials


def _timed(fn: Callable[[], object], trials: int) -> float:
    """Median thread CPU time of ``fn`` in microseconds, the caches swept before each trial."""
    out = []
    for _ in range(trials):
        np.add(_SWEEP, 1, out=_SWEEP)
        t0 = time.thread_time()
        fn()
        out.append(time.thread_time() - t0)
    return float(np.median(out)) * 1e6


def _shadowed(counts: np.ndarray, owners) -> np.ndarray:
    """The placement the shadow move makes on a burst: the hottest expert on every rank."""
    holders = holders_matrix(materialized_of(_owner_matrix(owners, counts.shape[0])), *counts.shape)
    holders[:, int(np.argmax(counts.sum(axis=0)))] = True
    return holders


def _owner_matrix(owners, world: int) -> np.ndarray:
    mat = np.zeros((world, len(owners)), dtype=bool)
    mat[np.asarray(owners), np.arange(len(owners))] = True
    return mat


def measure(trials: int, seed: int = 1) -> Dict[Tuple[int, int], Dict[str, float]]:
    """Median microseconds of each piece per (ranks, experts)."""
    rng = np.random.default_rng(seed)
    out: Dict[Tuple[int, int], Dict[str, float]] = {}
    for ranks, experts in SETTINGS:
        owners = tuple(even_sharding(experts, ranks))
        counts = draw_counts(rng, ranks, experts, 2, None)
        placement = Placement(owners, materialized_of(_owner_matrix(owners, ranks)))
        rank_tables(placement, RANKS_PER_NODE, 0)        # built with the prefetch, off the critical path
        schedule = ScheduleReuse(0.05)
        prediction = counts.astype(np.float64)
        settings = calibration_settings(COSTS, REPLICAS_PER_RANK, RANKS_PER_NODE, None)
        schedule.schedule(prediction, owners, SearchSettings(COSTS, REPLICAS_PER_RANK, RANKS_PER_NODE, budget_us=0.0))
        shadow = _shadowed(counts, owners)
        pieces = {
            # the prediction held: its score and the rank's dispatch, nothing else
            "call": lambda: plan_after_gate(counts, placement, schedule, settings, 0, True),
            "score": lambda: imbalance(dispatch_flows(counts.astype(np.float64).T, placement.holders.T,
                                                      RANKS_PER_NODE).processed.sum(axis=0).tolist()),
            "estimate": lambda: estimate_layer(counts, owners, shadow, COSTS, RANKS_PER_NODE,
                                               prefetched=placement.holders),
            "tables": lambda: DispatchPlan.build(counts, Placement(owners, materialized_of(shadow)),
                                                 RANKS_PER_NODE).for_rank(0),
        }
        out[(ranks, experts)] = {name: _timed(fn, trials) for name, fn in pieces.items()}
    return out


def fit(measured: Dict[Tuple[int, int], Dict[str, float]]) -> Dict[str, Tuple[float, float]]:
    """Per piece (per-call us, us per cell): least squares of the relative error on the medians, both at least 0,
    over the settings where calibration runs (:func:`~ds_hecate.planning.search.calibration_affordable`): beyond
    them a call neither scores nor calibrates, and its lighter path would bend the fit of the others."""
    settings = calibration_settings(COSTS, REPLICAS_PER_RANK, RANKS_PER_NODE, None)
    calibrating = {k: m for k, m in measured.items() if calibration_affordable(k[0], k[1], settings)}
    cells = np.array([r * e for r, e in calibrating], dtype=np.float64)
    design = np.stack([np.ones_like(cells), cells], axis=1)
    out = {}
    for name in PIECES:
        y = np.array([m[name] for m in calibrating.values()])
        (base, per_cell), *_ = np.linalg.lstsq(design / y[:, None], np.ones_like(y), rcond=None)  # relative error
        out[name] = (max(0.0, float(base)), max(0.0, float(per_cell)))
    return out


def _estimates(work: CallWork, ranks: int, experts: int) -> Dict[str, float]:
    return {"call": work.call_cost_us(ranks, experts), "score": work.score_cost_us(ranks, experts),
            "estimate": work.estimate_cost_us(ranks, experts), "tables": work.tables_cost_us(ranks, experts)}


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--fit", action="store_true", help="also print the constants that fit these medians")
    args = parser.parse_args(argv)
    measured = measure(args.trials)
    print("ranks x experts | " + " | ".join(f"{p}: measured us (measured / estimated)" for p in PIECES))
    for (ranks, experts), m in measured.items():
        est = _estimates(CALL_WORK, ranks, experts)
        print(f"{ranks} x {experts} | " + " | ".join(f"{m[p]:.0f} ({m[p] / est[p]:.2f})" for p in PIECES))
    if args.fit:
        for name, (base, per_cell) in fit(measured).items():
            print(f"{name}_us = {base:.1f}, {name}_us_per_cell = {per_cell:.4f}")


if __name__ == "__main__":
    main()
