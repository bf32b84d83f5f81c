"""The CuPy+NCCL backend against the torch backend on the same inputs.

1. One GPU, several simulated ranks: the one Communicator with CUDA tensors, the CUDA kernels as its device ops
   (:class:`KernelDeviceOps`: pack, the owners' in-place sum) and an in-process loopback in place of NCCL, must give
   bit-for-bit the CPU Communicator's results (simulated the same way on the same inputs).
2. One GPU, one rank, real NCCL (through CuPy, and torch.distributed's): every primitive and every Hecate
   collective (the stream handling: test_gpu_streams.py).
3. Two processes with real NCCL (needs two GPUs: NCCL refuses two ranks on one device): every collective over the
   CuPy transport against the torch.distributed (gloo) backend on the same inputs.

Without a GPU (conftest.py) all of it runs under the GPU stand-in: the kernels check their launches and compute
their contracts, NCCL is a loopback on one rank and gloo between the two processes of 3, and the device is never
behind the host.
"""
import os
import random
import sys
from typing import Any, Callable, ContextManager, Dict, List, Tuple, Union

import numpy as np
import pytest
import torch

from ds_hecate.comm.buffers import TensorAccumulator
from ds_hecate.comm.collectives import CommCounters, Communicator
from ds_hecate.comm.gpu.device_ops import KernelDeviceOps
from ds_hecate.comm.gpu.layout import gather_layout, owned_materialized
from ds_hecate.comm.gpu.nccl_comm import CupyTransport
from ds_hecate.planning import Placement

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
DEV = torch.device("cuda", 0)


class Loopback:
    """In-process ranks on one GPU for the one Communicator: each rank's transport posts its all-to-all buffers;
    :meth:`flush` moves the data (in place of NCCL). Their device ops are the CUDA kernels."""

    def __init__(self):
        self.posts = {}
        self.ops = KernelDeviceOps()

    def view(self, rank, world):
        shared = self

        class _Transport:
            device, calls, device_ops = DEV, 0, shared.ops
            rank: int
            world_size: int

            def all_to_all(self, recv, send, recv_splits, send_splits, async_op):
                self.calls += 1
                shared.posts[(rank, self.calls)] = (recv, send, list(recv_splits), list(send_splits))
                return None
        t = _Transport()
        t.rank, t.world_size = rank, world
        return t

    def flush(self):
        for (rank, n), (recv, _, recv_splits, _) in self.posts.items():
            world = len(recv_splits)
            offset = 0
            for src in range(world):
                _, send, _, send_splits = self.posts[(src, n)]
                start = sum(send_splits[:rank])
                recv.view(-1).narrow(0, offset * _row(recv), recv_splits[src] * _row(recv)).copy_(
                    send.reshape(-1).narrow(0, start * _row(send), send_splits[rank] * _row(send)))
                offset += recv_splits[src]
        torch.cuda.synchronize()
        self.posts.clear()


def _row(t):
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


class TorchLoop(Communicator):
    """The torch Communicator on simulated ranks (CPU), mailbox-driven, as in tests/test_kernels.py."""

    def __init__(self, rank, world, mailbox, replay):
        super().__init__(None, rank, world)
        self.mailbox, self.replay, self.n = mailbox, replay, 0

    def all_to_all(self, send, send_splits, recv_splits, async_op=False, collective="token all-to-all", out=None,
                   transport=None):
        self.n += 1
        if not self.replay:
            self.mailbox[(self.rank, self.n)] = (send.clone(), list(send_splits))
            recv = send.new_zeros((sum(recv_splits),) + tuple(send.shape[1:]))
        else:
            parts = [d.narrow(0, sum(s[:self.rank]), s[self.rank])
                     for d, s in (self.mailbox[(src, self.n)] for src in range(self.world_size))]
            recv = torch.cat(parts)
        if out is not None:
            out.copy_(recv)
            recv = out
        return (recv, None) if async_op else recv


def torch_world(world: int, run: Callable[[Communicator], Any]) -> List[Any]:
    mailbox: Dict[Any, Any] = {}
    for r in range(world):
        run(TorchLoop(r, world, mailbox, False))
    return [run(TorchLoop(r, world, mailbox, True)) for r in range(world)]


def cupy_world(world: int, start: Callable[[Communicator], Callable[[], Any]]) -> Tuple[List[Any], Dict[str, int]]:
    loop = Loopback()
    comms = [Communicator(None, r, world, transport=loop.view(r, world)) for r in range(world)]
    finishes = [start(c) for c in comms]
    loop.flush()
    results = [f() for f in finishes]
    torch.cuda.synchronize()
    return results, loop.ops.used


def placement(seed, world, num_experts):
    rng = random.Random(seed)
    owners = tuple(rng.randrange(world) for _ in range(num_experts))
    mat = tuple(tuple(sorted({e for e in range(num_experts) if owners[e] == r or rng.random() < 0.5}))
                for r in range(world))
    return Placement(owners, mat)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_all_gather_matches_torch_backend(seed, dtype):
    world, num_experts, numel = 4, 8, 10000 + seed
    p = placement(seed, world, num_experts)
    masters = torch.randn(num_experts, numel)
    owned = [{e: masters[e].clone() for e in range(num_experts) if p.owners[e] == r} for r in range(world)]
    want = torch_world(world, lambda c: c.start_sparse_all_gather(p, owned[c.rank], numel, dtype,
                                                                  CommCounters()).wait().flats())
    got, used = cupy_world(world, lambda c: (lambda pending: lambda: pending.wait().flats())(
        c.start_sparse_all_gather(p, {e: t.to(DEV) for e, t in owned[c.rank].items()}, numel, dtype,
                                  CommCounters())))
    assert used.get("pack", 0) > 0 and "pack:torch" not in used, used
    for r in range(world):
        assert sorted(got[r]) == sorted(want[r])
        for e in want[r]:
            assert torch.equal(got[r][e].cpu(), want[r][e])


def _reduce_scatter(c: Communicator, p: Placement, grads: List[Dict[int, torch.Tensor]], numel: int,
                    wire: torch.dtype, device: Union[str, torch.device]) -> Callable[[], Dict[int, torch.Tensor]]:
    """Start the SparseReduceScatter of rank ``c.rank``'s gathered-buffer gradient; returns a function giving the
    owner's accumulator rows (expert -> fp32 row) once done."""
    own = owned_materialized(p, c.rank)
    experts = own + gather_layout(p, c.rank).recv_experts
    rows = (torch.stack([grads[c.rank][e] for e in experts]) if experts else torch.empty(0, numel)).to(device)
    accumulator = torch.zeros(len(own), numel, device=device)
    finish = c.start_sparse_reduce_scatter(p, experts, rows[:len(own)], rows[len(own):], wire, CommCounters(),
                                           TensorAccumulator(accumulator))

    def done():
        finish()
        return dict(zip(own, accumulator.unbind(0)))
    return done


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("compute, wire", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.bfloat16)])
def test_sparse_reduce_scatter_matches_torch_backend(seed, compute, wire):
    world, num_experts, numel = 3, 6, 4099 + 4 * seed
    p = placement(10 + seed, world, num_experts)
    grads = [{e: torch.randn(numel).to(compute) for e in p.materialized[r]} for r in range(world)]
    want = torch_world(world, lambda c: _reduce_scatter(c, p, grads, numel, wire, torch.device("cpu"))())
    got, used = cupy_world(world, lambda c: _reduce_scatter(c, p, grads, numel, wire, DEV))
    assert used.get("accumulate", 0) > 0 and "accumulate:torch" not in used, used
    for r in range(world):
        assert sorted(got[r]) == sorted(want[r])
        for e in want[r]:
            assert torch.equal(got[r][e].cpu(), want[r][e])


def test_token_all_to_all_matches_torch_backend():
    world, hidden = 3, 96
    splits = [[random.Random(s * 7 + d).randrange(0, 50) for d in range(world)] for s in range(world)]
    xs = [torch.randn(sum(splits[s]), hidden) for s in range(world)]
    recv_splits = [[splits[s][r] for s in range(world)] for r in range(world)]
    want = torch_world(world, lambda c: c.all_to_all(xs[c.rank], splits[c.rank], recv_splits[c.rank]))
    got, _ = cupy_world(world, lambda c: (lambda out: (lambda: out))(
        c.all_to_all(xs[c.rank].to(DEV), splits[c.rank], recv_splits[c.rank], async_op=True)[0]))
    for r in range(world):
        assert torch.equal(got[r].cpu(), want[r])


# -- real NCCL, one rank ---------------------------------------------------------------------------------------------
def primitives(transport, dev) -> Dict[str, bool]:
    """Every primitive of ``transport`` on 1 rank, checked."""
    import torch
    import torch.distributed as dist
    checks = {}
    x = torch.arange(12, dtype=torch.float32, device=dev).reshape(6, 2)
    recv = torch.empty_like(x)
    work = transport.all_to_all(recv, x, [6], [6], True)
    if work is not None:
        work.wait()
    checks["all_to_all"] = bool(torch.equal(recv, x))
    gathered = torch.empty(3, dtype=torch.int64, device=dev)
    transport.all_gather(gathered, torch.tensor([1, 2, 3], device=dev))
    checks["all_gather"] = gathered.tolist() == [1, 2, 3]
    v = torch.tensor([2.5, -1.0], device=dev)
    transport.all_reduce(v, dist.ReduceOp.SUM)
    transport.all_reduce(v, dist.ReduceOp.MAX)
    checks["all_reduce"] = v.tolist() == [2.5, -1.0]
    transport.broadcast(v, 0)
    checks["broadcast"] = v.tolist() == [2.5, -1.0]
    checks["all_gather_object"] = transport.all_gather_object({"rank": 0}) == [{"rank": 0}]
    return checks


def collectives(comm: Communicator, dev: torch.device) -> Dict[str, bool]:
    """Every Hecate collective over ``comm`` on 1 rank, checked (the owned experts go through the device ops)."""
    import torch

    from ds_hecate.comm.buffers import TensorAccumulator
    from ds_hecate.comm.collectives import CommCounters
    from ds_hecate.planning import Placement
    checks = {}
    counts = torch.tensor([3, 0, 5, 1], device=dev)
    checks["count_exchange"] = comm.exchange_counts(counts).tolist() == [[3, 0, 5, 1]]
    numel, experts = 1000, 4
    placement = Placement((0,) * experts, (tuple(range(experts)),))
    masters = {e: torch.randn(numel).to(dev) for e in range(experts)}
    gathered = comm.start_sparse_all_gather(placement, masters, numel, torch.bfloat16, CommCounters()).wait()
    checks["sparse_all_gather"] = (gathered.experts == tuple(range(experts)) and all(
        torch.equal(gathered.flats()[e], masters[e].to(torch.bfloat16)) for e in range(experts)))
    grads = torch.randn(experts, numel).to(dev)
    accumulator = torch.ones(experts, numel, device=dev)
    comm.start_sparse_reduce_scatter(placement, gathered.experts, grads[:gathered.owned], grads[gathered.owned:],
                                     torch.float32, CommCounters(), TensorAccumulator(accumulator))()
    checks["sparse_reduce_scatter"] = bool(torch.equal(accumulator, grads + 1))
    moved = comm.move_experts([0] * experts, [0] * experts, masters, numel)
    checks["expert_move"] = all(torch.equal(moved[e], masters[e]) for e in range(experts))
    tokens = torch.randn(9, 16, device=dev)
    checks["token_all_to_all"] = bool(torch.equal(comm.all_to_all(tokens, [9], [9]), tokens))
    value = torch.tensor([4.0], device=dev)
    checks["all_reduce"] = comm.all_reduce(value).tolist() == [4.0]
    checks["broadcast"] = comm.broadcast(value).tolist() == [4.0]
    comm.barrier()
    checks["barrier"] = True
    return checks


@pytest.mark.parametrize("transport_name", ["cupy", "torch"])
def test_one_rank_primitives_and_collectives(one_rank_group, transport_name):
    """Every primitive of the transport and every Hecate collective over it, on one rank with real NCCL (the CuPy
    transport's own communicator; torch.distributed's NCCL group); under the stand-in a loopback and gloo."""
    from ds_hecate.comm.transport import TorchTransport
    transport = (CupyTransport(None, 0, 1, DEV, timeout_s=60) if transport_name == "cupy"
                 else TorchTransport(None, 0, 1, DEV))
    checks = primitives(transport, DEV)
    checks.update(collectives(Communicator(None, 0, 1, transport=transport), DEV))
    torch.cuda.synchronize()
    assert all(checks.values()), checks
    assert getattr(transport, "failure", None) is None and not getattr(transport, "aborted", False)


# -- real NCCL, two processes --------------------------------------------------------------------------------------
def _nccl_ranks(rank, world, stand_in):
    """Every collective over torch.distributed (gloo, CPU tensors) and over the CuPy transport (CUDA tensors; under
    the GPU stand-in on a machine without a GPU), on the same inputs; which ones agree."""
    import contextlib

    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch_comm = Communicator(dist.group.WORLD, rank, world)
    want = _collectives(torch_comm, rank, world, torch.device("cpu"))
    context: ContextManager[Any] = contextlib.nullcontext()
    if stand_in:
        from fake_cupy import gpu_stand_in
        context = gpu_stand_in()
    with context:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
        weights_group = dist.new_group(list(range(world)), backend="gloo")
        cupy_comm = Communicator(dist.group.WORLD, rank, world,
                                 transport=CupyTransport(dist.group.WORLD, rank, world, dev, timeout_s=120),
                                 weight_transport=CupyTransport(weights_group, rank, world, dev, timeout_s=120))
        got = _collectives(cupy_comm, rank, world, dev)
        torch.cuda.synchronize()
    checks = {}
    for name, a in want.items():
        b = got[name]
        if isinstance(a, dict):
            checks[name] = sorted(a) == sorted(b) and all(torch.equal(a[e], b[e].cpu()) for e in a)
        elif isinstance(a, torch.Tensor):
            checks[name] = torch.equal(a, b.cpu())
        else:
            checks[name] = bool(np.array_equal(a, b))
    return checks


def _collectives(comm: Communicator, rank: int, world: int, dev: torch.device) -> Dict[str, Any]:
    """What every Hecate collective over ``comm`` returns on this rank, on inputs made on the CPU from seed 0."""
    torch.manual_seed(0)
    num_experts, numel = 8, 20011
    p = placement(3, world, num_experts)
    masters = torch.randn(num_experts, numel)
    owned = {e: masters[e].clone().to(dev) for e in range(num_experts) if p.owners[e] == rank}
    out: Dict[str, Any] = {
        "all_gather": comm.start_sparse_all_gather(p, owned, numel, torch.bfloat16, CommCounters()).wait().flats()}
    grads = [{e: torch.randn(numel) for e in p.materialized[r]} for r in range(world)]
    out["reduce_scatter"] = _reduce_scatter(comm, p, grads, numel, torch.float32, dev)()
    out["counts"] = comm.exchange_counts((torch.arange(5) * (rank + 1)).to(dev))
    out["all_reduce"] = comm.all_reduce(torch.tensor([1.5 * (rank + 1)]).to(dev))
    sends = [3 + rank, 5 - rank]
    recv = [3 + r if rank == 0 else 5 - r for r in range(world)] if world == 2 else sends   # one rank: its own
    out["all_to_all"] = comm.all_to_all(torch.randn(sum(sends), 64).to(dev), sends, recv)
    sources, targets = [0, 0, 1, 1, 0], [1, 0, 0, 1, 1]
    local = {e: masters[e].clone().to(dev) for e, s in enumerate(sources) if s == rank}
    out["move_experts"] = comm.move_experts(sources, targets, local, numel)
    return out


def test_two_process_nccl_matches_torch_backend(gpu):
    if gpu.real and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: NCCL refuses two ranks on one device")
    from dist_utils import run_ranks
    for checks in run_ranks(2, _nccl_ranks, not gpu.real, timeout=180):
        assert all(checks.values()), checks
