"""What DeepSpeed's bf16 engine adds to every backward for a layer's expert weights, outside the layer call.

``benchmarks/layer_versus.py`` times each system's layer call and leaves DeepSpeed's engine out for every system.
In bf16 that is not neutral for the expert weights' gradients: ds_hecate accumulates them in fp32 inside its call
(each product rounded to bf16, then written into the owner's fp32 accumulator), while a layer trained under
DeepSpeed's bf16 optimizer leaves bf16 gradients that the engine's backward epilogue then accumulates in fp32,
``hp_grad.add_(lp.grad.to(fp32))`` per parameter (``BF16_Optimizer._update_hp_grad``, called from
``engine.backward`` through ``backward_epilogue`` every micro-step). This times that epilogue for a shape's expert
weights (SwiGLU: ``w1``, ``w3`` ``[E, F, H]`` and ``w2`` ``[E, H, F]``, as AutoEP holds them), with persistent fp32
buffers and fresh bf16 gradients, median over ``--reps`` calls:

    python -m benchmarks.grad_epilogue --shape weight-bound --reps 30

so that a reader can put the layer benchmark's bf16 rows on the same footing (the plain layer's call plus this,
against ds_hecate's call). It is not added to any row there: the benchmark's floor stays the plain layer's call.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.layer_versus import SHAPES  # noqa: E402


def epilogue_seconds(shape_name: str, reps: int, warmup: int = 3) -> List[float]:
    """Per call: DeepSpeed's fp32 accumulation of the shape's bf16 expert-weight gradients (module docstring)."""
    import torch
    shape = SHAPES[shape_name]
    sizes = [(shape.experts, shape.ffn, shape.hidden)] * 2 + [(shape.experts, shape.hidden, shape.ffn)]
    hp = [torch.zeros(s, dtype=torch.float32) for s in sizes]
    times = []
    for i in range(warmup + reps):
        grads = [torch.randn(s, dtype=torch.bfloat16) for s in sizes]   # fresh each call, as autograd's are
        start = time.perf_counter()
        with torch.no_grad():
            for h, g in zip(hp, grads):
                h.add_(g.to(h.dtype))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable (default: weight-bound)")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    for name in args.shape or ["weight-bound"]:
        shape = SHAPES[name]
        numel = shape.experts * 3 * shape.ffn * shape.hidden
        times = epilogue_seconds(name, args.reps)
        print(f"{name}: {numel:,} expert weights, bf16 gradients into fp32: median "
              f"{1e3 * statistics.median(times):.2f} ms over {args.reps} calls "
              f"(min {1e3 * min(times):.2f}, max {1e3 * max(times):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
