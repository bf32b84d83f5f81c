"""How long does a rank plan a layer call on the host, from 8 to 1,024 ranks?

    python -m benchmarks.planner --markdown docs/benchmarks.md
    python -m benchmarks.planner --quick        # up to 64 ranks and experts, top-8, 20 calls per setting

One process times the runtime's own calls for one rank of a simulated world (ranks 8 to 1,024, experts 8 to 256,
top-k 2 and 8, 8,192 tokens per rank, 8 ranks per node), call sequences as in training (balanced, skewed (Zipf 1.2),
or ``burst``: the hot set moves every 10th call): the **critical path** from the all-gathered counts to this rank's
splits and segments (``plan_after_gate``, calibration within ``plan_budget_us`` when it fires), and the **search**
(``schedule_materialization`` under ``search_budget_us``, off the critical path) beside the work its budget counted
(what the simulator charges). Times are the planning thread's CPU time, so other load does not inflate them; the
first call of each sequence (cold caches) is left out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ds_hecate.config import HecateConfig
from ds_hecate.planning.search import (ScheduleReuse, SearchSettings, WorkMeter, calibration_settings, plan_after_gate,
                                       schedule_materialization)
from ds_hecate.planning.search.critical_path import AUTO_BUDGET_CAP_US, AUTO_BUDGET_FLOOR_US, AUTO_BUDGET_SHARE
from ds_hecate.planning.dispatch_plan import rank_tables
from ds_hecate.planning.plan import Placement
from ds_hecate.planning.predictor import LoadPredictor
from ds_hecate.planning.cost_model import StepCostModel
from ds_hecate.planning.sharding import even_sharding
from ds_hecate.runtime.stops import gate_problem

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

MODULE = "benchmarks.planner"
TOKENS_PER_RANK = 8192
RANKS_PER_NODE = 8
REPLICAS_PER_RANK = 4
#: an H100-class expert (7168 x 2048 SwiGLU, bf16): 50 GB/s per GPU across nodes, 450 GB/s NVLink inside one (the
#: scheduler prices each link apart, issue 26), copies relayed beyond 4 replicas (hecate.fanout's default)
COSTS = StepCostModel(compute_s_per_pair=0.66e-6, token_transfer_s=1.1e-6 / 9, expert_transfer_s=3.5e-3 / 9,
                      overlap_s=2e-3, token_transfer_inter_s=1.1e-6, expert_transfer_inter_s=3.5e-3, fanout=4,
                      relay_chunks=4)


def draw_counts(rng: np.random.Generator, ranks: int, experts: int, top_k: int, skew: Optional[np.ndarray]):
    """``[ranks, experts]`` token-expert pairs: multinomial draws of the expert distribution, per rank."""
    p = np.full(experts, 1.0 / experts) if skew is None else skew
    return rng.multinomial(TOKENS_PER_RANK * top_k, p, size=ranks).astype(np.int64)


def zipf(rng: np.random.Generator, experts: int, s: float = 1.2) -> np.ndarray:
    p = 1.0 / np.arange(1, experts + 1) ** s
    return rng.permutation(p / p.sum())


def _stats(samples: Sequence[float]) -> Dict[str, float]:
    a = np.asarray(samples) * 1e6
    return {"median_us": round(float(np.median(a)), 1), "p99_us": round(float(np.percentile(a, 99)), 1),
            "calls": len(a)}


class CallSequence:
    """One simulated world as the planner sees it, for one rank: owners, node size, the load window filled, the
    schedule, and each call's counts (skewed loads keep their hot experts with fresh multinomial noise; ``burst``
    moves them on every 10th call)."""

    def __init__(self, ranks: int, experts: int, top_k: int, load: str, seed: int = 0) -> None:
        self.cfg = HecateConfig()
        self.ranks, self.experts, self.top_k, self.load = ranks, experts, top_k, load
        self.rng = np.random.default_rng(seed)
        self.owners = tuple(even_sharding(experts, ranks))
        self.skew = zipf(self.rng, experts) if load != "balanced" else None
        self.rpn = min(RANKS_PER_NODE, ranks)
        self.rank = ranks // 2 + 1 if ranks > 1 else 0     # not rank 0: nothing special about it
        self.window = LoadPredictor(self.cfg.load_window, self.cfg.load_predictor)
        for _ in range(self.cfg.load_window):
            self.window.push(self.draw())
        self.schedule = ScheduleReuse(self.cfg.replan_tolerance)

    def draw(self, call: Optional[int] = None) -> np.ndarray:
        """The counts of ``call`` (None: a draw of the stationary distribution)."""
        burst = self.load == "burst" and call is not None and call % 10 == 9
        return draw_counts(self.rng, self.ranks, self.experts, self.top_k,
                           zipf(self.rng, self.experts) if burst else self.skew)


def one_setting(ranks: int, experts: int, top_k: int, load: str, calls: int, seed: int = 0) -> dict:
    """Time the critical path and the search for one (ranks, experts, top-k, load) setting."""
    seq = CallSequence(ranks, experts, top_k, load, seed)
    cfg, owners, rpn, rank, window, schedule = seq.cfg, seq.owners, seq.rpn, seq.rank, seq.window, seq.schedule
    search_s: List[float] = []
    critical_s: List[float] = []
    calibrated = searched = 0
    search = SearchSettings(COSTS, REPLICAS_PER_RANK, rpn, budget_us=cfg.search_budget_us)
    calibration = calibration_settings(COSTS, REPLICAS_PER_RANK, rpn, cfg.plan_budget_us)
    for call in range(calls):
        prediction = window.predict_array()
        assert prediction is not None
        t0 = time.thread_time()
        materialized = schedule.schedule(prediction, owners, search)
        placement = Placement(owners, materialized)
        rank_tables(placement, rpn, rank)     # the runtime builds these with the prefetch, off the critical path
        search_s.append(time.thread_time() - t0)
        counts = seq.draw(call)
        exchanged = torch.from_numpy(np.concatenate([counts, np.zeros((ranks, 2), np.int64)], axis=1))
        t0 = time.thread_time()
        host = exchanged.cpu().numpy()                            # what Communicator.exchange_counts returns
        call_counts = host[:, :experts]
        gate_problem(host[:, experts:], "bench", experts, str)   # the runtime's health check
        after = plan_after_gate(call_counts, placement, schedule, calibration, rank, cfg.calibration)
        critical_s.append(time.thread_time() - t0)
        calibrated += after.extras is not None
        searched += after.searched
        window.push(call_counts)

    # The search alone, on a fresh schedule each time (the reuse above hides it on stationary loads).
    fresh, charged = [], []
    for _ in range(min(5, calls)):
        prediction = window.predict_array()
        assert prediction is not None
        meter = WorkMeter()
        t0 = time.thread_time()
        schedule_materialization(prediction, owners, search, meter=meter)
        fresh.append(time.thread_time() - t0)
        charged.append(meter.us * 1e-6)
        window.push(seq.draw())
    return {"ranks": ranks, "experts": experts, "top_k": top_k, "load": load,
           # the first call of a sequence is left out: cold caches, a one-time cost (up to 10x a later call)
           "critical_path": _stats(critical_s[1:]),
           "calibrated_calls": calibrated, "calibration_searches": searched,
           "search": _stats(fresh), "search_charged": _stats(charged), "search_with_reuse": _stats(search_s[1:]),
           "plan_budget_us": cfg.plan_budget_us, "search_budget_us": cfg.search_budget_us}


def run(quick: bool, argv: Sequence[str]) -> dict:
    torch.set_num_threads(1)     # one core
    machine = common.describe_machine()
    world, layers, ks = ((8, 64), (8, 64), (8,)) if quick else ((8, 64, 256, 1024), (8, 64, 256), (2, 8))
    grid = [(r, e, k, load) for r in world for e in layers for k in ks for load in ("balanced", "skewed")]
    grid += [(r, e, 8, "burst") for r, e in ((8, 64), (64, 256), (256, 256), (1024, 256)) if r in world and e in layers]
    results = []
    for ranks, experts, top_k, load in grid:
        t = time.perf_counter()
        row = one_setting(ranks, experts, top_k, load, 20 if quick else 200)   # 200: one preemption is no p99
        results.append({**row, "wall_s": round(time.perf_counter() - t, 2)})
        print(json.dumps(results[-1]), flush=True)
    return common.run_record("ds_hecate-planner/1", MODULE, argv, machine, results=results)


def _budget_words(budget) -> str:
    return f"{budget:.0f}" if budget is not None else (
        f"automatic: {AUTO_BUDGET_SHARE:.0%} of the layer's estimated time, {AUTO_BUDGET_FLOOR_US:.0f} to "
        f"{AUTO_BUDGET_CAP_US:.0f} us")


def markdown(record: dict) -> str:
    """One row per (ranks, experts) at top-8: the critical path's median / p99 per load, the fresh search's median
    and the work its budget counted, and on the burst rows how many calls calibration searched on."""
    rows: Dict[tuple, Dict[str, dict]] = {}
    for r in record["results"]:
        if r["top_k"] == 8:
            rows.setdefault((r["ranks"], r["experts"]), {})[r["load"]] = r

    def path(r: Optional[dict]) -> str:
        return "" if r is None else "{median_us:.0f} / {p99_us:.0f}".format(**r["critical_path"])

    def search(r: dict) -> str:
        charged = r.get("search_charged")
        return f"{r['search']['median_us']:.0f}" + (f" ({charged['median_us']:.0f})" if charged else "")
    first = record["results"][0]
    lines = common.header_lines(record) + [
        f"One rank's host work per layer call in the planning thread's CPU time (us), one thread, top-8, 8,192 tokens "
        f"per rank, {RANKS_PER_NODE} ranks per node, budgets at their defaults (`plan_budget_us` "
        f"{_budget_words(first['plan_budget_us'])}, `search_budget_us` {first['search_budget_us']:.0f}); an "
        f"H100-class expert ({COSTS.compute_s_per_pair * 1e6:.2f} us per pair, "
        f"{COSTS.slowest_expert_transfer_s * 1e3:.1f} ms per expert across nodes). Search: the fresh search's median "
        "(in brackets what its work model counted).", ""]
    lines += common.table(["ranks x experts", "critical path balanced: median / p99", "skewed", "burst",
                           "burst calls calibration searched", "search balanced", "search skewed"], [
        [f"{k[0]} x {k[1]}", path(v.get("balanced")), path(v.get("skewed")), path(v.get("burst")),
         "" if "burst" not in v else f"{v['burst']['calibration_searches']} of {v['burst']['critical_path']['calls']}",
         search(v["balanced"]), search(v["skewed"])] for k, v in rows.items()])
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="up to 64 ranks and experts, top-8, 20 calls per "
                        "setting")
    parser.add_argument("--json", default=str(common.RUNS / "planner.json"), help="the run record (%(default)s)")
    parser.add_argument("--markdown", default=None, help="replace this file's generated block by the table")
    parser.add_argument("--report-only", metavar="RECORD", help="no run: the table of this run record")
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    record = json.loads(Path(args.report_only).read_text()) if args.report_only else run(args.quick, argv)
    return common.publish(MODULE, record, markdown(record), args.json, args.markdown, not args.report_only)


if __name__ == "__main__":
    sys.exit(main())
