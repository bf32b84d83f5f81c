"""The scheduler prices a prefetched copy's two transfers in their own windows (issue 26, item 5).

The runtime gathers a copy before the layer (SparseAllGather, hidden behind the non-MoE compute before it, T_nonMoE)
and issues its SparseReduceScatter asynchronously in backward, where the rest of backward runs while it is in flight
(about twice the forward compute: ``cost_model.BACKWARD_FACTOR``, the simulator's ``t_b``). Priced together in the
forward window, a copy of a large expert looked dearer than it is (simulated bert-moe W4 kept the owners, 6-8% slower
than with the copies). A layer that re-materializes gathers again in backward, in the reduction's window.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from ds_hecate.config import HecateConfig
from ds_hecate.planning.cost_model import (BACKWARD_FACTOR, CommCostModel, StepCostModel, estimate_layer,
                                           scheduler_costs)
from ds_hecate.runtime.hecate import HecateRuntime
from ds_hecate.runtime.layer import LayerBinding

# two ranks, one node; rank 1 takes a copy of expert 0 (prefetched); no token traffic in the way
COUNTS = [[0, 0], [10, 0]]
OWNERS = (0, 1)
PLACEMENT = ((0,), (0, 1))


def _exposed(**fields) -> float:
    """The exposed transfer time of the copy: the layer's time less rank 1's compute (tokens stay home)."""
    costs = StepCostModel(compute_s_per_pair=0.01, token_transfer_s=0.0, expert_transfer_s=1.0, overlap_s=0.4,
                          **fields)
    est = estimate_layer(COUNTS, OWNERS, PLACEMENT, costs, 2, prefetched=PLACEMENT)
    return est.time_s - 10 * 0.01


def test_gather_and_reduction_hide_in_their_own_windows():
    # together in the forward window (no share given): 1.0 - 0.4 exposed
    assert _exposed() == pytest.approx(0.6)
    # half of it the reduction: the gather 0.5 - 0.4 exposed, the reduction hidden by backward's 0.8
    assert _exposed(reduce_share=0.5, reduce_overlap_s=0.8) == pytest.approx(0.1)
    # a reduction longer than backward's window shows its excess
    assert _exposed(reduce_share=0.5, reduce_overlap_s=0.3) == pytest.approx(0.1 + 0.2)
    # re-materialized: backward's window holds the gather again beside the reduction (1.0 - 0.8)
    assert _exposed(reduce_share=0.5, reduce_overlap_s=0.8, regather=True) == pytest.approx(0.1 + 0.2)


def test_scheduler_costs_give_the_reduction_backwards_window_where_compute_hides_transfers():
    config = HecateConfig(enabled=True)
    measured = {"link_gbps": 100.0, "non_moe_time_s": 2e-3}
    gpu = scheduler_costs(config, measured, 8, 8, expert_bytes=6_000, token_bytes=400, overlaps_compute=True,
                          reduce_bytes=4_000)
    assert gpu.reduce_share == pytest.approx(4_000 / 6_000)
    assert gpu.reduce_overlap_s == pytest.approx(BACKWARD_FACTOR * 2e-3) and gpu.overlap_s == pytest.approx(2e-3)
    assert not gpu.regather
    assert scheduler_costs(config, measured, 8, 8, 6_000, 400, True, reduce_bytes=4_000, regather=True).regather
    # on a CPU the same cores run both: nothing hides, as before
    cpu = scheduler_costs(config, measured, 8, 8, 6_000, 400, overlaps_compute=False, reduce_bytes=4_000)
    assert cpu.overlap_s == 0.0 and cpu.reduce_overlap_s == 0.0
    # without the reduction's bytes: the whole transfer in the forward window, as before
    assert scheduler_costs(config, measured, 8, 8, 6_000, 400, True).reduce_share == 0.0


@pytest.mark.parametrize("rematerializes", [False, True])
def test_runtime_prices_its_layers_reduction_and_regather(rematerializes):
    # the runtime's own step_costs on one layer's binding: the reduction's bytes in its reduce dtype, and the
    # layer's re-materialization as the replica pool resolved it
    runtime = SimpleNamespace(config=HecateConfig(enabled=True), measured={"non_moe_time_s": 1e-3}, ep_size=8,
                              ranks_per_node=8, overlaps_compute=True, relays_stream_ordered=True, _costs={})
    cost = CommCostModel(hidden_size=16, expert_numel=1_000, activation_bytes=2, param_bytes=2, grad_bytes=4)
    binding = SimpleNamespace(cost=cost, rematerializes=rematerializes, index=0)
    costs = HecateRuntime.step_costs(cast(HecateRuntime, runtime), cast(LayerBinding, binding))   # stand-ins
    assert costs.reduce_share == pytest.approx(4 / 6)
    assert costs.reduce_overlap_s == pytest.approx(BACKWARD_FACTOR * 1e-3)
    assert costs.regather is rematerializes


def test_simulator_plans_with_the_runtimes_windows():
    # the simulated Hecate plans with the runtime's formula: the reduction's share in its wire dtype, backward's
    # window where the cluster overlaps compute, and the re-materializing system's second gather
    from ds_hecate.config import HecateConfig as Config
    from ds_hecate.sim.core import _context
    from ds_hecate.sim.presets import resolve_cluster, resolve_model
    from ds_hecate.sim.systems import HecateSystem, make_system
    from ds_hecate.sim.model_state import ADAM
    from ds_hecate.sim.settings import SimSettings

    cluster, model = resolve_cluster("a100-4x8"), resolve_model("bert-moe")
    ctx = _context(cluster, model, model.tokens_per_rank, Config(enabled=True, materialize_budget_mb=8000.0),
                   SimSettings(zero_stage=1, precision="bf16", optimizer=ADAM, spag="p2p"), cluster.world_size)
    for system, regather in (("hecate", False), ("hecate-rm", True)):
        costs = cast(HecateSystem, make_system(system, ctx)).planners[0].inputs.costs
        assert costs.reduce_share == pytest.approx(ctx.grad_b / (ctx.compute_b + ctx.grad_b))
        assert costs.reduce_overlap_s == pytest.approx(BACKWARD_FACTOR * costs.overlap_s) and costs.overlap_s > 0
        assert costs.regather is regather
