"""A replica's fixed cost on its holder (``StepCostModel.replica_overhead_s``, ``hecate.replica_overhead_s``).

Pure planning code plus the profiling probe on a stand-in runtime (no process group). Why it exists: replicas the
cost model priced faster than none were slower on two CPU ranks (the step benchmark's W4; docs/perf/training-step-
2026-12-05.md): the estimate had no term for what one more expert costs the rank that holds it.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict

import numpy as np
import pytest
import torch

from ds_hecate.config import HecateConfig
from ds_hecate.experts import ExpertKernel
from ds_hecate.planning.cost_model import StepCostModel, estimate_layer, scheduler_costs
from ds_hecate.planning.search import SearchSettings, schedule_materialization
from ds_hecate.planning.search.state import SearchState
from ds_hecate.runtime.profiling import _probe_replica_overhead_s

COUNTS = [[1, 2, 3], [4, 5, 6]]
OWNERS = (0, 0, 1)
MAT = ((0, 1), (0, 1, 2))          # rank 1 holds replicas of experts 0 and 1


def _costs(overhead: float) -> StepCostModel:
    return StepCostModel(compute_s_per_pair=1.0, token_transfer_s=0.5, expert_transfer_s=3.0, overlap_s=6.0,
                         replica_overhead_s=overhead)


def test_each_replica_costs_its_holder_and_no_one_else():
    base = estimate_layer(COUNTS, OWNERS, MAT, _costs(0.0), 1).rank_time_s
    charged = estimate_layer(COUNTS, OWNERS, MAT, _costs(0.25), 1).rank_time_s
    assert charged[0] == base[0]                          # the owner sends, holds no replica
    assert charged[1] == pytest.approx(base[1] + 2 * 0.25)  # two replicas held
    owners_only = ((0, 1), (2,))
    assert (estimate_layer(COUNTS, OWNERS, owners_only, _costs(0.25), 1).rank_time_s
            == estimate_layer(COUNTS, OWNERS, owners_only, _costs(0.0), 1).rank_time_s)


@pytest.mark.parametrize("prefetched", [None, ((0, 1), (0, 2))])   # prefetched, and one copy gathered after the gate
def test_the_search_prices_replicas_as_the_estimate_does(prefetched):
    costs = _costs(0.25)
    search = SearchState(COUNTS, OWNERS, costs, 1, MAT, prefetched)
    assert search.times.tolist() == pytest.approx(
        list(estimate_layer(COUNTS, OWNERS, MAT, costs, 1, prefetched=prefetched).rank_time_s))


def test_a_replica_that_saves_less_than_its_overhead_is_not_placed():
    # one hot expert on rank 0: a replica on rank 1 takes half of its pairs
    counts = [[40, 2], [40, 2]]
    cheap = StepCostModel(compute_s_per_pair=1e-3, token_transfer_s=1e-5, expert_transfer_s=1e-4)
    assert len(schedule_materialization(counts, (0, 1), SearchSettings(cheap, 1, 2))[1]) == 2   # rank 1 takes a copy
    dear = StepCostModel(compute_s_per_pair=1e-3, token_transfer_s=1e-5, expert_transfer_s=1e-4,
                         replica_overhead_s=0.05)                                        # more than the 40 ms saved
    assert schedule_materialization(counts, (0, 1), SearchSettings(dear, 1, 2)) == ((0,), (1,))


def test_configured_wins_over_measured_and_absent_is_not_priced():
    args: Dict[str, Any] = dict(world_size=2, ranks_per_node=2, expert_bytes=1000, token_bytes=10,
                                overlaps_compute=False)
    measured = {"compute_s_per_pair": 1e-5, "link_gbps": 1.0, "replica_overhead_s": 2e-4}
    assert scheduler_costs(HecateConfig(), measured, **args).replica_overhead_s == 2e-4
    assert scheduler_costs(HecateConfig(replica_overhead_s=0.0), measured, **args).replica_overhead_s == 0.0
    assert scheduler_costs(HecateConfig(replica_overhead_s=1e-3), measured, **args).replica_overhead_s == 1e-3
    del measured["replica_overhead_s"]
    assert scheduler_costs(HecateConfig(), measured, **args).replica_overhead_s == 0.0


def test_a_negative_configured_overhead_is_refused():
    with pytest.raises(Exception, match="replica_overhead_s"):
        HecateConfig(replica_overhead_s=-1e-3)


class _SwiGLU(torch.nn.Module):
    def __init__(self, hidden: int = 32, ffn: int = 64) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(hidden, ffn, bias=False)
        self.w3 = torch.nn.Linear(hidden, ffn, bias=False)
        self.w2 = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


def test_the_probe_times_one_more_expert_on_the_layers_own_kernel():
    binding = SimpleNamespace(shard=SimpleNamespace(kernel=ExpertKernel(_SwiGLU())), hidden_size=32)
    rt = SimpleNamespace(bindings=[binding], comm=SimpleNamespace(device=torch.device("cpu")),
                         compute_dtype=torch.float32)
    seconds = _probe_replica_overhead_s(rt)
    assert np.isfinite(seconds) and 0.0 < seconds < 0.1


def test_training_measures_the_overhead_once_for_every_rank():
    """Two gloo ranks, costs not configured: the warm profiling (step 4) records the probe's figure, one value for
    every rank (identical plans keep the collectives matched), and the checkpoint carries it with the rest."""
    from moe_training import Spec, run_specs
    from ds_hecate.runtime.profiling import WARM_PROFILE_STEP

    runs = run_specs(2, [Spec(hecate={"enabled": True, "placement": "hecate"}, steps=WARM_PROFILE_STEP + 1)])[0]
    measured = [r["hecate_stats"]["measured_costs"] for r in runs]
    assert measured[0] == measured[1]
    assert measured[0]["profiled_at_step"] == WARM_PROFILE_STEP
    assert 0.0 < measured[0]["replica_overhead_s"] < 0.1


def test_the_simulator_plans_with_a_measured_overhead_as_the_runtime_would():
    """``ds-hecate simulate --measured`` builds its cluster from a run's measured costs: the planner inside gets the
    run's replica overhead too (else it would place replicas the run's own planner refused)."""
    from ds_hecate.sim import SimSettings, simulate
    from ds_hecate.sim.presets import Cluster, ModelShape

    tiny = ModelShape(name="tiny", moe_layers=2, hidden_size=64, ffn_size=128, num_experts=4, top_k=2, vocab_size=0,
                      seq_len=256, expert_bias=True)
    measured = {"compute_s_per_pair": 2e-5, "link_gbps": 1.0, "non_moe_time_s": 3e-3}

    def replicas(overhead: float) -> float:
        cluster = Cluster.from_measured({**measured, "replica_overhead_s": overhead}, world_size=2)
        settings = SimSettings(steps=4, tokens_per_rank=512, precision="fp32",
                               hecate=HecateConfig(enabled=True, calibration=False))
        result = simulate(cluster, tiny, "W1", settings, systems=["hecate"])
        return result.systems["hecate"].replicas_per_layer

    assert replicas(0.0) > 0
    assert replicas(1.0) == 0
