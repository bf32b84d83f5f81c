"""MoE training step time of ds_hecate and the systems users would pick instead: same model, same data, same run.

One entry point. Either through the wrapper, which starts the ranks itself::

    python -m benchmarks.run --out docs/benchmark_results.json --markdown docs/benchmarks.md --plots docs

or launched directly (what the wrapper runs)::

    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 benchmarks/run.py --out docs/benchmark_results.json

Systems (all train the same MoE-dominated model from the same weights on the same tokens, with the same forced
routing; see docs/benchmarks.md):

- ``ds_hecate``: Hecate, placement ``hecate`` (load-aware scheduler, prefetched SparseAllGather);
- ``autoep``: DeepSpeed AutoEP expert parallelism (dropless, ragged all-to-all), where the installed
  transformers lets AutoEP run; otherwise reported as skipped with the reason;
- ``deepspeed-ep``: DeepSpeed's legacy ``deepspeed.moe.layer.MoE``, ``ep_size=world``, ``drop_tokens=False``;
- ``gather-all``: every expert materialized on every rank each step (ZeRO-3 style), on Hecate's runtime with
  placement ``all``: SparseAllGather of all experts, local compute, SparseReduceScatter of their gradients;
- ``fastermoe-shadow``: FasterMoE-style shadowing on Hecate's runtime (placement ``shadow``): after the gate the
  hottest experts are broadcast to every rank, as many as FasterMoE's greedy latency rule accepts;
- ``ideal``: perfectly balanced expert compute and no communication at all: each rank runs its share of the
  experts on exactly the mean number of token-expert pairs, locally, with a local optimizer.

Systems run side by side in the same processes, one step each in rotating order on the same inputs, so the
drift of a shared machine hits them alike. Routing follows the named workloads W0-W7
(:mod:`ds_hecate.sim.workloads`) or replays routing traces (``--trace``), forced on every system's own gate.

This file is the entry point only; the parts live beside it: ``launcher`` (arguments, starting the ranks),
``systems`` (model, weights, the registry of systems), ``routes`` (the forced routing), ``measure`` and ``probes``
(the timed steps, bytes, memory) and ``results`` (markdown and plots).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# the entry point's face: what callers of ``benchmarks.run`` read (schema, systems, report markers)
from benchmarks.launcher import launch, parse_args  # noqa: E402
from benchmarks.measure import SCHEMA, run  # noqa: E402,F401
from benchmarks.results import MARK_BEGIN, MARK_END, markdown_section, report  # noqa: E402,F401
from benchmarks.systems import ALL_SYSTEMS  # noqa: E402,F401


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report_only:
        if not args.out:
            raise SystemExit("--report-only needs --out (the JSON to report from)")
        with open(args.out, encoding="utf-8") as f:
            report(args, json.load(f))
        return 0
    if "RANK" not in os.environ and "LOCAL_RANK" not in os.environ:  # the wrapper: start the ranks
        return launch(argv, args.ranks)
    results = run(args)
    if results is not None:
        from benchmarks.force_balanced import annotate
        annotate(results)   # per system: its forced-uniform run's step and the fraction (JSON)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)
            print(f"[benchmark] wrote {args.out}")
        report(args, results)
        print(markdown_section(results))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
