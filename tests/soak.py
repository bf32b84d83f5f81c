"""Soak run: many steps on 2 ranks under the rotating-hotspot workload (W6), re-sharding firing again and again.

Hecate and plain data-parallel DeepSpeed train side by side in the same processes on the same data and routing, so
the run spot-checks exactness as it goes; resident memory is sampled after warm-up and at the end.

    OMP_NUM_THREADS=1 python tests/soak.py --steps 1000 [--out soak.json]

``tests/test_soak.py`` runs a 100-step version in CI.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from typing import Dict, List, cast

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_training import Spec, TinyMoE, batch, ds_config  # noqa: E402

SOAK = Spec(steps=0, reseed_each_step=True, tokens=32, aux_coef=0.01,
            hecate={"enabled": True, "placement": "hecate", "reshard_interval": 10, "overlap_degree": 1})
PERIOD = 10  # steps before the hot spot moves to the next owner's experts


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _set_routing_bias(model: torch.nn.Module, step: int, world_size: int, num_experts: int) -> None:
    """Bias every gate with the log-probabilities of W6 at ``step`` (the same on every rank)."""
    from ds_hecate.sim.workloads import expert_distribution

    probs = expert_distribution("W6", step, world_size, num_experts, period=PERIOD)[0]
    bias = torch.tensor([math.log(p) for p in probs], dtype=torch.float32)
    bias -= bias.mean()
    for module in model.modules():
        if hasattr(module, "logit_bias"):
            cast(torch.Tensor, module.logit_bias).copy_(bias)


def soak(rank: int, world_size: int, steps: int, warmup: int, spot_every: int) -> dict:
    import deepspeed
    import ds_hecate  # noqa: F401

    deepspeed.init_distributed(dist_backend="gloo")
    spec = replace(SOAK, gate_bias=(0.0,) * SOAK.num_experts)  # installs the biasable gate
    engines = {}
    for name, hecate in (("hecate", spec.hecate), ("data_parallel", None)):
        torch.manual_seed(spec.seed)
        s = replace(spec, hecate=hecate)
        engines[name], *_ = deepspeed.initialize(model=TinyMoE(s), model_parameters=None, config=ds_config(s))
    losses: Dict[str, List[float]] = {name: [] for name in engines}
    rss: List[int] = []
    worst_rel = 0.0
    start = time.perf_counter()
    for step in range(steps):
        for name, engine in engines.items():
            _set_routing_bias(engine.module, step, world_size, spec.num_experts)
            torch.manual_seed(spec.seed + 7919 * step)
            x, y, used = batch(spec, step, 0, rank, torch.float32)
            loss = engine(x, y, used)
            engine.backward(loss)
            engine.step()
            losses[name].append(float(loss.detach()))
        if step == warmup - 1 or step == steps - 1:
            rss.append(_rss_bytes())
        if (step + 1) % spot_every == 0 or step == steps - 1:
            a, b = losses["hecate"][-1], losses["data_parallel"][-1]
            worst_rel = max(worst_rel, abs(a - b) / max(abs(b), 1e-12))
    elapsed = time.perf_counter() - start
    stats = engines["hecate"].hecate.stats()
    return {"steps": steps, "seconds": elapsed, "rss_after_warmup": rss[0], "rss_end": rss[-1],
            "reshards": stats["reshards"], "worst_spot_loss_rel_diff": worst_rel,
            "spot_checks": len(range(spot_every - 1, steps, spot_every)) + (steps % spot_every != 0),
            "imbalance_before": stats["layers"][0]["load_imbalance_before"],
            "imbalance_after": stats["layers"][0]["load_imbalance_after"],
            "first_loss": losses["hecate"][0], "last_loss": losses["hecate"][-1]}


def run(steps: int, warmup: int, spot_every: int, timeout: float) -> List[dict]:
    from dist_utils import run_ranks

    return run_ranks(2, soak, steps, warmup, spot_every, timeout=timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100, help="RSS baseline is taken after this many steps")
    parser.add_argument("--spot-every", type=int, default=50, help="compare the losses every N steps")
    parser.add_argument("--out", default=None, help="write the per-rank results as JSON")
    args = parser.parse_args()
    results = run(args.steps, args.warmup, args.spot_every, timeout=max(600.0, args.steps * 3.0))
    for rank, r in enumerate(results):
        growth = r["rss_end"] / r["rss_after_warmup"] - 1
        print(f"rank {rank}: {r['steps']} steps in {r['seconds']:.0f} s, RSS {r['rss_after_warmup'] / 2**20:.1f} MiB "
              f"after {args.warmup} steps -> {r['rss_end'] / 2**20:.1f} MiB at the end ({growth:+.2%}), "
              f"{r['reshards']} re-shards, worst loss rel. diff vs data parallel at {r['spot_checks']} spot checks "
              f"{r['worst_spot_loss_rel_diff']:.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
