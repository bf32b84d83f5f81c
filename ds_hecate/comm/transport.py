"""The small transport interface under Hecate's collectives, and its torch.distributed implementation.

:class:`~ds_hecate.comm.collectives.Communicator` implements every Hecate collective (count exchange, SparseAllGather,
SparseReduceScatter, expert move, ragged token all-to-all) once, on top of the five primitives below, the way
FSDP2 plugs its all-gather variants under one ``foreach_all_gather``. A transport moves bytes and nothing else:
:class:`TorchTransport` (torch.distributed: NCCL on CUDA, gloo on CPU) and
:class:`ds_hecate.comm.gpu.nccl_comm.CupyTransport` (NCCL through CuPy). Every tensor handed to a transport lives on
its ``device``; every rank calls the same primitives in the same order (sizes may be zero).
"""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence

import torch
import torch.distributed as dist


class Work(Protocol):
    """An asynchronous primitive in flight."""

    def wait(self) -> Any: ...


class Transport(Protocol):
    """What a Hecate transport provides (all primitives are collective over its ranks)."""

    device: torch.device
    rank: int
    world_size: int

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, recv_splits: Sequence[int],
                   send_splits: Sequence[int], async_op: bool) -> Optional[Work]: ...

    def all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None: ...

    def all_reduce(self, value: torch.Tensor, op: dist.ReduceOp) -> None: ...

    def broadcast(self, value: torch.Tensor, src: int) -> None: ...

    def all_gather_object(self, obj: Any) -> List[Any]: ...


class TorchTransport:
    """torch.distributed on one process group (Hecate's own, created with ``collective_timeout_s``)."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int,
                 device: torch.device) -> None:
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, torch.device(device)

    def all_to_all(self, recv, send, recv_splits, send_splits, async_op):
        return dist.all_to_all_single(recv, send, output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits), group=self.group, async_op=async_op)

    def all_gather(self, out, local):
        dist.all_gather_into_tensor(out, local, group=self.group)

    def all_reduce(self, value, op=dist.ReduceOp.SUM):
        dist.all_reduce(value, op=op, group=self.group)

    def broadcast(self, value, src):
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        dist.broadcast(value, src=global_src, group=self.group)

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
