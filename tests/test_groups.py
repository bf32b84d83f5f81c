"""Hecate domains (``hecate.ep_size``, ds_hecate.planning.groups): the rule that picks the group size, and the group
arithmetic the runtime, the simulator and ``ds-hecate plan`` share."""
from __future__ import annotations

import pytest

from ds_hecate.errors import HecateConfigError
from ds_hecate.planning.groups import ExpertGroups, resolve_ep_size


def test_world_at_most_experts_is_one_group():
    """Today's whole-world FSSDP, unchanged wherever the world is at most the number of experts."""
    assert resolve_ep_size(None, [], 32, 64, 8) == (32, None)
    assert resolve_ep_size(None, [], 2, 8, 2) == (2, None)
    assert resolve_ep_size(None, [], 64, 64, 8) == (64, None)


@pytest.mark.parametrize("world,experts,rpn,want", [
    (1024, 8, 8, 8),        # Mixtral-8x7B on 128 x 8 H100: one node per group
    (1024, 256, 8, 256),    # DeepSeek-V3: 32 nodes per group, 4 groups
    (1024, 100, 8, 64),     # the largest divisor of 1024 at most 100
    (48, 10, 8, 8),         # 6 divides 48 and is <= 10 but splits nodes of 8
    (24, 6, 8, 4),          # 6 would split a node; 4 is a divisor of the node
    (16, 3, 8, 2),          # 3 does not divide 16
])
def test_default_is_the_largest_node_aligned_divisor_at_most_the_experts(world, experts, rpn, want):
    assert resolve_ep_size(None, [], world, experts, rpn) == (want, None)


def test_layers_of_different_sizes_use_the_smallest():
    assert resolve_ep_size(None, [], 1024, [256, 8, 64], 8) == (8, None)
    assert resolve_ep_size(None, [], 32, [64, 16], 8) == (16, None)


def test_deepspeed_ep_size_is_taken_and_disagreement_named():
    assert resolve_ep_size(None, [4, 4, 1], 16, 8, 8) == (4, None)     # ep_size 1 says nothing
    assert resolve_ep_size(None, [1, 1], 16, 8, 8) == (8, None)
    assert resolve_ep_size(16, [4], 16, 8, 8) == (16, None)             # the config's key wins
    with pytest.raises(HecateConfigError, match=r"different ep_size values \[2, 4\]"):
        resolve_ep_size(None, [2, 4], 16, 8, 8)
    with pytest.raises(HecateConfigError, match="the MoE layers' ep_size = 3"):
        resolve_ep_size(None, [3], 16, 8, 8)


def test_explicit_non_divisor_fails_naming_key_and_value():
    with pytest.raises(HecateConfigError) as info:
        resolve_ep_size(7, [], 1024, 8, 8)
    msg = str(info.value)
    assert "hecate.ep_size = 7" in msg and "world size 1024" in msg and "1, 2, 4, 8" in msg
    with pytest.raises(HecateConfigError, match="hecate.ep_size = 0"):
        resolve_ep_size(0, [], 8, 8, 8)


def test_node_splitting_explicit_size_is_accepted_with_a_warning():
    size, warning = resolve_ep_size(12, [], 48, 64, 8)
    assert size == 12
    assert warning is not None and "hecate.ep_size = 12 splits nodes of 8 ranks" in warning
    assert "inter-node" in warning and "node-aligned choices: 1, 2, 4, 8, 16, 24, 48" in warning
    for aligned in (4, 8, 16, 48):   # divisors and multiples of the node are silent
        assert resolve_ep_size(aligned, [], 48, 64, 8) == (aligned, None)


def test_group_arithmetic():
    g = ExpertGroups(world_size=1024, ep_size=8, ranks_per_node=8)
    assert g.num_groups == g.edp_size == 128
    assert g.group_ranks(2) == tuple(range(16, 24))
    assert g.group_of(17) == 2 and g.local_rank(17) == 1 and g.global_rank(2, 1) == 17
    assert g.edp_peers(17) == tuple(range(1, 1024, 8)) and g.edp_peers(1) == g.edp_peers(1017)
    assert not g.splits_nodes and not g.spans_nodes
    assert ExpertGroups(1024, 256, 8).spans_nodes
    assert ExpertGroups(48, 12, 8).splits_nodes
    assert [r for grp in ExpertGroups(12, 4, 4).all_groups() for r in grp] == list(range(12))
    with pytest.raises(HecateConfigError, match="hecate.ep_size = 5"):
        ExpertGroups(16, 5, 8)
    with pytest.raises(ValueError, match="ExpertGroups: rank 16 out of range"):
        ExpertGroups(16, 4, 4).local_rank(16)
