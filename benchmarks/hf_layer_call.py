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
import functools
import json
import os
import statistics
import time
from pathlib import Path
from dataclasses import asdict
from typing import Callable, Dict, List, Optional, Union

from benchmarks.layer_call import SHAPES, LayerShape, _dtype, _free_port, _sync

#: per family, the config keys of the shape's sizes (hidden, the experts' FFN width, the number of experts)
FAMILIES: Dict[str, Callable[[LayerShape], dict]] = {
    "mixtral": lambda s: dict(hidden_size=s.hidden, intermediate_size=s.ffn, num_local_experts=s.experts),
    "gpt_oss": lambda s: dict(hidden_size=s.hidden, intermediate_size=s.ffn, num_local_experts=s.experts),
    "nemotron_h": lambda s: dict(hidden_size=s.hidden, moe_intermediate_size=s.ffn, n_routed_experts=s.experts),
    "glm4_moe": lambda s: dict(hidden_size=s.hidden, moe_intermediate_size=s.ffn, n_routed_experts=s.experts),
    "qwen3_moe": lambda s: dict(hidden_size=s.hidden, moe_intermediate_size=s.ffn, num_experts=s.experts),
}
#: ops that write a tensor anew (a per-call relayout of the experts' weights would be one of these on an input
#: holding every expert: ``[E, ...]`` of at least one projection's size; views such as a transpose copy nothing)
COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::cat", "aten::stack",
            "aten::index_select", "aten::gather", "aten::_unsafe_view")


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
    """(runtime, binding, model) of a 1-rank Hecate runtime that took the family's experts module over."""
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
    return runtime, runtime.bindings[0], model


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


def relayout_ops(runtime, binding, inputs, shape: LayerShape) -> List[str]:
    """Copy-like ops of one call's forward whose input is an ``[E, ...]`` tensor of at least one projection of every
    expert (``E * hidden * ffn`` elements): what a per-call relayout of the experts' weights would run before its
    GEMMs. (The backward writes the weight gradients into their accumulators, a copy of that size on the CPU's
    small-expert path, which is no relayout; so only the forward is profiled.)"""
    import torch
    from torch.profiler import ProfilerActivity, profile

    x, indices, weights, _ = inputs
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, torch.no_grad():
        binding.run(x, indices, weights, "hf")
    found = []
    for event in prof.events():
        for s in event.input_shapes or ():
            if (event.name in COPY_OPS and len(s) >= 3 and s[0] == shape.experts
                    and int(torch.Size(s).numel()) >= shape.experts * shape.hidden * shape.ffn):
                found.append(f"{event.name}{event.input_shapes}")
                break
    return found


def transformers_call(family: str, shape: LayerShape, device: str, dtype_name: str) -> Callable[..., None]:
    """The same experts in plain transformers (``grouped_mm``, the default experts implementation): forward +
    backward of the module on the same routing, the reference each family's arithmetic sets."""
    import torch
    module = experts_module(family, shape, device).to(_dtype(dtype_name))
    module.config._experts_implementation = "grouped_mm"

    def call(x, indices, weights, grad) -> None:
        leaf = x.detach().requires_grad_(True)
        module(leaf, indices.t(), weights.t()).backward(grad)
        for p in module.parameters():
            p.grad = None
    return call


def measure(families: List[str], shape_name: Union[str, LayerShape], device: str, dtype_name: str,
            repeat: int) -> dict:
    """Paired timings of every family's layer call, through Hecate and in plain transformers, in this process
    (``shape_name``: one of :data:`SHAPES`, or a shape of its own)."""
    os.environ["DS_HECATE_GROUPED_MM"] = "1"
    shape = SHAPES[shape_name] if isinstance(shape_name, str) else shape_name
    inputs = routing(shape, device, dtype_name)
    calls: Dict[str, Callable[[], None]] = {}
    relayouts = {}
    for family in families:
        runtime, binding, _ = build(family, shape, device, dtype_name)
        calls[f"{family}/hecate"] = functools.partial(fwd_bwd, runtime, binding, *inputs)
        calls[f"{family}/transformers"] = functools.partial(transformers_call(family, shape, device, dtype_name),
                                                            *inputs)
        calls[f"{family}/hecate"]()   # warm-up (and the grouped GEMM feature check)
        calls[f"{family}/transformers"]()
        relayouts[family] = relayout_ops(runtime, binding, inputs, shape)
    names = list(calls)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(repeat):
        for name in (names if r % 2 == 0 else names[::-1]):
            _sync(device)
            start = time.perf_counter()
            calls[name]()
            _sync(device)
            times[name].append(time.perf_counter() - start)

    def ratio(a: str, b: str) -> dict:
        per_round = sorted(x / y for x, y in zip(times[a], times[b]))
        q = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
        return {"median": statistics.median(per_round), "q1": q[0], "q3": q[-1]}

    base = families[0]
    return {"shape": shape_name if isinstance(shape_name, str) else asdict(shape), "device": device,
            "dtype": dtype_name, "repeat": repeat, "base": base,
            "median_s": {n: statistics.median(t) for n, t in times.items()},
            # the family's layer call through Hecate against Mixtral's, both through Hecate
            "hecate_to_base": {f: ratio(f"{f}/hecate", f"{base}/hecate") for f in families[1:]},
            # Hecate against plain transformers on the family's own arithmetic
            "hecate_to_transformers": {f: ratio(f"{f}/hecate", f"{f}/transformers") for f in families},
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

    def text(r) -> str:
        return f"{r['median']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}]" if r else "1 (base)"
    print(f"{args.shape} ({args.device}, {args.dtype}, {args.repeat} rounds, grouped GEMM): fwd+bwd medians; ratios "
          "are medians of per-round ratios [IQR]")
    print(f"  {'family':12s} {'hecate':>10s} {'transformers':>13s}  {'hecate / ' + base:24s} "
          f"{'hecate / transformers':24s} relayout ops")
    for family in families:
        relayout = result["relayout_ops"][family]
        print(f"  {family:12s} {result['median_s'][family + '/hecate'] * 1e3:8.2f}ms "
              f"{result['median_s'][family + '/transformers'] * 1e3:11.2f}ms  "
              f"{text(result['hecate_to_base'].get(family)):24s} {text(result['hecate_to_transformers'][family]):24s} "
              f"{len(relayout)}{' ' + '; '.join(relayout[:3]) if relayout else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
