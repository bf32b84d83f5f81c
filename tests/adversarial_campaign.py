"""Adversarial campaign: many seeded tiny trainings, each run with Hecate and with the data-parallel oracle.

Every seed is drawn by ``adversarial_draws.draw(seed, world)`` (placement crossed independently with empty ranks,
starved / saturated / shifting experts, top-1/top-2, token dropping, noisy gates, residual MoE, gradient
accumulation, fp32/bf16/fp16, ...). The oracle is DeepSpeed itself (``deepspeed.moe.layer.MoE``, no ``hecate``
key, ep_size 1), trained in its own processes; the Hecate runs train in another set of processes. Full optimizer
steps, re-sharding firing in the draws that ask for it; weights are compared after every step.

    python tests/adversarial_campaign.py                     # the small CI set (12 seeds on 2 ranks, 4 on 4)
    python tests/adversarial_campaign.py --full              # 200 seeds on 2 ranks + 100 on 4 ranks
    python tests/adversarial_campaign.py --world 2 --seeds 1 --start 137   # one seed (the reproduction line)

Prints OK / FAIL / HANG per seed (a failing seed with its one-line reproduction command; an OK seed with its
training seconds and its worst discrepancy as a share of the tolerance), then totals: seeds, mismatches, hangs,
seconds per seed. Exits non-zero on any failure or hang.

Processes: each set of ranks (``dist_utils.run_ranks``, whose watchdog bounds the whole set) trains up to ``--chunk``
seeds, writing each result to disk as it completes and the seed it is on to a progress file. A stall watchdog kills
the ranks when no seed has started or finished for ``--stall-timeout`` seconds (a hang); run_ranks then reports the
dead ranks, the seed they were on is marked HANG, and the seeds after it run in fresh processes (results already in
hand are kept). A crash (an exception on any rank) is a FAIL of the seed it happened in, the same way.

Tolerances: ``adversarial_draws.tolerances`` (fp32 as test_exactness.py; bf16/fp16 with a bound on each expert's mean
difference, because Adam turns the rounding of a near-zero gradient into a full +-lr step of a single weight).

Shown to fail (faults injected into a copy of the tree, default set, 12 + 4 seeds): dropping rank 1's
SparseReduceScatter contribution (comm/collectives.py) -> 8 FAIL; sending the routes of the last expert that leave a
rank to the next rank (planning/dispatch_plan.py) -> 7 FAIL (gloo all-to-all size mismatch); a rank without tokens
skipping the token all-to-all (runtime/layer.py) -> 3 HANG (stall watchdog) + 2 FAIL. Each printed its reproduction.
"""
from __future__ import annotations

import argparse
import glob
import os
import pickle
import sys
import tempfile
import threading
import time
import multiprocessing
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if __name__ == "__main__":
    # Run as a script: this checkout's ds_hecate, not whatever an editable install points at (the ranks inherit
    # sys.path). Under pytest the test session's sys.path is left as it is.
    for path in (HERE, ROOT):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
elif HERE not in sys.path:
    sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

#: The small default set (CI): per world size, this many seeds chosen by ``covering_seeds`` (greedy cover of every
#: value of every dimension the draw has).
DEFAULT_COUNTS = {2: 12, 4: 4}
#: --full: seeds 0..199 on 2 ranks and 0..99 on 4 ranks.
FULL_COUNTS = {2: 200, 4: 100}
CHUNK = 50                 # seeds per set of processes (bounds the process groups and engines one process builds)
STARTUP_S = 120.0          # run_ranks' watchdog per process set: start-up (import deepspeed) on a loaded machine ...
PER_SEED_S = 30.0          # ... plus this per seed (a seed trains in ~1-3 s)
STALL_S = 90.0             # stall watchdog: no seed finished or started on any rank for this long = a hang
_DS_SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


def campaign_worker(rank: int, world: int, specs: Sequence, out_dir: str, tag: str) -> int:
    """Train ``specs`` one after another on this rank; write each result to ``out_dir`` as it completes and the index
    being trained to a progress file, so a hang or a crash still leaves the earlier seeds' results behind."""
    # DeepSpeed and Hecate log a lot per engine: keep it in a file, not between the per-seed lines.
    log = os.open(os.path.join(out_dir, f"{tag}.rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    from adversarial_draws import strip
    from moe_training import train

    for i, spec in enumerate(specs):
        with open(os.path.join(out_dir, f"{tag}.rank{rank}.at"), "w") as f:
            f.write(str(i))
        t0 = time.perf_counter()
        result = strip(train(rank, world, spec))
        result["seconds"] = time.perf_counter() - t0
        module = sys.modules.get("ds_hecate")
        result["ds_hecate"] = module.__file__ if module is not None else None
        path = os.path.join(out_dir, f"{tag}.{i}.rank{rank}.pkl")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(path + ".tmp", path)
    return len(specs)


def _remove_new_shm(before: set, started: float) -> None:
    """DeepSpeed's CPU shm all-reduce leaves a 66 MB file per rank and port in /dev/shm (see conftest.py)."""
    for path in set(glob.glob(_DS_SHM_BUFFERS)) - before:
        try:
            if os.stat(path).st_mtime >= started - 1.0:
                os.remove(path)
        except OSError:
            pass


class StallWatchdog(threading.Thread):
    """Kills this process's child processes (the ranks run_ranks started) when no rank has started or finished a
    seed for ``stall_s`` seconds (``STARTUP_S`` before the first): a hang is then reported within about a minute
    instead of at the end of run_ranks' whole-set timeout, and run_ranks reports the killed ranks."""

    def __init__(self, out_dir: str, tag: str, stall_s: float) -> None:
        super().__init__(daemon=True)
        self.out_dir, self.tag, self.stall_s = out_dir, tag, stall_s
        self.done = threading.Event()
        self.fired: Optional[str] = None

    def _progress(self) -> tuple:
        names = [n for n in os.listdir(self.out_dir) if n.startswith(self.tag + ".") and not n.endswith(".log")]
        out = []
        for n in sorted(names):
            try:
                with open(os.path.join(self.out_dir, n), "rb") as f:
                    out.append((n, f.read() if n.endswith(".at") else b""))
            except OSError:
                pass
        return tuple(out)

    def run(self) -> None:
        last, since, limit = self._progress(), time.monotonic(), STARTUP_S
        while not self.done.wait(1.0):
            now = self._progress()
            if now != last:
                last, since, limit = now, time.monotonic(), self.stall_s
            elif time.monotonic() - since > limit:
                at = {n.split(".")[1]: b.decode() for n, b in now if n.endswith(".at")}
                self.fired = (f"stall watchdog: no progress for {limit:.0f} s (hang?); spec index per rank: "
                              f"{at}; killed the ranks")
                for child in multiprocessing.active_children():
                    child.kill()
                return


def run_set(world: int, specs: List, tag: str, out_dir: str, per_seed_s: float,
            stall_s: float = STALL_S) -> Tuple[Dict[int, list], Optional[str], Optional[int]]:
    """Run ``specs`` on one set of ``world`` processes. Returns (index -> per-rank results of every spec that
    completed on all ranks, error text or None, index of the spec that failed or hung or None)."""
    from dist_utils import run_ranks

    before, started = set(glob.glob(_DS_SHM_BUFFERS)), time.time()
    error = None
    watchdog = StallWatchdog(out_dir, tag, stall_s)
    watchdog.start()
    try:
        run_ranks(world, campaign_worker, specs, out_dir, tag, timeout=STARTUP_S + per_seed_s * len(specs))
    except AssertionError as exc:
        error = str(exc)
    finally:
        watchdog.done.set()
        watchdog.join()
        _remove_new_shm(before, started)
    if watchdog.fired:
        error = f"watchdog: {watchdog.fired}\n{error or ''}"
    done: Dict[int, list] = {}
    for i in range(len(specs)):
        paths = [os.path.join(out_dir, f"{tag}.{i}.rank{r}.pkl") for r in range(world)]
        if all(os.path.exists(p) for p in paths):
            done[i] = []
            for p in paths:
                with open(p, "rb") as f:
                    done[i].append(pickle.load(f))
                os.remove(p)
    bad = None
    if error is not None:
        bad = min((i for i in range(len(specs)) if i not in done), default=None)
    return done, error, bad


def _short(text: str, lines: int = 12) -> str:
    body = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join("      " + line for line in body[-lines:])


def default_seeds(world: int) -> List[int]:
    from adversarial_draws import covering_seeds
    return covering_seeds(world, DEFAULT_COUNTS[world])


def campaign(world: int, seeds: Sequence[int], chunk: int = CHUNK, per_seed_s: float = PER_SEED_S,
             stall_s: float = STALL_S, verbose: bool = True, out=print) -> dict:
    """Run ``seeds`` on ``world`` ranks; return the totals and per-seed outcomes."""
    from adversarial_draws import compare, coverage, discrepancies, draw, margin

    seeds = list(seeds)
    drawn = {s: draw(s, world) for s in seeds}
    outcome: Dict[int, str] = {}
    covered = {"moved": 0, "reshards": 0, "dispatch": 0, "searches": 0}
    margins: Dict[int, float] = {}   # seed -> largest discrepancy / its tolerance
    sources: set = set()             # where the ranks imported ds_hecate from
    train_s: Dict[int, float] = {}   # seed -> seconds training (oracle + Hecate, slowest rank), start-up excluded
    t0 = time.perf_counter()
    results: Dict[str, Dict[int, list]] = {"oracle": {}, "hecate": {}}   # seed -> per-rank results
    with tempfile.TemporaryDirectory(prefix="ds_hecate_campaign_") as out_dir:
        pending = list(seeds)
        run_no = 0
        while pending:
            batch = pending[:chunk]
            run_no += 1
            # The oracle (plain DeepSpeed) in its own processes, then Hecate in another set. After a failure or a
            # hang the seeds behind it run in fresh processes; results already in hand are not recomputed.
            errors: Dict[int, Tuple[str, str]] = {}   # seed -> (outcome, detail)
            for which, index in (("oracle", 0), ("hecate", 1)):
                todo = [s for s in batch if s not in results[which] and s not in errors]
                if not todo:
                    continue
                done, err, bad = run_set(world, [drawn[s][index] for s in todo], f"{which}{run_no}", out_dir,
                                         per_seed_s, stall_s)
                for i, res in done.items():
                    results[which][todo[i]] = res
                if bad is not None and todo[bad] not in errors:
                    kind = ("ORACLE-FAIL" if which == "oracle"      # DeepSpeed itself refused: to exclude
                            else "HANG" if "watchdog" in (err or "") else "FAIL")
                    errors[todo[bad]] = (kind, err or "")
            for seed in batch:
                timing, detail = "", ""
                if seed in errors:
                    outcome[seed], detail = errors[seed]
                elif seed in results["oracle"] and seed in results["hecate"]:
                    o_res, h_res = results["oracle"][seed], results["hecate"][seed]
                    o_s = max(r.get("seconds", 0.0) for r in o_res)
                    h_s = max(r.get("seconds", 0.0) for r in h_res)
                    train_s[seed] = o_s + h_s
                    sources.update(r.get("ds_hecate") for r in h_res)
                    for key, v in coverage(h_res).items():
                        covered[key] += v
                    diffs = discrepancies(o_res, h_res)
                    margins[seed] = margin(diffs, drawn[seed][1])
                    timing = (f" [{o_s:.1f}+{h_s:.1f} s; worst {margins[seed]:.0%} of tolerance: loss "
                              f"{diffs['loss']:.1e} norm {diffs['norm']:.1e} dense {diffs['dense']:.1e} experts "
                              f"{diffs['experts']:.1e} (mean {diffs['experts_mean']:.1e})]")
                    try:
                        compare(o_res, h_res, drawn[seed][1], label=f"[seed {seed}, {world} ranks]")
                        outcome[seed] = "OK"
                    except AssertionError as exc:
                        outcome[seed], detail = "FAIL", str(exc)
                    del results["oracle"][seed], results["hecate"][seed]
                else:
                    continue  # not reached in this set (an earlier seed failed): runs in the next set
                if verbose or outcome[seed] != "OK":
                    out(f"{outcome[seed]:4s} seed {seed:4d} ({world} ranks){timing}: {drawn[seed][2]}")
                if outcome[seed] != "OK":
                    out(_short(detail))
                    out(f"      reproduce: python tests/adversarial_campaign.py --world {world} --seeds 1 "
                        f"--start {seed}")
            pending = [s for s in pending if s not in outcome]
    elapsed = time.perf_counter() - t0
    values = list(outcome.values())
    return {"world": world, "seeds": len(seeds), "ok": values.count("OK"), "mismatches": values.count("FAIL"),
            "hangs": values.count("HANG"), "oracle_failures": values.count("ORACLE-FAIL"), "seconds": elapsed,
            "seconds_per_seed": elapsed / max(len(seeds), 1),
            "train_seconds_per_seed": sum(train_s.values()) / max(len(train_s), 1), "coverage": covered,
            "outcome": outcome, "margins": margins, "ds_hecate": sorted(str(p) for p in sources)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="seeds 0..199 on 2 ranks + 0..99 on 4 ranks")
    parser.add_argument("--seeds", type=int, default=None,
                        help="run this many consecutive seeds from --start (default: the covering CI set)")
    parser.add_argument("--world", type=int, choices=(2, 4, 8), default=None, help="only this world size")
    parser.add_argument("--start", type=int, default=0, help="first seed (with --seeds)")
    parser.add_argument("--list", default=None, help="comma-separated seeds to run (instead of --seeds/--full)")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="seeds per set of processes")
    parser.add_argument("--per-seed-timeout", type=float, default=PER_SEED_S,
                        help="watchdog seconds per seed of a set (plus a fixed start-up allowance)")
    parser.add_argument("--stall-timeout", type=float, default=STALL_S,
                        help="seconds without any seed starting or finishing before the ranks are killed (hang)")
    parser.add_argument("--quiet", action="store_true", help="print only failing seeds and the totals")
    args = parser.parse_args(argv)
    worlds = (args.world,) if args.world else (2, 4)
    if args.list:
        sets = [(w, [int(x) for x in args.list.split(",") if x.strip()]) for w in worlds]
    elif args.full:
        sets = [(w, list(range(FULL_COUNTS[w]))) for w in worlds]
    elif args.seeds is not None:
        sets = [(w, list(range(args.start, args.start + args.seeds))) for w in worlds]
    else:
        sets = [(w, default_seeds(w)) for w in worlds]
    totals = []
    for world, seeds in sets:
        if not args.quiet and len(seeds) > 1:
            from adversarial_draws import crosstab
            print(f"== {world} ranks, {len(seeds)} seeds: what each placement is crossed with", flush=True)
            print(crosstab(seeds, world), flush=True)
        result = campaign(world, seeds, chunk=args.chunk, per_seed_s=args.per_seed_timeout,
                          stall_s=args.stall_timeout,
                          verbose=not args.quiet, out=lambda line: print(line, flush=True))
        totals.append(result)
        print(f"== {world} ranks: {result['seeds']} seeds, {result['ok']} ok, {result['mismatches']} mismatches, "
              f"{result['hangs']} hangs, {result['oracle_failures']} oracle failures; {result['seconds']:.0f} s, "
              f"{result['seconds_per_seed']:.2f} s per seed (training alone {result['train_seconds_per_seed']:.2f} s: "
              f"oracle + Hecate, slowest rank); coverage (seeds): experts moved "
              f"{result['coverage']['moved']}, re-sharded {result['coverage']['reshards']}, tokens dispatched "
              f"{result['coverage']['dispatch']}, scheduler searched {result['coverage']['searches']}; ds_hecate "
              f"imported from {', '.join(result['ds_hecate']) or '?'}", flush=True)
    seeds = sum(t["seeds"] for t in totals)
    bad = sum(t["mismatches"] + t["hangs"] + t["oracle_failures"] for t in totals)
    seconds = sum(t["seconds"] for t in totals)
    print(f"== total: {seeds} seeds, {sum(t['mismatches'] for t in totals)} mismatches, "
          f"{sum(t['hangs'] for t in totals)} hangs, {sum(t['oracle_failures'] for t in totals)} oracle failures; "
          f"{seconds:.0f} s, {seconds / max(seeds, 1):.2f} s per seed", flush=True)
    return 1 if bad or seeds == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
