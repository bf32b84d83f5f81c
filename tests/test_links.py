"""The scheduler's objective prices token traffic on the link it takes (issue 26, item 5).

On one node one link prices everything, as before. Across nodes a token row or an expert that stays on its node
costs NVLink time (``link_gbps``) and one that crosses costs its node's NICs (``inter_node_gbps`` per rank, shared by
the node's ranks), each rank charged for its slowest link: the simulator's link model, so the search optimises what
the simulator times, and a replica that keeps tokens home is worth what it saves.
"""
from __future__ import annotations

import numpy as np
import pytest

from ds_hecate.config import HecateConfig
from ds_hecate.planning.cost_model import StepCostModel, estimate_layer, scheduler_costs
from ds_hecate.planning.placement import shadow_placement
from ds_hecate.planning.plan import holders_matrix
from ds_hecate.planning.search import SearchSettings, schedule_materialization


def _costs(world, rpn, **cfg):
    config = HecateConfig(enabled=True, **cfg)
    return scheduler_costs(config, {"link_gbps": 100.0, "compute_s_per_pair": 1e-6}, world, rpn,
                           expert_bytes=8_000_000, token_bytes=4_000, overlaps_compute=True)


def test_one_node_keeps_one_link_and_several_nodes_get_two():
    one = _costs(8, 8)
    assert not one.two_links and one.token_transfer_s == pytest.approx(4_000 / 100e9)
    two = _costs(16, 8, inter_node_gbps=10.0)
    assert two.two_links
    assert two.token_transfer_s == pytest.approx(4_000 / 100e9)          # inside a node: link_gbps
    assert two.token_transfer_inter_s == pytest.approx(4_000 / 10e9)     # across: inter_node_gbps per rank
    assert two.slowest_expert_transfer_s == pytest.approx(8_000_000 / 10e9)
    assert two.single_link().token_transfer_s == two.token_transfer_inter_s and not two.single_link().two_links
    # overlap_degree counts experts over the slowest link, as the paper's t
    assert _costs(16, 8, inter_node_gbps=10.0, overlap_degree=3).overlap_s == pytest.approx(3 * 8_000_000 / 10e9)
    # measured inter-node bandwidth when the config has none; else link_gbps for both
    measured = scheduler_costs(HecateConfig(enabled=True), {"link_gbps": 100.0, "inter_node_gbps": 5.0}, 16, 8,
                               8_000_000, 4_000, True)
    assert measured.token_transfer_inter_s == pytest.approx(4_000 / 5e9)
    assert _costs(16, 8).token_transfer_inter_s == pytest.approx(4_000 / 100e9)


def test_estimate_charges_each_rank_its_slowest_link():
    """2 nodes x 2 ranks, every expert on its owner: rank 0 receives 30 rows from rank 1 (same node) and 20 from
    ranks 2, 3 (the other node's 10 each)."""
    costs = StepCostModel(compute_s_per_pair=0.0, token_transfer_s=1.0, expert_transfer_s=0.0,
                          token_transfer_inter_s=100.0, expert_transfer_inter_s=0.0)
    owners = (0, 1, 2, 3)
    counts = np.zeros((4, 4))
    counts[1, 0], counts[2, 0], counts[3, 0] = 30, 10, 10
    mat = tuple((e,) for e in range(4))
    est = estimate_layer(counts, owners, mat, costs, 2)
    # rank 0: NVLink 30 rows x 1, NICs of node 0: 20 rows received x 100 / 2 ranks = 1000
    assert est.rank_time_s[0] == pytest.approx(max(30 * 1.0, 20 * 100.0 / 2))
    # ranks 2 and 3 share their node's NICs: 20 rows sent x 100 / 2
    assert est.rank_time_s[2] == est.rank_time_s[3] == pytest.approx(1000.0)
    single = estimate_layer(counts, owners, mat, costs.single_link(), 2)
    assert single.rank_time_s[0] == pytest.approx(50 * 100.0)      # one link: all 50 rows at the slowest price


def test_search_keeps_a_hot_experts_tokens_on_their_node():
    """One hot expert owned by rank 0 of 4 nodes x 4 ranks; NVLink 50x the NICs. Priced on two links the search
    gives every node copies, and more than one on the other nodes: a node's tokens then spread over NVLink, which
    is cheap, and cross no NIC. Priced on one link (what the search had before) a copy beside another only saves
    NIC-priced rows, so it stops at one per node at most, and that placement is a third slower on the two-link
    estimate."""
    world, rpn, experts = 16, 4, 16
    owners = tuple(range(experts))
    counts = np.full((world, experts), 20.0)
    counts[:, 0] += 400.0
    two = StepCostModel(compute_s_per_pair=1e-6, token_transfer_s=2e-8, expert_transfer_s=1e-5,
                        token_transfer_inter_s=1e-6, expert_transfer_inter_s=5e-4)
    mat = holders_matrix(schedule_materialization(counts, owners, SearchSettings(two, 4, rpn)), world, experts)
    per_node = np.add.reduceat(mat[:, 0].astype(int), np.arange(0, world, rpn))
    assert (per_node[1:] >= 2).all(), per_node
    single = holders_matrix(schedule_materialization(counts, owners, SearchSettings(two.single_link(), 4, rpn)), world,
                            experts)
    assert (np.add.reduceat(single[:, 0].astype(int), np.arange(0, world, rpn))[1:] <= 1).all()
    est = estimate_layer(counts, owners, mat, two, rpn).time_s
    assert est < 0.75 * estimate_layer(counts, owners, single, two, rpn).time_s


def test_fastermoe_baseline_decides_on_one_link_whatever_the_model_gives_it():
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 50, size=(16, 8)).astype(float)
    counts[:, 2] += 300
    owners = tuple(e * 16 // 8 for e in range(8))
    two = StepCostModel(compute_s_per_pair=1e-6, token_transfer_s=2e-8, expert_transfer_s=1e-5,
                        token_transfer_inter_s=1e-6, expert_transfer_inter_s=5e-4)
    assert shadow_placement(counts, owners, two) == shadow_placement(counts, owners, two.single_link())
