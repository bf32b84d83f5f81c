"""The parts of the all-to-all floor, timed alone: what moving a shape's routed rows costs on this machine.

``benchmarks/plain_layers.py``'s ``PlainAllToAllMoE`` adds to the plain layer four token all-to-alls (each way,
forward and backward) and four row permutations (the receive side, each way, forward and backward). This times each
primitive once on the shape's routed rows (``tokens * top_k`` rows of ``hidden``, the dtype asked), in a one-process
gloo group (NCCL on CUDA), interleaved, median over ``--reps``:

- ``all_to_all_single`` into a kept buffer and into a new one (what a layer that allocates per call pays);
- ``copy_`` of the same bytes (what the collective costs beyond moving them);
- a row permutation as a gather (``index_select``, what ds_hecate and the floor use both ways) and as the scatters
  autograd would use for its backward (``index_add_``, ``index_copy_``).

    python -m benchmarks.floor_parts --shape launch-bound --dtype fp32 --dtype bf16 --reps 30
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.layer_versus import SHAPES, _dtype, _init_one_rank, _sync  # noqa: E402

PARTS = ("all_to_all kept buffer", "all_to_all new buffer", "copy_", "index_select", "index_add_", "index_copy_")


def part_seconds(shape_name: str, dtype_name: str, reps: int, device_name: str = "cpu",
                 warmup: int = 3) -> Dict[str, List[float]]:
    """Seconds per call of each of :data:`PARTS` on the shape's routed rows (module docstring)."""
    import torch
    import torch.distributed as dist
    device = torch.device(device_name)
    _init_one_rank(device)
    shape = SHAPES[shape_name]
    rows = shape.tokens * shape.top_k
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, shape.hidden, generator=gen).to(device, _dtype(dtype_name))
    perm = torch.randperm(rows, generator=gen).to(device)
    out = torch.empty_like(x)
    parts: Dict[str, Callable[[], object]] = {
        "all_to_all kept buffer": lambda: dist.all_to_all_single(out, x, [rows], [rows]),
        "all_to_all new buffer": lambda: dist.all_to_all_single(torch.empty_like(x), x, [rows], [rows]),
        "copy_": lambda: out.copy_(x),
        "index_select": lambda: torch.index_select(x, 0, perm),
        "index_add_": lambda: out.index_add_(0, perm, x),
        "index_copy_": lambda: out.index_copy_(0, perm, x),
    }
    parts["all_to_all kept buffer"]()   # a rank's rows to itself: the exchange moves exactly the bytes timed
    if not torch.equal(out, x):
        raise SystemExit("floor_parts: the one-rank all-to-all did not deliver the rows it was given")
    times: Dict[str, List[float]] = {name: [] for name in PARTS}
    for i in range(warmup + reps):
        for name in PARTS:
            _sync(device)
            start = time.perf_counter()
            parts[name]()
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable (default: launch-bound)")
    p.add_argument("--dtype", action="append", choices=["fp32", "bf16"], help="repeatable (default: fp32)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    for name in args.shape or ["launch-bound"]:
        shape = SHAPES[name]
        for dtype_name in args.dtype or ["fp32"]:
            times = part_seconds(name, dtype_name, args.reps, args.device)
            mib = shape.tokens * shape.top_k * shape.hidden * (4 if dtype_name == "fp32" else 2) / 2 ** 20
            print(f"{name} {dtype_name}: {shape.tokens * shape.top_k:,} routed rows, {mib:.1f} MiB; median ms over "
                  f"{args.reps}: " + ", ".join(f"{part} {1e3 * statistics.median(ts):.3f}"
                                              for part, ts in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
