"""Stages ``nccl_round_trips`` and ``nccl_two_process``.

``round_trips``: on 1 rank with real NCCL, every transport primitive (ragged all-to-all, all-gather, all-reduce,
broadcast, object all-gather) of the torch.distributed transport and of the CuPy transport, then every Hecate
collective over each (count exchange, SparseAllGather, SparseReduceScatter into an accumulator, expert move,
token all-to-all, all-reduce, broadcast, barrier), checked value for value.

``two_process``: two processes, one GPU each, the Communicator over two CuPy transports (tokens and weights, two
NCCL communicators): SparseAllGather and SparseReduceScatter of 8 experts, checked against the owners' values and
timed. It needs 2 GPUs (NCCL refuses two ranks on one device); on one GPU it is skipped and says so.

Dry run: the same code under the GPU stand-in (tests/fake_cupy.py): the torch transport over gloo, the CuPy
transport over the stand-in's NCCL (a loopback on one rank; gloo between the two processes of ``two_process``).
"""
from __future__ import annotations

import tempfile
import time
from typing import Any, Dict, cast

from .common import Context, result, skipped, spawn_ranks


def _init_single(backend: str) -> None:
    import torch.distributed as dist
    if not dist.is_initialized():
        store = tempfile.mktemp(prefix="gpu_check_store_")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


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


def collectives(comm, dev) -> Dict[str, bool]:
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


def round_trips(ctx: Context) -> dict:
    import torch

    from ds_hecate.comm.collectives import Communicator
    from ds_hecate.comm.transport import TorchTransport
    _init_single("gloo" if ctx.dry_run else "nccl")
    out: Dict[str, Any] = {}
    with ctx.stand_in():
        from ds_hecate.comm.gpu.nccl_comm import CupyTransport
        dev = torch.device("cuda", 0)
        cupy = CupyTransport(None, 0, 1, dev, timeout_s=60)
        for name, transport in (("torch", TorchTransport(None, 0, 1, dev)), ("cupy", cupy)):
            try:
                checks = {f"primitive {k}": v for k, v in primitives(transport, dev).items()}
                checks.update({f"collective {k}": v for k, v in
                               collectives(Communicator(None, 0, 1, transport=transport), dev).items()})
                ctx.sync()
            except Exception as exc:  # noqa: BLE001 - reported per transport
                checks = {"error": False}
                out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            out[name] = checks
            out[f"{name}_kernel_use"] = dict(getattr(transport.device_ops, "used", {}))
    failed = [f"{t}: {k}" for t in ("torch", "cupy") for k, ok in out[t].items() if not ok]
    total = sum(len(out[t]) for t in ("torch", "cupy"))
    summary = f"{total - len(failed)}/{total} checks" + (f"; failed: {', '.join(failed[:6])}" if failed else "")
    for t in ("torch", "cupy"):
        if f"{t}_error" in out:
            summary += f"; {t}: {out[t + '_error'][:100]}"
    return result(not failed, summary, **out)


def _worker(rank: int, world: int, store: str, numel: int, dry_run: bool, q) -> None:
    try:
        import torch
        import torch.distributed as dist

        from ds_hecate.comm.collectives import Communicator
        from ds_hecate.comm.gpu.nccl_comm import CupyTransport
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        with Context(dry_run=dry_run).stand_in():   # one device under the stand-in: both ranks' is cuda:0
            index = 0 if dry_run else rank
            torch.cuda.set_device(index)
            dev = torch.device("cuda", index)
            weights_group = dist.new_group(list(range(world)), backend="gloo")
            comm = Communicator(dist.group.WORLD, rank, world,
                                transport=CupyTransport(dist.group.WORLD, rank, world, dev, timeout_s=60),
                                weight_transport=CupyTransport(weights_group, rank, world, dev, timeout_s=60))
            q.put((rank, True, _gather_and_reduce(comm, rank, world, dev, numel)))
    except BaseException as exc:  # noqa: BLE001 - report, never hang
        q.put((rank, False, f"{type(exc).__name__}: {exc}"))


def _gather_and_reduce(comm, rank: int, world: int, dev, numel: int) -> dict:
    """SparseAllGather of 8 experts (every rank materializes all, owners round robin), timed over 3 of 4 runs,
    checked against the owners' values; one SparseReduceScatter of ones, checked (each owner receives world)."""
    import torch
    import torch.distributed as dist

    from ds_hecate.comm.buffers import TensorAccumulator
    from ds_hecate.comm.collectives import CommCounters
    from ds_hecate.planning import Placement
    sync = torch.cuda.synchronize
    experts = 8
    owners = tuple(e % world for e in range(experts))
    placement = Placement(owners, tuple(tuple(range(experts)) for _ in range(world)))  # all everywhere
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(numel, generator=gen) for _ in range(experts)]
    owned = {e: masters[e].to(dev) for e in range(experts) if owners[e] == rank}
    times, gathered = [], None
    for _ in range(4):
        sync()
        dist.barrier()
        start = time.perf_counter()
        gathered = comm.start_sparse_all_gather(placement, owned, numel, torch.bfloat16, CommCounters()).wait()
        sync()
        times.append(time.perf_counter() - start)
    assert gathered is not None
    rows = gathered.flats()
    ok_gather = all(torch.equal(rows[e].cpu(), masters[e].to(torch.bfloat16)) for e in range(experts))
    own = sorted(owned)
    accumulator = torch.zeros(len(own), numel, device=dev)
    grads = torch.ones(len(gathered.experts), numel, device=dev)
    comm.start_sparse_reduce_scatter(placement, gathered.experts, grads[:gathered.owned],
                                     grads[gathered.owned:], torch.float32, CommCounters(),
                                     TensorAccumulator(accumulator))()
    sync()
    ok_reduce = bool(torch.equal(accumulator.cpu(), torch.full((len(own), numel), float(world))))
    moved = sum(1 for e in range(experts) if owners[e] != rank) * numel * 2
    return {"median_s": sorted(times[1:])[1], "bytes_received": moved, "gather_ok": ok_gather,
            "reduce_ok": ok_reduce}


def two_process(ctx: Context, timeout: float = 25.0) -> dict:
    import torch
    gpus = 0 if ctx.dry_run else torch.cuda.device_count()
    if not ctx.dry_run and gpus < 2:
        return skipped(f"{gpus} GPU(s): NCCL refuses two ranks on one device; needs 2 GPUs", gpus=gpus)
    numel = (1 << 12) if ctx.dry_run else ((1 << 20) if ctx.quick else (1 << 22))
    results = spawn_ranks(_worker, 2, (numel, ctx.dry_run), timeout)
    out: Dict[str, Any] = {"gpus": gpus, "numel": numel,
           "transport": "the stand-in's NCCL over gloo (dry run)" if ctx.dry_run else "CuPy+NCCL"}
    bad = [f"rank {r}: {p}" for r, (ok, p) in sorted(results.items()) if not ok]
    if len(results) < 2 or bad:
        why = "; ".join(bad) if bad else f"{len(results)}/2 ranks answered within {timeout:g} s"
        return result(False, why, **out)
    figures = [cast(Dict[str, Any], p) for _, p in results.values()]
    med = max(p["median_s"] for p in figures)
    ok = all(p["gather_ok"] and p["reduce_ok"] for p in figures)
    out.update(spag_median_s=med, bytes_per_rank=figures[0]["bytes_received"],
               gbs_per_rank=figures[0]["bytes_received"] / med / 1e9, ranks=figures)
    return result(ok, f"spAG {out['gbs_per_rank']:.1f} GB/s per rank over {out['transport']}; data "
                      f"{'equal' if ok else 'WRONG'}", **out)
