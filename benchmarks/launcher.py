"""The benchmark's command line and the wrapper that starts its ranks: benchmarks/run.py under DeepSpeed's launcher."""
from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from benchmarks.systems import ALL_SYSTEMS, HECATE_PLACEMENTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SCRIPT = os.path.join(REPO, "benchmarks", "run.py")   # what every rank runs
DESCRIPTION = ("MoE training step time of ds_hecate and the systems users would pick instead: same model, same "
               "data, same run.")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p.add_argument("--ranks", type=int, default=2, help="ranks the wrapper launches (CPU processes)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per workload")
    p.add_argument("--warmup", type=int, default=6,
                   help="untimed steps per workload before timing (> hecate.load_window, so the load predictor "
                        "holds only the current workload)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=512, help="SwiGLU expert hidden size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="mean tokens per rank per step")
    p.add_argument("--top-k", type=int, default=2, choices=(1, 2))
    p.add_argument("--workloads", type=str, default="W0,W1,W2,W3,W4,W5,W6,W7",
                   help="comma-separated workload names (W0..W7); empty for traces only")
    p.add_argument("--trace", action="append", default=[], help="routing trace (JSONL) to replay; repeatable")
    p.add_argument("--systems", type=str, default=",".join(ALL_SYSTEMS),
                   help="comma-separated, from " + ", ".join(
                       list(ALL_SYSTEMS) + sorted(set(HECATE_PLACEMENTS) - set(ALL_SYSTEMS))))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-memory", action="store_true", help="skip the profiled memory step after timing")
    p.add_argument("--out", type=str, default=None, help="JSON results (rank 0)")
    p.add_argument("--markdown", type=str, default=None,
                   help="markdown file whose generated section (between the markers) is replaced by the table")
    p.add_argument("--plots", type=str, default=None, help="directory for the PNG plots")
    p.add_argument("--report-only", action="store_true",
                   help="no run: regenerate --markdown and --plots from the JSON given by --out")
    return p.parse_args(argv)


def launch(argv: Sequence[str], ranks: int) -> int:
    """Run benchmarks/run.py on ``ranks`` CPU processes through DeepSpeed's launcher (the documented launch), by
    ``ds_hecate.tools.launch``: on a free master port, and the job's CPU all-reduce buffers in /dev/shm removed when
    it ends, a killed rank or Ctrl-C included."""
    from ds_hecate.tools.launch import run

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return run(["--num_gpus", str(ranks), RUN_SCRIPT, *argv], env=env, cwd=REPO)
