"""One planner for runtime and simulator (issue 16): the same recorded counts give the same placements and plans.

Real gloo ranks run Hecate's layer call (``LayerBinding.run``: count exchange, prefetched SparseAllGather,
calibration, dispatch) on routings forced to a recorded count sequence; the simulator's Hecate system is fed the
same sequence. Per call, the prefetched placement, the executed placement (calibration included) and every rank's
sends and receives must be identical, on 2 ranks and on 4, including more ranks than experts (where the planner
starts from the expert-data-parallel layout). The sequences shift the hot experts so that predictions miss and
calibration fires, and leave a rank without tokens.
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest
import torch
from torch import nn

from dist_utils import run_ranks

HIDDEN, FFN = 8, 16
COST_KEYS = {"enabled": True, "reshard_interval": 0, "compute_s_per_pair": 1e-6, "link_gbps": 1.0,
             "non_moe_time_s": 0.0}


def recorded_counts(world: int, experts: int, steps: int = 12, seed: int = 0) -> list:
    """[steps] of [world, experts] int counts: a hot expert that moves twice, noise, and an empty rank once."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        hot = (0 if step < 5 else experts - 1 if step < 9 else experts // 2)
        weights = np.ones(experts)
        weights[hot] = 6.0
        counts = np.stack([rng.multinomial(40 + 8 * r, weights / weights.sum()) for r in range(world)])
        if step == 10:
            counts[world - 1] = 0   # a rank without tokens still plans (and exchanges) like the others
        out.append(counts.astype(np.int64))
    return out


def _runtime_plans(rank: int, world: int, experts: int, sequence: list):
    import torch.distributed as dist

    import ds_hecate
    from ds_hecate.comm.backend import build_communicator
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.runtime.hecate import HecateRuntime

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Module()
    expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN))
    model.moe = ds_hecate.MoE(HIDDEN, expert, num_experts=experts, k=1, drop_tokens=False)
    runtime = HecateRuntime(parse_hecate_section(COST_KEYS), build_communicator("torch", dist.group.WORLD, rank,
                                                                                 world, torch.device("cpu")),
                            torch.float32, world)
    convert_model(model, runtime)
    binding = runtime.bindings[0]
    out: Dict[str, Any] = {"calls": [], "inputs": None}
    with torch.no_grad():
        for counts in sequence:
            local = torch.repeat_interleave(torch.arange(experts), torch.as_tensor(counts[rank]))
            x = torch.randn(local.numel(), HIDDEN)
            runtime.on_model_forward()   # prefetches this layer's predicted placement once the call order is known
            prefetched = None if binding.gathers.pending is None else binding.gathers.pending.placement.materialized
            binding.run(x, local.reshape(1, -1), torch.ones(1, local.numel()))
            plan = binding.tally.last_plan
            assert plan is not None
            mine = plan.for_rank(rank)
            out["calls"].append({"prefetched": prefetched, "executed": plan.placement.materialized,
                                 "send": list(mine.send_splits), "recv": list(mine.recv_splits)})
    inputs = binding.plan_inputs()
    out["inputs"] = (tuple(inputs.owners), inputs.costs, inputs.replica_budget)
    out["calibrations"] = binding.planner.schedule.searches
    return out


def _simulated_plans(world: int, experts: int, sequence: list):
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.sim.context import SimContext
    from ds_hecate.sim.core import ADAM
    from ds_hecate.sim.systems import HecateSystem
    from ds_hecate.sim.presets import Cluster, ModelShape

    cluster = Cluster(name="test", nodes=1, devices_per_node=world, intra_node_gbps=1.0, inter_node_gbps=1.0,
                      device_tflops=1.0, device_memory_gb=1.0, overlaps_compute=False)
    model = ModelShape(name="test", moe_layers=1, hidden_size=HIDDEN, ffn_size=FFN, num_experts=experts, top_k=1,
                       vocab_size=8, seq_len=8, expert_bias=True)
    ctx = SimContext(cluster=cluster, model=model, world=world, rpn=world, tokens=64, compute_b=4, grad_b=4, edp_grad_b=4,
                     s_per_pair=1e-6, t_fwd=0.0, hecate=parse_hecate_section(COST_KEYS), optimizer=ADAM,
                     zero_stage=0, precision="fp32")
    system = HecateSystem(ctx)   # one layer: resident, the whole budget
    calls = []
    for step, counts in enumerate(sequence):
        system.step(step, counts.astype(np.float64))
        plan = system.last_plan
        assert system.last_prefetched is not None
        calls.append({"prefetched": system.last_prefetched.materialized, "executed": plan.placement.materialized,
                      "send": [list(plan.for_rank(r).send_splits) for r in range(world)],
                      "recv": [list(plan.for_rank(r).recv_splits) for r in range(world)]})
    inputs = system.inputs
    return calls, (tuple(inputs.owners), inputs.costs, inputs.replica_budget)


@pytest.mark.parametrize("world,experts", [(2, 4), (4, 8), (4, 2)], ids=["2x4", "4x8", "4-ranks-2-experts"])
def test_runtime_and_simulator_plan_identically(world, experts):
    sequence = recorded_counts(world, experts)
    ranks = run_ranks(world, _runtime_plans, experts, sequence)
    simulated, sim_inputs = _simulated_plans(world, experts, sequence)
    assert all(r["inputs"] == sim_inputs for r in ranks), (ranks[0]["inputs"], sim_inputs)
    replicated = 0
    for step, sim in enumerate(simulated):
        for rank, result in enumerate(ranks):
            call = result["calls"][step]
            # the first call has no call order yet, so nothing was prefetched: the runtime gathers the same owner
            # placement synchronously
            if call["prefetched"] is not None:
                assert call["prefetched"] == sim["prefetched"], f"step {step} rank {rank}: prefetched placement"
            assert call["executed"] == sim["executed"], f"step {step} rank {rank}: executed placement"
            assert call["send"] == sim["send"][rank] and call["recv"] == sim["recv"][rank], \
                f"step {step} rank {rank}: dispatch"
        replicated += sum(len(m) for m in sim["executed"]) > experts
    assert replicated >= 3, "the sequence should make the planner replicate experts"
    if world > experts:   # the start layout: every rank holds an expert from the first prefetch on
        assert all(len(m) >= 1 for m in simulated[2]["executed"])
