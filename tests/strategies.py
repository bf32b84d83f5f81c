"""Hypothesis strategies shared by the planner and scheduler property tests."""
from __future__ import annotations

from hypothesis import strategies as st

from ds_hecate.planning import even_sharding


@st.composite
def topologies(draw, max_world: int = 8, max_experts: int = 16):
    """(world, num_experts, ranks_per_node dividing world, owners: even or arbitrary sharding)."""
    world = draw(st.integers(1, max_world))
    num_e = draw(st.integers(1, max_experts))
    rpn = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    if draw(st.booleans()):
        owners = even_sharding(num_e, world)
    else:
        owners = tuple(draw(st.lists(st.integers(0, world - 1), min_size=num_e, max_size=num_e)))
    return world, num_e, rpn, owners
