"""Step time of a MoE-dominated model under ds_hecate and under DeepSpeed's own expert parallelism, same run.

Launch (2 CPU ranks):

    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 benchmarks/moe_step_time.py [--steps 12] [--out results.json]

For each routing workload (balanced; hot experts: two experts owned by rank 0 get over half of all token-expert
pairs) it trains the same model on the same data with:

- ``ds_hecate``: Hecate with its load-aware scheduler (placement "hecate");
- ``ds_hecate-owner``: Hecate with placement "owner", i.e. expert parallelism without balancing on Hecate's ragged
  all-to-all (isolates what the scheduler buys);
- ``deepspeed-ep``: DeepSpeed's legacy ``deepspeed.moe.layer.MoE`` with ``ep_size=world`` and ``drop_tokens=False``
  (expert parallelism without balancing, as DeepSpeed ships it).

It reports the median step time (after warm-up), ratios against ds_hecate, and the per-rank compute imbalance.
All systems run side by side in the same processes, one step each in rotating order, so that the drift of a shared
machine affects them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE

import ds_hecate
from ds_hecate.workloads import bias_gate


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p.add_argument("--steps", type=int, default=20, help="timed steps per system and workload")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    p.add_argument("--hot-bias", type=float, default=2.2, help="gate logit bias of the two hot experts")
    p.add_argument("--out", type=str, default=None, help="rank 0 writes the results as JSON")
    return p.parse_args()


class Block(nn.Module):
    """A small dense layer (the non-MoE compute) followed by a top-2 MoE FFN."""

    def __init__(self, hidden: int, ffn: int, experts: int, ep_size: int, native: bool) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        expert = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        cls = ds_hecate.MoE if native else DeepSpeedMoE
        self.moe = cls(hidden, expert, num_experts=experts, ep_size=ep_size, k=2, drop_tokens=False,
                       use_rts=False, min_capacity=0)

    def forward(self, h):
        h = h + torch.tanh(self.dense(h))
        out, l_aux, _ = self.moe(h)
        return h + out, l_aux


class Model(nn.Module):
    def __init__(self, args, ep_size: int, native: bool, bias) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(args.hidden, args.ffn, args.experts, ep_size, native)
                                     for _ in range(args.layers)])
        for block in self.blocks:
            experts = block.moe.experts if native else block.moe.deepspeed_moe.experts.deepspeed_experts
            for p in experts.parameters():
                nn.init.normal_(p, std=0.05)
            bias_gate(block.moe, bias)

    def forward(self, x):
        aux = 0.0
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        return x.pow(2).mean() + 0.01 * aux


def config(hecate: dict | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 2}}
    if hecate is not None:
        cfg["zero_optimization"]["hecate"] = {"enabled": True, **hecate}
    return cfg


def build_system(args, name: str, bias, world: int):
    native = name.startswith("ds_hecate")
    torch.manual_seed(1234)
    model = Model(args, ep_size=1 if native else world, native=native, bias=bias)
    hecate = {"ds_hecate": {"placement": "hecate", "reshard_interval": 0},
              "ds_hecate-owner": {"placement": "owner"}}.get(name)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(hecate))
    return engine


def timed_step(engine, x) -> float:
    dist.barrier()
    start = time.perf_counter()
    loss = engine(x)
    engine.backward(loss)
    engine.step()
    dist.barrier()
    return time.perf_counter() - start


def run_workload(args, systems, bias, rank: int, world: int) -> dict:
    """All systems side by side: each timed step runs every system once, in rotating order, on the same input,
    so slow drifts of a shared machine hit all systems alike."""
    engines = {s: build_system(args, s, bias, world) for s in systems}
    times = {s: [] for s in systems}
    gen = torch.Generator().manual_seed(99 + rank)
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.tokens, args.hidden, generator=gen)
        order = systems[step % len(systems):] + systems[:step % len(systems)]
        for s in order:
            t = timed_step(engines[s], x)
            if step >= args.warmup:
                times[s].append(t)
    results = {}
    for s, engine in engines.items():
        result = {"median_step_s": statistics.median(times[s]), "step_s": times[s]}
        if s.startswith("ds_hecate"):
            stats = engine.hecate.stats()
            layers = stats["layers"]
            n = args.warmup + args.steps
            result.update({
                "imbalance_before": sum(layer["load_imbalance_before"] for layer in layers) / len(layers),
                "imbalance_after": sum(layer["load_imbalance_after"] for layer in layers) / len(layers),
                "replicas_per_layer": sum(layer["replicas"] for layer in layers) / len(layers),
                "hot_share": _hot_share(layers),
                "bytes_allgather_per_step": stats["comm"]["bytes_allgather"] / n,
                "bytes_dispatch_per_step": stats["comm"]["bytes_dispatch"] / n,
                "phase_s_per_step": {k: sum(layer["time_s"][k] for layer in layers) / n for k in layers[0]["time_s"]},
                "measured_costs": stats["measured_costs"],
            })
        results[s] = result
    return results


def _hot_share(layers) -> float:
    tokens = [layer["tokens_per_expert"] for layer in layers]
    return sum(t[0] + t[1] for t in tokens) / max(1, sum(sum(t) for t in tokens))


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    workloads = {"balanced": [0.0] * args.experts,
                 "hot-experts": [args.hot_bias, args.hot_bias] + [0.0] * (args.experts - 2)}
    systems = ["ds_hecate", "ds_hecate-owner", "deepspeed-ep"]
    results = {wname: run_workload(args, systems, bias, rank, world) for wname, bias in workloads.items()}
    if rank == 0:
        print(f"\nMoE step time, {world} CPU ranks, {args.layers} MoE layers x {args.experts} experts "
              f"(hidden {args.hidden}, ffn {args.ffn}), top-2, {args.tokens} tokens/rank, {args.steps} timed steps")
        print("| workload | system | median step (ms) | vs ds_hecate | compute max/mean before -> after |")
        print("|---|---|---|---|---|")
        for wname, per_system in results.items():
            ref = per_system["ds_hecate"]["median_step_s"]
            for s, r in per_system.items():
                imb = (f"{r['imbalance_before']:.2f} -> {r['imbalance_after']:.2f}" if "imbalance_after" in r
                       else "(no balancing)")
                print(f"| {wname} | {s} | {1000 * r['median_step_s']:.1f} | {r['median_step_s'] / ref:.2f}x | {imb} |")
            hot = per_system["ds_hecate"]["hot_share"]
            print(f"|  | share of pairs on experts 0,1: {hot:.2f} |  |  |  |")
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"args": vars(args), "world": world, "results": results}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
