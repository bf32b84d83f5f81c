"""DeepSpeed's top-k gate against ds_hecate's bit-exact computation of it and a plain router, forward + backward.

``ds_hecate.MoE`` keeps DeepSpeed's ``TopKGate`` (its routing, ``l_aux`` and counts, bit for bit) but computes it
with :func:`ds_hecate.ops.topk_gate.gate_routes`, without the capacity slots Hecate never reads. This times the
three on one routing (:func:`benchmarks.versus_systems.routed_inputs`, the side-by-side benchmark's), on the CPU,
one thread, interleaved, gradients of the tokens and of the router weight included:

- ``deepspeed``: ``TopKGate.forward`` with sparse routes (what ``ds_hecate.MoE`` ran before);
- ``ds_hecate``: ``gate_routes`` on the same gate (bit-equal outputs and gradients: tests/test_topk_gate.py);
- ``plain``: fp32 logits, softmax, top-k, the k weights renormalized (the plain layer's router in
  ``benchmarks.versus_systems``; no ``l_aux``, no counts).

    python -m benchmarks.gate_cost                       # the launch-bound shape: 4,096 tokens, 128 experts, top-8
    python -m benchmarks.gate_cost --shape compute-bound --reps 40
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    from deepspeed.moe.sharded_moe import TopKGate

    from benchmarks.layer_versus import SHAPES
    from benchmarks.versus_systems import routed_inputs
    from ds_hecate.ops.topk_gate import gate_routes

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="launch-bound", choices=sorted(SHAPES))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shape = SHAPES[args.shape]
    inputs = routed_inputs(shape.hidden, shape.experts, shape.top_k, shape.tokens, torch.float32,
                           torch.device("cpu"))
    gate = TopKGate(shape.hidden, shape.experts, shape.top_k, drop_tokens=False)
    gate.wg.weight.data.copy_(inputs.router)
    grads = torch.randn(shape.top_k, shape.tokens, generator=torch.Generator().manual_seed(2))

    def deepspeed(x):
        l_aux, _c, _n, _i, _loc, weights, _counts = gate(x, None, True, False)
        return weights, l_aux

    def ds_hecate(x):
        l_aux, _i, weights, _counts = gate_routes(gate, x)
        return weights, l_aux

    def plain(x):
        top, _expert = F.linear(x.float(), gate.wg.weight.float()).softmax(dim=-1).topk(shape.top_k, dim=-1)
        return (top / top.sum(dim=-1, keepdim=True)).t(), None

    systems = {"deepspeed": deepspeed, "ds_hecate": ds_hecate, "plain": plain}
    times = {name: [] for name in systems}

    def call(fn):
        gate.wg.weight.grad = None
        x = inputs.x.detach().clone().requires_grad_(True)
        weights, l_aux = fn(x)
        loss = (weights * grads).sum()
        (loss if l_aux is None else loss + l_aux).backward()

    for _ in range(args.warmup):
        for fn in systems.values():
            call(fn)
    for _ in range(args.reps):
        for name, fn in systems.items():
            start = time.perf_counter()
            call(fn)
            times[name].append(time.perf_counter() - start)
    print(f"{args.shape}: {shape.tokens} tokens, {shape.experts} experts, top-{shape.top_k}, fp32, one thread, "
          f"{args.reps} interleaved rounds; median forward + backward:")
    for name, ts in times.items():
        print(f"  {name:10s} {statistics.median(ts) * 1e3:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
