"""Sharded placement P: which rank owns each expert's master weights and optimizer state."""
from __future__ import annotations

from typing import Tuple


def even_sharding(num_experts: int, world_size: int) -> Tuple[int, ...]:
    """Whole experts in contiguous blocks, block sizes differing by at most one (ranks past E own none).

    Contiguous blocks mirror DeepSpeed's expert-parallel layout (rank r holds experts [r*E/N, (r+1)*E/N)), so
    'owner' placement is exactly plain expert parallelism.
    """
    if num_experts < 1 or world_size < 1:
        raise ValueError(f"even_sharding needs num_experts >= 1 and world_size >= 1, got {num_experts}, {world_size}")
    base, extra = divmod(num_experts, world_size)
    owners = []
    for rank in range(world_size):
        owners.extend([rank] * (base + (1 if rank < extra else 0)))
    return tuple(owners)
