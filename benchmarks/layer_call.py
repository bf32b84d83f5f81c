"""One MoE layer call, forward + backward, on one rank: time, op count, phase times, expert TFLOP/s (issue 24).

What it runs: a ``ds_hecate.MoE`` layer of SwiGLU experts taken over by a 1-rank Hecate runtime (every expert
owned and materialized: the expert compute is the whole layer's), called through ``LayerBinding.run`` on fixed
routing (random top-k of fixed logits, no dropping), then backward with a fixed output gradient and the flush of the
gradient reductions, as ``engine.backward`` ends. Measured, per mode (``grouped``: grouped GEMM where available;
``loop``: ``DS_HECATE_GROUPED_MM=0``, one expert at a time):

- ``fwd_bwd_s``: median wall time of a forward + backward (CUDA: synchronised before and after);
- ``ops``: dispatcher ops the torch profiler records in one forward + backward: ``top`` (dispatched by the code,
  about one GPU kernel each) and ``nested`` (all), as :mod:`benchmarks.call_profile` defines them;
- ``expert_compute_s`` / ``expert_tflops``: the expert compute alone (forward + backward of the grouped rows
  through :func:`ds_hecate.ops.grouped_experts.expert_outputs`), and ``6 * rows * expert_params`` over it;
- ``phases``: the layer call's phase times (``stats()["layers"][0]["time_s"]``: device time) per call, forward and
  backward; ``phase_sum_s`` against ``call_mean_s`` (the mean forward + backward): what no phase accounts for.

``--save FILE`` writes the outputs and gradients of one call (a fixed seed) and ``--compare A B`` reports their
largest relative difference: run the same shape on two checkouts to check a change is exact. The layer call's
API differs between releases (before issue 24 ``run`` returned one row per routed slot, combined by the caller):
both are handled, so a baseline checkout can be measured with this same file.

    python -m benchmarks.layer_call --shape swiglu-8 --shape swiglu-64 --json layer_call.json
    python -m benchmarks.layer_call --shape qwen3-30b-a3b --device cuda --dtype bf16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer as one rank sees it: ``experts`` SwiGLU experts ``hidden -> ffn -> hidden``, ``tokens`` tokens
    routed top-``top_k``."""

    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.ffn


SHAPES: Dict[str, LayerShape] = {
    # CPU-sized: the same 4,096 routed rows over 8 or 64 experts (acceptance 1 of issue 24)
    "swiglu-8": LayerShape(hidden=128, ffn=256, experts=8, top_k=2, tokens=2048),
    "swiglu-64": LayerShape(hidden=128, ffn=256, experts=64, top_k=2, tokens=2048),
    # where the CPU's grouped GEMM starts to pay (its crossover against the loop sets ops.grouped_experts' CPU rule)
    "swiglu-16": LayerShape(hidden=128, ffn=256, experts=16, top_k=2, tokens=2048),
    "swiglu-32": LayerShape(hidden=128, ffn=256, experts=32, top_k=2, tokens=2048),
    # the real 2-rank benchmark's layer (benchmarks/run.py: hidden 128, SwiGLU 512, 8 experts), all on one rank
    "bench-8": LayerShape(hidden=128, ffn=512, experts=8, top_k=2, tokens=2048),
    # issue 41's CPU shapes (benchmarks/layer_versus.py): fine-grained experts with few tokens each, many small
    # launches, and few large experts
    "weight-bound": LayerShape(hidden=256, ffn=256, experts=128, top_k=2, tokens=512),
    "launch-bound": LayerShape(hidden=64, ffn=64, experts=128, top_k=8, tokens=4096),
    "compute-bound": LayerShape(hidden=256, ffn=512, experts=16, top_k=2, tokens=2048),
    # Qwen3-30B-A3B: hidden 2048, moe_intermediate_size 768, 128 experts, top-8 (one rank holds them all)
    "qwen3-30b-a3b": LayerShape(hidden=2048, ffn=768, experts=128, top_k=8, tokens=4096),
    # DeepSeek-V3: hidden 7168, moe_intermediate_size 2048, top-8 of 256 experts; one of 8 EP ranks holds 32
    "deepseek-v3": LayerShape(hidden=7168, ffn=2048, experts=32, top_k=8, tokens=4096),
}

DTYPES = ("fp32", "bf16")


def _dtype(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def build(shape: LayerShape, device: str, dtype_name: str):
    """(runtime, layer, binding) of a 1-rank Hecate runtime over one ds_hecate.MoE layer on ``device``."""
    import torch
    import torch.distributed as dist

    import ds_hecate
    try:
        from ds_hecate.comm.backend import build_communicator
    except ImportError:   # a checkout before issue 42 moved it
        from ds_hecate.comm.gpu.backend import build_communicator
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.runtime.hecate import HecateRuntime

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    dev = torch.device(device)
    with dev:   # built where it runs: a DeepSeek-V3-like layer is 1.4e9 parameters
        expert = ds_hecate.SwiGLUExpert(shape.hidden, shape.ffn)
        layer = ds_hecate.MoE(shape.hidden, expert, num_experts=shape.experts, k=min(shape.top_k, 2))
    config = parse_hecate_section({"enabled": True, "prefetch": False, "reshard_interval": 0,
                                   "compute_s_per_pair": 1e-6, "link_gbps": 1.0, "non_moe_time_s": 0.0})
    runtime = HecateRuntime(config, build_communicator("torch", None, 0, 1, dev), _dtype(dtype_name), 1)
    convert_model(torch.nn.ModuleDict({"moe": layer}), runtime)
    layer.to(dev)
    return runtime, layer, runtime.bindings[0]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def routing(shape: LayerShape, device: str, dtype_name: str, seed: int = 1):
    """(x, indices [k, S], gates [k, S], output gradient): the same on every run of a shape."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen)
    logits = torch.randn(shape.tokens, shape.experts, generator=gen)
    gates, indices = torch.softmax(logits, dim=-1).topk(shape.top_k, dim=-1)
    grad = torch.randn(shape.tokens, shape.hidden, generator=gen)
    dt = _dtype(dtype_name)
    return (x.to(device, dt), indices.t().contiguous().to(device), gates.t().contiguous().to(device),
            grad.to(device, dt))


def layer_call(runtime, binding, x, indices, gates):
    """The layer's combined output, whatever this checkout's ``run`` returns (issue 24 fused the combine)."""
    out = binding.run(x, indices, gates)
    if out.shape[0] == indices.numel():   # one row per routed slot: the caller combined (before issue 24)
        from ds_hecate.moe_layer import combine_routes
        out = combine_routes(out, gates, out.dtype)
    return out


def fwd_bwd(runtime, binding, x, indices, gates, grad):
    leaf = x.detach().requires_grad_(True)
    out = layer_call(runtime, binding, leaf, indices, gates)
    out.backward(grad)
    runtime.flush_reductions()
    return out, leaf.grad


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def _reset_grads(runtime) -> None:
    runtime.store.zero_grads()


def count_ops(runtime, binding, inputs) -> Dict[str, int]:
    """Dispatcher ops of one forward + backward: ``top`` those the code dispatches (what a GPU launches, roughly one
    kernel each), ``nested`` all of them; defined in :mod:`benchmarks.call_profile`."""
    from benchmarks.call_profile import profile_call
    prof = profile_call(lambda: fwd_bwd(runtime, binding, *inputs))
    _reset_grads(runtime)
    return {"top": prof["top"], "nested": prof["nested"]}


def expert_compute_seconds(binding, shape: LayerShape, device: str, dtype_name: str, repeat: int) -> Optional[float]:
    """Median seconds of the expert compute alone (grouped rows, forward + backward); None on a checkout without
    :mod:`ds_hecate.ops.grouped_experts`."""
    import torch
    try:
        from ds_hecate.comm.collectives import CommCounters
        from ds_hecate.comm.device import to_device
        from ds_hecate.ops.grouped_experts import RowGroups, expert_outputs
    except ImportError:
        return None
    rt = binding.host
    placement = binding.planner.prefetch(binding.plan_inputs(), 0) if binding.planner.prefetches else None
    if placement is None:
        from ds_hecate.planning import Placement
        placement = Placement(binding.shard.owners, (tuple(range(shape.experts)),))
    gathered = rt.comm.start_sparse_all_gather(placement, binding.shard.masters, binding.shard.kernel.numel,
                                               rt.compute_dtype, CommCounters(), async_op=False).wait()
    if not hasattr(gathered, "buffer"):   # a checkout before issue 24: experts are not one buffer there
        return None
    # since issue 41 the own experts are apart from the replicas (``owned_rows``): the layer's experts as one block
    weights = (torch.cat([gathered.owned_rows, gathered.buffer]) if hasattr(gathered, "owned_rows")
               else gathered.buffer)
    sizes = [shape.rows // shape.experts + (e < shape.rows % shape.experts) for e in range(shape.experts)]
    groups = RowGroups.build(sizes, torch.device(device), to_device)
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(shape.rows, shape.hidden, generator=gen).to(device, _dtype(dtype_name))
    grad = torch.randn(shape.rows, shape.hidden, generator=gen).to(device, _dtype(dtype_name))
    times = []
    for i in range(repeat + 1):
        buffer = weights.detach().requires_grad_(True)
        leaf = rows.detach().requires_grad_(True)
        _sync(device)
        start = time.perf_counter()
        expert_outputs(binding.shard.kernel, buffer, leaf, groups).backward(grad)
        _sync(device)
        if i:   # the first is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(shape_name: str, device: str, dtype_name: str, repeat: int, mode: str) -> dict:
    """The figures of one shape in one mode (``grouped`` or ``loop``), in this process."""
    os.environ["DS_HECATE_GROUPED_MM"] = "0" if mode == "loop" else "1"
    shape = SHAPES[shape_name]
    runtime, _layer, binding = build(shape, device, dtype_name)
    inputs = routing(shape, device, dtype_name)
    fwd_bwd(runtime, binding, *inputs)   # warm-up (and the grouped GEMM feature check)
    _reset_grads(runtime)
    ops = count_ops(runtime, binding, inputs)
    before = _phase_totals(binding)
    times = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fwd_bwd(runtime, binding, *inputs)
        _sync(device)
        times.append(time.perf_counter() - start)
        _reset_grads(runtime)
    after = _phase_totals(binding)
    expert_s = expert_compute_seconds(binding, shape, device, dtype_name, max(3, repeat // 2))
    flops = 6.0 * shape.rows * shape.expert_params
    phases = {p: (after[p] - before[p]) / repeat for p in after}
    return {"shape": shape_name, **asdict(shape), "device": device, "dtype": dtype_name, "mode": mode,
            "fwd_bwd_s": statistics.median(times), "fwd_bwd_all_s": times, "ops": ops,
            # every part of the call is in a phase: their sum against the mean call (the phases are means)
            "phase_sum_s": sum(phases.values()), "call_mean_s": statistics.fmean(times),
            "expert_compute_s": expert_s, "expert_tflops": flops / expert_s / 1e12 if expert_s else None,
            "phases": phases}


def _phase_totals(binding) -> Dict[str, float]:
    seconds = getattr(binding, "phase_seconds", None)   # device time (issue 24); host time before
    return dict(seconds()) if seconds is not None else dict(binding.phase_s)


def save_outputs(shape_name: str, device: str, dtype_name: str, path: str) -> None:
    """Outputs and gradients (input rows, every expert) of one call, for :func:`compare`."""
    import torch
    shape = SHAPES[shape_name]
    runtime, _layer, binding = build(shape, device, dtype_name)
    out, grad_x = fwd_bwd(runtime, binding, *routing(shape, device, dtype_name))
    shard = binding.shard
    grads = torch.stack([shard.masters[e].grad for e in shard.owned])
    torch.save({"out": out.detach().float().cpu(), "grad_x": grad_x.float().cpu(), "expert_grads": grads.cpu()},
               path)


def compare(a: str, b: str) -> Dict[str, float]:
    """Largest absolute difference over the largest magnitude, per saved tensor."""
    import torch
    x, y = torch.load(a), torch.load(b)
    return {k: float((x[k] - y[k]).abs().max() / y[k].abs().max().clamp(min=1e-30)) for k in x}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable (default: swiglu-8, "
                        "swiglu-64)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--modes", default="grouped,loop", help="comma-separated: grouped, loop")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--save", help="write one call's outputs and gradients here (first shape) and stop")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --save files and stop")
    args = parser.parse_args(argv)
    if args.compare:
        print(json.dumps(compare(*args.compare), indent=1))
        return
    shapes = args.shape or ["swiglu-8", "swiglu-64"]
    if args.save:
        save_outputs(shapes[0], args.device, args.dtype, args.save)
        return
    rows = []
    for name in shapes:
        for mode in args.modes.split(","):
            # one process per measurement: the grouped GEMM switch and the allocator start fresh
            import subprocess
            code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.layer_call import "
                    f"measure; print('RESULT', json.dumps(measure({name!r}, {args.device!r}, {args.dtype!r}, "
                    f"{args.repeat}, {mode!r})))")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                sys.exit(f"layer_call: {name} ({mode}) failed:\n{proc.stderr[-3000:]}")
            row = json.loads(line[0][len("RESULT "):])
            rows.append(row)
            print(f"{name:14s} {mode:8s} fwd+bwd {row['fwd_bwd_s'] * 1e3:9.2f} ms  ops {row['ops']['top']:5d} "
                  f"({row['ops']['nested']:5d} nested)  "
                  f"expert compute {row['expert_compute_s'] * 1e3 if row['expert_compute_s'] else float('nan'):8.2f}"
                  f" ms  {row['expert_tflops'] or float('nan'):7.3f} TFLOP/s  phases "
                  f"{100 * row.get('phase_sum_s', float('nan')) / row.get('call_mean_s', float('nan')):5.1f}% of "
                  "the call", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
