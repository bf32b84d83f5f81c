"""A model-parallel unit (``mpu``) for tests: the world as ``world / T`` data-parallel slices of ``T`` consecutive
tensor-parallel ranks (Megatron's layout), answering what DeepSpeed asks an mpu (the older ``get_model_parallel_*``
names, which ``deepspeed.utils.bwc`` falls back to). The model itself stays replicated over the tensor-parallel ranks:
what matters to the MoE layers is that their input is the same on the ranks of a slice."""
from __future__ import annotations

import torch.distributed as dist


class GridMPU:
    def __init__(self, tp_size: int) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size % tp_size:
            raise ValueError(f"tensor-parallel size {tp_size} does not divide the world size {self.world_size}")
        self.tp_size = tp_size
        self.tp_group = self.dp_group = None
        for first in range(0, self.world_size, tp_size):   # every rank creates every group, in the same order
            ranks = list(range(first, first + tp_size))
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.tp_group = group
        for tp_rank in range(tp_size):
            ranks = list(range(tp_rank, self.world_size, tp_size))
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return self.rank % self.tp_size

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.tp_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size // self.tp_size

    def get_data_parallel_group(self):
        return self.dp_group


def flat_token_gather_on_gloo() -> None:
    """Let DeepSpeed's MoE run its tensor-parallel path on gloo. ``deepspeed.moe.mappings._gather_tokens``
    all-gathers a ``[E, C, M]`` tensor into a flat buffer through ``deepspeed.comm.all_gather_into_tensor``; NCCL
    takes any shapes of the right sizes, gloo insists that the input be shaped like one slot of the output. The
    input is flattened here (a view of the same elements, so the gathered buffer is bit for bit what NCCL gives).
    Only the oracle process installs it; idempotent."""
    import deepspeed.comm as ds_comm

    original = ds_comm.all_gather_into_tensor
    if getattr(original, "_flat_for_gloo", False):
        return

    def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, **kwargs):
        if output_tensor.dim() == 1 and tensor.dim() > 1:
            tensor = tensor.reshape(-1)
        return original(output_tensor, tensor, group=group, async_op=async_op, **kwargs)

    setattr(all_gather_into_tensor, "_flat_for_gloo", True)
    ds_comm.all_gather_into_tensor = all_gather_into_tensor
