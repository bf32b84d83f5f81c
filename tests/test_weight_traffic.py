"""Weight traffic beside token traffic (issue 24): a slow SparseReduceScatter does not hold back backward's token
all-to-all.

On NCCL, collectives issued on one communicator run one after another on its stream: had SparseReduceScatter (issued
first in backward, asynchronously) shared the token all-to-all's communicator, the token-gradient all-to-all issued
right after it would wait for it, and backward with it. Hecate gives weight traffic a communicator of its own.

Here each transport runs its primitives in order on a worker thread, as a stream does (``FifoTransport``), and every
SparseReduceScatter is delayed on purpose (a stall queued on the weight transport before it, as a slow link would
be). Two real gloo ranks run a layer call forward and backward; each transport records when each collective
completed. With the runtime's own communicators (``build_communicator(..., weight_group=...)``, as initialize
builds them) the token-gradient all-to-all completes before the delayed SparseReduceScatter; the control with one
shared communicator shows the measurement sees the difference (there it completes after).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

from dist_utils import run_ranks

HIDDEN, EXPERTS, TOKENS, STALL_S = 8, 4, 16, 1.5
_LABEL = threading.local()   # the Communicator's name of the collective being issued (set by the patch below)


class _Job:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class FifoTransport:
    """A transport whose primitives run one after another on one worker thread, like NCCL kernels on one stream;
    ``log`` gets (collective, completion time) of each."""

    def __init__(self, inner, log: List[Tuple[str, float]]) -> None:
        self.inner, self.log = inner, log
        self.device, self.rank, self.world_size = inner.device, inner.rank, inner.world_size
        self.device_ops = inner.device_ops
        self.jobs: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self) -> None:
        while True:
            fn, job, label = self.jobs.get()
            try:
                fn()
                self.log.append((label, time.monotonic()))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                job.error = exc
            job.done.set()

    def _submit(self, fn: Callable[[], None], async_op: bool):
        job = _Job()
        self.jobs.put((fn, job, getattr(_LABEL, "name", "?")))
        if async_op:
            return job
        job.wait()
        return None

    def stall(self, seconds: float) -> None:
        """Queue a delay: everything issued on this transport afterwards waits for it."""
        self.jobs.put((lambda: time.sleep(seconds), _Job(), "stall"))

    def all_to_all(self, recv, send, recv_splits, send_splits, async_op):
        return self._submit(lambda: self.inner.all_to_all(recv, send, recv_splits, send_splits, False), async_op)

    def all_gather(self, out, local):
        self._submit(lambda: self.inner.all_gather(out, local), False)

    def all_reduce(self, value, op=None):
        self._submit(lambda: self.inner.all_reduce(value, op), False)

    def reduce_scatter(self, out, inp):
        self._submit(lambda: self.inner.reduce_scatter(out, inp), False)

    def broadcast(self, value, src):
        self._submit(lambda: self.inner.broadcast(value, src), False)

    def all_gather_object(self, obj):
        return self.inner.all_gather_object(obj)


def _completion_times(rank: int, world: int, separate: bool) -> dict:
    import torch.distributed as dist

    import ds_hecate
    from ds_hecate.comm.collectives import Communicator
    from ds_hecate.comm.backend import build_communicator
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.runtime.hecate import HecateRuntime

    dist.init_process_group("gloo", rank=rank, world_size=world)
    weight_group = dist.new_group(list(range(world))) if separate else None
    comm = build_communicator("torch", dist.group.WORLD, rank, world, torch.device("cpu"), weight_group=weight_group)
    log: List[Tuple[str, float]] = []
    # one queue per communicator the runtime built (as one stream per NCCL communicator)
    fifos: Dict[int, FifoTransport] = {}
    comm.transport, comm.weights = (fifos.setdefault(id(t), FifoTransport(t, log))
                                    for t in (comm.transport, comm.weights))

    all_to_all, reduce_scatter = Communicator.all_to_all, Communicator.start_sparse_reduce_scatter

    def labelled(self, *args, **kwargs):
        _LABEL.name = kwargs.setdefault("collective", "token all-to-all")
        return all_to_all(self, *args, **kwargs)

    def delayed(self, *args, **kwargs):
        self.weights.stall(STALL_S)   # a slow link under SparseReduceScatter
        return reduce_scatter(self, *args, **kwargs)
    setattr(Communicator, "all_to_all", labelled)
    setattr(Communicator, "start_sparse_reduce_scatter", delayed)

    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.ReLU(), nn.Linear(2 * HIDDEN, HIDDEN))
    model = nn.ModuleDict({"moe": ds_hecate.MoE(HIDDEN, expert, num_experts=EXPERTS, k=2, drop_tokens=False)})
    # every rank materializes every expert: SparseReduceScatter has gradients to return on every rank
    rt = HecateRuntime(parse_hecate_section({"enabled": True, "placement": "all", "reshard_interval": 0}), comm,
                       torch.float32, world)
    convert_model(model, rt)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    y, l_aux, _ = model["moe"](x)
    log.clear()
    (y.pow(2).sum() + l_aux).backward()   # spRS issued (delayed), then the token-gradient all-to-alls
    token_grads_done = max(t for label, t in log if label == "token all-to-all")
    rt.flush_reductions()
    reduce_scatter_done = max(t for label, t in log if label == "SparseReduceScatter")
    return {"token_grads_done": token_grads_done, "reduce_scatter_done": reduce_scatter_done,
            "labels": [label for label, _ in log]}


def test_token_gradient_all_to_all_completes_before_a_delayed_reduce_scatter():
    for rank, out in enumerate(run_ranks(2, _completion_times, True)):
        assert "SparseReduceScatter" in out["labels"] and "token all-to-all" in out["labels"], out["labels"]
        lead = out["reduce_scatter_done"] - out["token_grads_done"]
        assert lead > 0.5 * STALL_S, f"rank {rank}: the token-gradient all-to-all waited for SparseReduceScatter " \
                                     f"(finished {lead:.2f} s before it, stall {STALL_S} s)"


def test_control_one_shared_communicator_makes_the_token_all_to_all_wait():
    """The same measurement with weight and token traffic on one communicator: the token-gradient all-to-all
    completes only after the delayed SparseReduceScatter (so the test above can fail)."""
    for rank, out in enumerate(run_ranks(2, _completion_times, False)):
        assert out["token_grads_done"] >= out["reduce_scatter_done"], f"rank {rank}: {out}"
