"""How well :class:`~ds_hecate.planning.search.greedy.SearchWork` predicts the search's host time on this machine.

    python -m benchmarks.search_work [--trials 4] [--fit]

Search budgets (``search_budget_us``, ``plan_budget_us``) are counted in estimated microseconds of search work, not
on a clock, so that every rank stops at the same step. This times real searches (fresh ones from the sharded
placement, and calibration-like ones extending a placement searched for other loads) for 8 to 1,024 ranks and 8
to 256 experts, and prints per setting the measured / estimated ratio of the setup and of each step (median and 90th
percentile; above 1 the budget is overrun on this host). ``--fit`` also searches the constants that bring every
setting's 90th percentile to about 0.95, how the defaults were chosen.

A step is timed between two consecutive charges of the search (``step_cost_us`` is called once per step, after
the step's candidates are built): its evaluation, its move, and the next step's candidates. The setup runs from
the call to the first charge (state and first candidates).
"""
from __future__ import annotations

import argparse
import itertools
import time
from collections import defaultdict
from typing import Dict, List, Tuple

import numpy as np

from ds_hecate.config import HecateConfig
from ds_hecate.planning.plan import Placement
from ds_hecate.planning.search import SEARCH_WORK, SearchSettings, SearchWork, greedy_pass, schedule_materialization
from ds_hecate.planning.sharding import even_sharding

from .planner import COSTS, REPLICAS_PER_RANK, RANKS_PER_NODE, draw_counts, zipf

SETTINGS = ((8, 8), (8, 64), (8, 256), (64, 8), (64, 64), (64, 256), (256, 8), (256, 64), (256, 256),
            (1024, 8), (1024, 64), (1024, 256))
#: the budget of each timed search; at 1,024 ranks a first step costs more than that, so there the default
#: ``search_budget_us``
BUDGET_US = 20000.0


class _TimedWork(SearchWork):
    """The default work model, recording when the search charges a step (and how many moves it evaluates)."""

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "charges", [])   # SearchWork is frozen; the record is this subclass's own

    def first_step_us(self, *args, **kwargs) -> float:     # asked before the search starts: no step
        return SEARCH_WORK.first_step_us(*args, **kwargs)

    def step_cost_us(self, moves: int, world: int, num_experts: int) -> float:
        self.charges.append((time.perf_counter(), moves))
        return SEARCH_WORK.step_cost_us(moves, world, num_experts)


def measure(trials: int, seed: int = 1) -> List[Tuple[str, int, int, int, float]]:
    """Rows (kind, ranks, experts, moves, measured us) for setups and steps of real searches."""
    rng = np.random.default_rng(seed)
    rows = []
    for ranks, experts in SETTINGS:
        owners = tuple(even_sharding(experts, ranks))
        for _ in range(trials):
            counts = draw_counts(rng, ranks, experts, 8, zipf(rng, experts)).astype(np.float64)
            other = draw_counts(rng, ranks, experts, 8, zipf(rng, experts)).astype(np.float64)
            start = Placement(owners, schedule_materialization(
                other, owners, SearchSettings(COSTS, REPLICAS_PER_RANK, RANKS_PER_NODE, budget_us=3000))).holders
            for extra in ({}, {"start": start, "prefetched": start}):
                work = _TimedWork()
                budget_us = BUDGET_US if ranks < 1024 else HecateConfig().search_budget_us
                t0 = time.perf_counter()
                # one greedy pass, what SearchWork prices (a fresh schedule_materialization may run two)
                greedy_pass(counts, owners, SearchSettings(COSTS, REPLICAS_PER_RANK, RANKS_PER_NODE,
                                                           budget_us=budget_us,
                                                           work=work), **extra)
                end = time.perf_counter()
                if not work.charges:
                    continue
                rows.append(("setup", ranks, experts, 0, (work.charges[0][0] - t0) * 1e6))
                marks = [t for t, _ in work.charges] + [end]
                rows += [("step", ranks, experts, moves, (marks[i + 1] - marks[i]) * 1e6)
                         for i, (_, moves) in enumerate(work.charges)]
    return rows


def estimate(work: SearchWork, kind: str, ranks: int, experts: int, moves: int) -> float:
    return work.setup_cost_us(ranks, experts) if kind == "setup" else work.step_cost_us(moves, ranks, experts)


def ratios(rows, work: SearchWork) -> Dict[Tuple[str, int, int], np.ndarray]:
    out = defaultdict(list)
    for kind, ranks, experts, moves, us in rows:
        out[(kind, ranks, experts)].append(us / estimate(work, kind, ranks, experts, moves))
    return {k: np.asarray(v) for k, v in out.items()}


def fit(rows) -> SearchWork:
    """Constants whose per-setting 90th percentiles sit near 0.95 (overruns weigh ten times more)."""
    def objective(work: SearchWork, kind: str) -> float:
        p90 = np.array([np.percentile(r, 90) for (k, _, _), r in ratios(rows, work).items() if k == kind])
        return float(np.sum(np.log(p90 / 0.95) ** 2) + 10 * np.sum(np.maximum(0.0, p90 - 1.0) ** 2))

    setup = min(((su, sc) for su in range(40, 300, 10) for sc in np.arange(0.02, 0.1, 0.0025)),
                key=lambda c: objective(SearchWork(setup_us=c[0], setup_us_per_cell=c[1]), "setup"))
    step = min(itertools.product(range(300, 700, 20), (0, 0.0005, 0.001, 0.0015, 0.002, 0.003),
                                 np.arange(0.04, 0.12, 0.005)),
               key=lambda c: objective(SearchWork(step_us=c[0], step_us_per_cell=c[1], move_us_per_cell=c[2]),
                                       "step"))
    return SearchWork(float(setup[0]), round(float(setup[1]), 4), float(step[0]), float(step[1]),
                      round(float(step[2]), 4))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=4, help="loads per setting (each searched fresh and calibrating)")
    p.add_argument("--fit", action="store_true", help="also fit the constants to this machine")
    args = p.parse_args(argv)
    rows = measure(args.trials)
    print(f"measured / estimated by {SEARCH_WORK}")
    print("| ranks x experts | setup median / p90 | steps | step median / p90 |\n|---|---|---|---|")
    r = ratios(rows, SEARCH_WORK)
    for ranks, experts in SETTINGS:
        s, t = r.get(("setup", ranks, experts)), r.get(("step", ranks, experts))
        if s is None or t is None:
            continue
        print(f"| {ranks} x {experts} | {np.median(s):.2f} / {np.percentile(s, 90):.2f} | {t.size} | "
              f"{np.median(t):.2f} / {np.percentile(t, 90):.2f} |")
    if args.fit:
        print(f"fitted: {fit(rows)}")


if __name__ == "__main__":
    main()
