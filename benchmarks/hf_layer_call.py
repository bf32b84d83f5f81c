"""One Hugging Face experts module's layer call on one rank, family against family, paired (issue 55).

The question: does a family Hecate newly takes over (its own layout: GPT-OSS's interleaved, transposed, biased
experts with a clamped SwiGLU ``_apply_gate``; Nemotron-H's experts without a gate; GLM-4.5's default layout behind
a DeepSeek-style router) run the fast path as fast as Mixtral's on the same shape? Each family's experts module
(built from its transformers config at the shape's sizes) is taken over by a 1-rank Hecate runtime, exactly as
``deepspeed.initialize`` does (:func:`ds_hecate.hf.convert_hf_model`), and its layer call (``binding.run`` with
Hugging Face's weighting, what the ``"hecate"`` experts implementation calls) runs forward + backward on fixed
routing, grouped GEMM forced (``DS_HECATE_GROUPED_MM=1``, the fused fast path). Families alternate call by call
(ABAB, the order flipped every round), so that a slow spell of the machine hits both; the figure is the median of
the per-round ratios ``family / mixtral`` with its interquartile range.

Layout conversions happen once, at take-over: before timing, one profiled call of each family checks that no op of
the call copies or transposes a tensor as large as one projection of all experts (a per-call relayout would);
``relayout_ops`` lists any that does.

    python -m benchmarks.hf_layer_call --shape compute-bound --families mixtral,gpt_oss,nemotron_h,glm4_moe
    python -m benchmarks.hf_layer_call --shape qwen3-30b-a3b --device cuda --dtype bf16 --repeat 50
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from benchmarks.layer_call import SHAPES, LayerShape, _dtype, _free_port, _sync

#: per family, the config keys of the shape's sizes (hidden, the experts' FFN width, the number of experts)
FAMILIES: Dict[str, Callable[[LayerShape], dict]] = {
    "mixtral": lambda s: dict(hidden_size=s.hidden, intermediate_size=s.ffn, num_local_experts=s.experts),
    "gpt_oss": lambda s: dict(hidden_size=s.hidden, intermediate_size=s.ffn, num_local_experts=s.experts),
    "nemotron_h": lambda s: dict(hidden_size=s.hidden, moe_intermediate_size=s.ffn, n_routed_experts=s.experts),
    "glm4_moe": lambda s: dict(hidden_size=s.hidden, moe_intermediate_size=s.ffn, n_routed_experts=s.experts),
    "qwen3_moe": lambda s: dict(hidden_size=s.hidden, moe_intermediate_size=s.ffn, num_experts=s.experts),
}
#: ops that copy or lay out a tensor anew (a per-call relayout would be one of these on expert-sized inputs)
COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::t", "aten::transpose", "aten::permute",
            "aten::cat", "aten::stack", "aten::index_select", "aten::_to_copy")


def experts_module(family: str, shape: LayerShape, device: str):
    """The family's experts module at the shape's sizes, weights drawn N(0, 0.02) (seeded)."""
    import torch
    from transformers import CONFIG_MAPPING

    from ds_hecate.hf.interface import interface_classes

    config = CONFIG_MAPPING[family](**FAMILIES[family](shape))
    cls = next(c.cls for c in interface_classes() if c.model_type == family)
    torch.manual_seed(0)
    module = cls(config).to(device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    return module


def build(family: str, shape: LayerShape, device: str, dtype_name: str):
    """(runtime, binding, relayout threshold) of a 1-rank Hecate runtime that took the family's module over."""
    import torch
    import torch.distributed as dist

    from ds_hecate.comm.backend import build_communicator
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.hf import convert_hf_model
    from ds_hecate.runtime.hecate import HecateRuntime

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    dev = torch.device(device)
    config = parse_hecate_section({"enabled": True, "prefetch": False, "reshard_interval": 0,
                                   "compute_s_per_pair": 1e-6, "link_gbps": 1.0, "non_moe_time_s": 0.0})
    runtime = HecateRuntime(config, build_communicator("torch", None, 0, 1, dev), _dtype(dtype_name), 1)
    model = torch.nn.ModuleDict({"experts": experts_module(family, shape, device)})
    convert_hf_model(model, runtime)
    return runtime, runtime.bindings[0], shape.experts * shape.hidden * shape.ffn


def routing(shape: LayerShape, device: str, dtype_name: str, seed: int = 1):
    """(x [T, H], indices [k, T], weights [k, T], output gradient): the same for every family."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen)
    logits = torch.randn(shape.tokens, shape.experts, generator=gen)
    weights, indices = torch.softmax(logits, dim=-1).topk(shape.top_k, dim=-1)
    grad = torch.randn(shape.tokens, shape.hidden, generator=gen)
    dt = _dtype(dtype_name)
    return (x.to(device, dt), indices.t().contiguous().to(device), weights.t().contiguous().to(device, dt),
            grad.to(device, dt))


def fwd_bwd(runtime, binding, x, indices, weights, grad) -> None:
    leaf = x.detach().requires_grad_(True)
    binding.run(leaf, indices, weights, "hf").backward(grad)
    runtime.flush_reductions()
    runtime.store.zero_grads()


def relayout_ops(runtime, binding, inputs, threshold: int) -> List[str]:
    """Copy-like ops of one call whose input holds at least ``threshold`` elements (one projection of every
    expert): what a per-call relayout of the experts' weights would run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fwd_bwd(runtime, binding, *inputs)
    found = []
    for event in prof.events():
        if event.name in COPY_OPS and event.input_shapes:
            sizes = [int(torch.Size(s).numel()) for s in event.input_shapes if s]
            if sizes and max(sizes) >= threshold:
                found.append(f"{event.name}{event.input_shapes}")
    return found


def measure(families: List[str], shape_name: str, device: str, dtype_name: str, repeat: int) -> dict:
    """Paired timings of every family's layer call, in this process."""
    os.environ["DS_HECATE_GROUPED_MM"] = "1"
    shape = SHAPES[shape_name]
    built = {f: build(f, shape, device, dtype_name) for f in families}
    inputs = routing(shape, device, dtype_name)
    relayouts = {}
    for family, (runtime, binding, threshold) in built.items():
        fwd_bwd(runtime, binding, *inputs)   # warm-up (and the grouped GEMM feature check)
        relayouts[family] = relayout_ops(runtime, binding, inputs, threshold)
    times: Dict[str, List[float]] = {f: [] for f in families}
    for r in range(repeat):
        for family in (families if r % 2 == 0 else families[::-1]):
            runtime, binding, _ = built[family]
            _sync(device)
            start = time.perf_counter()
            fwd_bwd(runtime, binding, *inputs)
            _sync(device)
            times[family].append(time.perf_counter() - start)
    base = families[0]
    ratios = {}
    for family in families[1:]:
        per_round = sorted(t / b for t, b in zip(times[family], times[base]))
        q = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
        ratios[family] = {"median": statistics.median(per_round), "q1": q[0], "q3": q[-1]}
    return {"shape": shape_name, "device": device, "dtype": dtype_name, "repeat": repeat, "base": base,
            "median_s": {f: statistics.median(t) for f, t in times.items()}, "ratio_to_base": ratios,
            "relayout_ops": relayouts}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="compute-bound", choices=sorted(SHAPES))
    parser.add_argument("--families", default="mixtral,gpt_oss,nemotron_h,glm4_moe",
                        help="comma-separated, the first is the base of the ratios (default: mixtral first)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    families = args.families.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; choose from {sorted(FAMILIES)}")
    result = measure(families, args.shape, args.device, args.dtype, args.repeat)
    base = result["base"]
    print(f"{args.shape} ({args.device}, {args.dtype}, {args.repeat} rounds, grouped GEMM): fwd+bwd median, "
          f"ratio to {base} (median of per-round ratios, IQR)")
    for family in families:
        ratio = result["ratio_to_base"].get(family)
        text = (f"{ratio['median']:.3f} [{ratio['q1']:.3f}, {ratio['q3']:.3f}]" if ratio else "1 (base)")
        relayout = result["relayout_ops"][family]
        print(f"  {family:12s} {result['median_s'][family] * 1e3:9.2f} ms  {text}  per-call relayout ops: "
              f"{len(relayout)}{' ' + '; '.join(relayout[:3]) if relayout else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
