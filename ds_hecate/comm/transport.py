"""The small transport interface under Hecate's collectives, and its torch.distributed implementation.

:class:`~ds_hecate.comm.collectives.Communicator` implements every Hecate collective (count exchange, SparseAllGather,
SparseReduceScatter, expert move, ragged token all-to-all) once, on top of the six primitives below, the way
FSDP2 plugs its all-gather variants under one ``foreach_all_gather``. A transport moves bytes:
:class:`TorchTransport` (torch.distributed: NCCL on CUDA, gloo on CPU) and
:class:`ds_hecate.comm.gpu.nccl_comm.CupyTransport` (NCCL through CuPy). Every tensor handed to a transport lives on
its ``device``; every rank calls the same primitives in the same order (sizes may be zero).

A transport whose primitives run in issue order on a device stream and whose waits are stream-side (NCCL on
CUDA) is ``stream_ordered``: its :meth:`Transport.relay_scope` lets the relay trees of the sparse collectives issue
every level when the collective starts, each level waiting for the one above on the device, not on the host
(:mod:`ds_hecate.comm.relay`); gloo's works complete on the host, so there the deeper levels wait for the collective's
wait.

Beside the primitives a transport names its :class:`DeviceOps`: how the sparse collectives pack experts into a send
buffer and add received gradients into the owners' accumulators, and the layer call's fused weighted un-permute.
:class:`DeviceOps` itself is the torch statement (the CPU path, and the contract of the CUDA kernels that
``ds_hecate.comm.gpu`` plugs in for the CuPy transport).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from .device import to_device


class DeviceOps:
    """The device work around a transport's collectives, in torch: pack experts into rows, add received rows into
    accumulators, and (``combine``, None here: the layer call's torch path runs) the weighted un-permute kernel.

    ``pack`` is one pass (``torch.stack`` with a cast into the destination); ``accumulate`` adds received gradient
    rows into the owner's fp32 accumulator rows in receive order (source rank ascending), the order the reduction
    is defined in. On the CPU that is one ``index_add_`` (sequential in index order); on CUDA ``index_add_`` with a
    repeated index is atomic and its order undefined, so the rows are added in rounds whose indices are distinct
    (one round per replica of the most replicated expert, not per expert).
    """

    #: ``combine(y, pos, gates) -> out``: ``out[t] = sum_j gates[j, t] * y[pos[j*S + t]]`` with fp32 products and
    #: sum (``pos < 0``: a dropped slot), cast to ``y.dtype`` (``ds_hecate.comm.gpu.reference.unpermute_combine``);
    #: forward only, None when the transport has no kernel for it.
    combine: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None

    def pack(self, srcs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """``out[i] = srcs[i]`` flattened and cast to ``out.dtype`` (``out``: ``[len(srcs), numel]``)."""
        if srcs:   # experts are flat already: no per-expert view op
            torch.stack([s if s.dim() == 1 else s.reshape(-1) for s in srcs], out=out)

    def accumulate(self, target: torch.Tensor, recv: torch.Tensor, target_rows: Sequence[int]) -> None:
        """``target[target_rows[i]] += recv[i]`` in fp32, for i ascending (``target``: fp32 ``[n, numel]``)."""
        if not target_rows:
            return
        rows = recv if recv.dtype == target.dtype else recv.to(target.dtype)
        if target.device.type == "cpu":
            target.index_add_(0, torch.tensor(list(target_rows), dtype=torch.int64), rows)
            return
        for picks, targets in _distinct_rounds(target_rows):
            source = rows if len(picks) == rows.shape[0] else rows.index_select(
                0, to_device(torch.tensor(picks, dtype=torch.int64), target.device))
            target.index_add_(0, to_device(torch.tensor(targets, dtype=torch.int64), target.device), source)


def _distinct_rounds(target_rows: Sequence[int]) -> List[Tuple[List[int], List[int]]]:
    """Split ``i -> target_rows[i]`` into rounds of distinct targets, each target's occurrences in order: round r
    holds every target's r-th occurrence, as (positions i, targets)."""
    seen: dict = {}
    rounds: List[Tuple[List[int], List[int]]] = []
    for i, t in enumerate(target_rows):
        r = seen.get(t, 0)
        seen[t] = r + 1
        if r == len(rounds):
            rounds.append(([], []))
        rounds[r][0].append(i)
        rounds[r][1].append(t)
    return rounds


TORCH_DEVICE_OPS = DeviceOps()


class Work(Protocol):
    """An asynchronous primitive in flight."""

    def wait(self) -> Any: ...


class Transport(Protocol):
    """What a Hecate transport provides (all primitives are collective over its ranks)."""

    device: torch.device
    rank: int
    world_size: int
    device_ops: DeviceOps

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, recv_splits: Sequence[int],
                   send_splits: Sequence[int], async_op: bool) -> Optional[Work]: ...

    def all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None: ...

    def all_reduce(self, value: torch.Tensor, op: dist.ReduceOp) -> None: ...

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` = this rank's ``1/world`` of the sum of every rank's ``inp`` (``inp`` is ``world`` chunks of
        ``out``'s size, chunk ``r`` for rank ``r``)."""

    def broadcast(self, value: torch.Tensor, src: int) -> None: ...

    def all_gather_object(self, obj: Any) -> List[Any]: ...

    @property
    def stream_ordered(self) -> bool:
        """Whether :meth:`relay_scope` gives a scope (primitives in issue order on a stream, stream-side waits)."""

    def relay_scope(self, tensors: Sequence[torch.Tensor]) -> Optional[ContextManager[Callable[[], None]]]:
        """Where ``stream_ordered``, a context in which the caller issues a chain of primitives and the device work
        between them off its own stream, after the work queued on it so far (``tensors``, made on the caller's
        stream, are marked in use there); it gives a function that, called later, orders the caller's then current
        stream after everything issued inside. None elsewhere."""


@contextlib.contextmanager
def cuda_side_scope(stream: Any, device: torch.device,
                    tensors: Sequence[torch.Tensor]) -> Iterator[Callable[[], None]]:
    """:meth:`Transport.relay_scope` on a CUDA ``stream`` beside the caller's: the stream waits for the caller's work
    so far, ``tensors`` are marked in use on it (the caching allocator does not hand them out while it works on
    them), everything inside runs on it, and the function given orders the caller's stream after its end (an
    event: the host never waits)."""
    stream.wait_stream(torch.cuda.current_stream(device))
    for t in tensors:
        t.record_stream(stream)
    ended: List[Any] = []
    with torch.cuda.stream(stream):
        yield lambda: torch.cuda.current_stream(device).wait_event(ended[0])
    event = torch.cuda.Event()
    event.record(stream)
    ended.append(event)


def _all_gather_single(out: torch.Tensor, local: torch.Tensor, group) -> None:
    """torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (the old name warns); older releases
    (torch 2.11 among them) have only the old name. Looked up per call: a test may wrap either."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


class TorchTransport:
    """torch.distributed on one process group (Hecate's own, created with ``collective_timeout_s``)."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int,
                 device: torch.device, device_ops: Optional[DeviceOps] = None) -> None:
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, torch.device(device)
        self.device_ops = device_ops if device_ops is not None else TORCH_DEVICE_OPS
        self._side_stream: Any = None   # the relays' stream, made on first use (CUDA with NCCL only)

    @property
    def stream_ordered(self) -> bool:
        """NCCL on CUDA: works run on the process group's stream in issue order and ``wait`` is stream-side."""
        return (self.device.type == "cuda" and dist.is_initialized()
                and dist.get_backend(self.group) == dist.Backend.NCCL)

    def relay_scope(self, tensors):
        if not self.stream_ordered:
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device)
        return cuda_side_scope(self._side_stream, self.device, tensors)

    def all_to_all(self, recv, send, recv_splits, send_splits, async_op):
        return dist.all_to_all_single(recv, send, output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits), group=self.group, async_op=async_op)

    def all_gather(self, out, local):
        _all_gather_single(out, local, group=self.group)

    def all_reduce(self, value, op=dist.ReduceOp.SUM):
        dist.all_reduce(value, op=op, group=self.group)

    def reduce_scatter(self, out, inp):
        dist.reduce_scatter_tensor(out, inp, group=self.group)

    def broadcast(self, value, src):
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        dist.broadcast(value, src=global_src, group=self.group)

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
