"""One-GPU check of ds_hecate's GPU path (issue 7), in well under 5 minutes:

1. the GPU tests (tests/gpu/) and the CPU-side kernel checks (tests/test_kernels.py);
2. micro-benchmarks: the device's memory bandwidth (nominal from its attributes, and a torch device-to-device
   copy), each kernel's effective bandwidth (bytes read + written / time) against it, and against the torch ops it
   replaces (torch.cat / index_select / bincount / the torch combine);
3. a 2-process NCCL sparse collective through CuPy (one rank per GPU; on a single GPU it is attempted, and NCCL's
   answer is recorded: NCCL normally refuses two ranks on one device).

4. (issue 15) the demo model trained 20 steps on 1 rank on CUDA and on the CPU (fp32 losses within 1e-4
   relative), a 1-rank real NCCL round trip of every transport primitive (torch.distributed and CuPy), a
   stream-ordering check whose communication input is delayed on purpose (and its ablation without the event wait,
   which must fail), and ``compute-sanitizer --tool memcheck`` on the kernel tests when the tool is present.

Usage: python benchmarks/gpu_check.py [--out gpu_check.json] [--dry-run]   (``make gpu-check``)
Writes every figure to --out (one JSON file); exit status 0 only if every check passed. ``--dry-run`` checks the
script itself on a CPU (CI).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_tests(timeout: float) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "tests/gpu", "tests/test_kernels.py"],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        return {"returncode": proc.returncode, "seconds": round(time.perf_counter() - start, 1), "tail": tail}
    except subprocess.TimeoutExpired:
        return {"returncode": None, "seconds": timeout, "tail": [f"timed out after {timeout} s"]}


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, CUDA events, after one warm-up."""
    import torch
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def nominal_bandwidth_gbs() -> float:
    import cupy
    rt = cupy.cuda.runtime
    dev = cupy.cuda.Device().id
    clock_khz = rt.deviceGetAttribute(rt.cudaDevAttrMemoryClockRate, dev)
    bus_bits = rt.deviceGetAttribute(rt.cudaDevAttrGlobalMemoryBusWidth, dev)
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def micro_benchmarks(quick: bool) -> list:
    import torch

    from ds_hecate.comm.gpu import kernels as K
    from ds_hecate.comm.gpu import reference as ref

    dev = torch.device("cuda", 0)
    repeat = 5 if quick else 20
    rows = []

    def add(name, nbytes, t_kernel, t_torch, torch_op):
        rows.append({"op": name, "bytes": nbytes, "kernel_s": t_kernel, "kernel_gbs": nbytes / t_kernel / 1e9,
                     "torch_op": torch_op, "torch_s": t_torch,
                     "torch_gbs": nbytes / t_torch / 1e9 if t_torch else None})

    n_chunks, numel = (16, 1 << 22) if quick else (64, 1 << 22)  # 64 x 16 MiB fp32 = 1 GiB
    src = torch.randn(n_chunks, numel, device=dev)
    chunks = list(src.unbind(0))
    big = torch.empty(n_chunks * numel, device=dev)
    t_copy = timed(lambda: big.copy_(src.view(-1)), repeat)
    rows.append({"op": "torch copy (device memory baseline)", "bytes": 2 * src.numel() * 4, "kernel_s": t_copy,
                 "kernel_gbs": 2 * src.numel() * 4 / t_copy / 1e9})
    nbytes = 2 * n_chunks * numel * 4
    add("pack fp32->fp32", nbytes, timed(lambda: K.pack_chunks(chunks, big, numel), repeat),
        timed(lambda: torch.cat(chunks), repeat), "torch.cat")
    half = torch.empty(n_chunks * numel, dtype=torch.bfloat16, device=dev)
    add("pack fp32->bf16", n_chunks * numel * 6, timed(lambda: K.pack_chunks(chunks, half, numel), repeat),
        timed(lambda: torch.cat([c.to(torch.bfloat16) for c in chunks]), repeat), "torch.cat of .to(bf16)")
    outs = [torch.empty(numel, device=dev) for _ in range(n_chunks)]
    add("unpack fp32->fp32", nbytes, timed(lambda: K.unpack_chunks(big, outs, numel), repeat),
        timed(lambda: [o.copy_(big.narrow(0, i * numel, numel)) for i, o in enumerate(outs)], repeat),
        "per-chunk copy_")
    n_out = n_chunks // 4
    lists = [[3 * j + i for i in range(3)] for j in range(n_out)]
    recv = big.narrow(0, 0, 3 * n_out * numel)
    add("reduce fp32 (own + 3 received)", n_out * numel * 4 * 5,
        timed(lambda: K.reduce_chunks(chunks[:n_out], recv, lists, numel), repeat),
        timed(lambda: ref.reduce_chunks(chunks[:n_out], recv, lists, numel), repeat), "reference (torch adds)")
    src = chunks = big = half = outs = None  # free the device memory before the token benchmarks

    tokens, hidden = (1 << 15, 4096) if quick else (1 << 17, 4096)
    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    index = torch.randperm(tokens, device=dev)
    nbytes = 2 * x.numel() * 2
    add("permute rows bf16", nbytes, timed(lambda: K.permute_rows(x, index), repeat),
        timed(lambda: x.index_select(0, index), repeat), "index_select")
    k = 2
    y = x.repeat(k, 1)
    pos = torch.randperm(k * tokens, device=dev)
    gates = torch.rand(k, tokens, device=dev)
    nbytes = (k + 1) * tokens * hidden * 2
    add("unpermute+combine bf16 k=2", nbytes, timed(lambda: K.unpermute_combine(y, pos, gates), repeat),
        timed(lambda: ref.unpermute_combine(y, pos, gates), repeat), "index_copy + combine_routes")
    idx = torch.randint(0, 64, (2, 1 << 22), device=dev)
    add("expert histogram (64 experts)", idx.numel() * 8, timed(lambda: K.expert_histogram(idx, 64), repeat),
        timed(lambda: torch.bincount(idx.view(-1), minlength=64), repeat), "torch.bincount")
    return rows


def _nccl_worker(rank: int, world: int, port: int, numel: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        from ds_hecate.comm.collectives import CommCounters
        from ds_hecate.comm.gpu.nccl_comm import CupyNcclCommunicator
        from ds_hecate.planning import Placement
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
        comm = CupyNcclCommunicator(dist.group.WORLD, rank, world, dev)
        experts = 8
        owners = tuple(e % world for e in range(experts))
        placement = Placement(owners, tuple(tuple(range(experts)) for _ in range(world)))  # everyone gets all
        owned = {e: torch.randn(numel, device=dev) for e in range(experts) if owners[e] == rank}
        times = []
        for i in range(6):
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            comm.start_sparse_all_gather(placement, owned, numel, torch.bfloat16, CommCounters()).wait()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        moved = sum(1 for e in range(experts) if owners[e] != rank) * numel * 2
        q.put((rank, True, {"median_s": sorted(times[1:])[2], "bytes_received": moved}))
    except BaseException as exc:  # report, never hang
        q.put((rank, False, f"{type(exc).__name__}: {exc}"))


def nccl_two_process(numel: int, timeout: float = 120.0) -> dict:
    import socket

    import torch
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_nccl_worker, args=(r, 2, port, numel, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                rank, ok, payload = q.get(timeout=1.0)
                results[rank] = (ok, payload)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    gpus = torch.cuda.device_count()
    out = {"gpus": gpus, "layout": "one rank per GPU" if gpus >= 2 else "both ranks on GPU 0"}
    if len(results) < 2 or not all(ok for ok, _ in results.values()):
        out["result"] = "failed: " + "; ".join(f"rank {r}: {p}" for r, (ok, p) in sorted(results.items()) if not ok) \
            if results else "failed: no result (timeout or crash)"
        return out
    med = max(p["median_s"] for _, p in results.values())
    out.update(result="ok", spag_median_s=med, bytes_per_rank=results[0][1]["bytes_received"],
               gbs_per_rank=results[0][1]["bytes_received"] / med / 1e9)
    return out


# -- issue 15: training CUDA vs CPU, NCCL round trips, stream ordering, memcheck ---------------------------------
def demo_losses(device: str, steps: int) -> list:
    """Losses of a small ds_hecate.MoE model trained ``steps`` steps on 1 rank on ``device`` (Hecate runtime with
    its expert optimizer, as the engine drives it)."""
    import torch
    from torch import nn

    import ds_hecate
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.deepspeed_glue.expert_optimizer import ExpertOptimizer, LrSource
    from ds_hecate.comm.gpu import build_communicator
    from ds_hecate.runtime.hecate import HecateRuntime

    torch.manual_seed(0)
    hidden = 64
    expert = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
    model = nn.ModuleDict({"inp": nn.Linear(hidden, hidden),
                           "moe": ds_hecate.MoE(hidden, expert, num_experts=8, k=2, drop_tokens=False)})
    dev = torch.device(device)
    rt = HecateRuntime(parse_hecate_section({"enabled": True}), build_communicator("torch", None, 0, 1, dev),
                       torch.float32, 1)
    convert_model(model, rt)
    model.to(dev)
    dense = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rt.optimizer = ExpertOptimizer(torch.optim.AdamW, [{"params": rt.store.parameters(), "lr": 1e-3}],
                                   [LrSource(dense.param_groups[0])])
    rt.layer_group = {0: 0}
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(1, steps + 1):
        rt.on_model_forward()
        x = torch.randn(256, hidden, generator=gen).to(dev)
        y, l_aux, _ = model["moe"](model["inp"](x))
        loss = (y - x).pow(2).mean() + 0.01 * l_aux
        loss.backward()
        rt.flush_reductions()
        dense.step()
        dense.zero_grad()
        rt.apply_step(True, 1, 1.0, 0.0, rt.optimizer.current_hyperparameters())
        rt.after_step(step)
        losses.append(float(loss.detach()))
    return losses


def compare_training(steps: int) -> dict:
    cpu, cuda = demo_losses("cpu", steps), demo_losses("cuda", steps)
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(cpu, cuda))
    return {"steps": steps, "cpu": cpu, "cuda": cuda, "max_rel_diff": worst, "ok": worst <= 1e-4}


def nccl_round_trips() -> dict:
    """Every transport primitive on 1 rank, for torch.distributed (NCCL) and the CuPy transport, plus every Hecate
    collective over each (the Communicator's own 1-rank paths)."""
    import torch
    import torch.distributed as dist

    from ds_hecate.comm.gpu.nccl_comm import CupyTransport
    from ds_hecate.comm.transport import TorchTransport
    dev = torch.device("cuda", 0)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    out = {}
    for name, transport in (("torch", TorchTransport(None, 0, 1, dev)), ("cupy", CupyTransport(None, 0, 1, dev,
                                                                                               timeout_s=60))):
        checks = {}
        x = torch.arange(12, dtype=torch.float32, device=dev).reshape(6, 2)
        recv = torch.empty_like(x)
        work = transport.all_to_all(recv, x, [6], [6], True)
        if work is not None:
            work.wait()
        checks["all_to_all"] = torch.equal(recv, x)
        gathered = torch.empty(3, dtype=torch.int64, device=dev)
        transport.all_gather(gathered, torch.tensor([1, 2, 3], device=dev))
        checks["all_gather"] = gathered.tolist() == [1, 2, 3]
        v = torch.tensor([2.5], device=dev)
        transport.all_reduce(v, dist.ReduceOp.SUM)
        checks["all_reduce"] = v.item() == 2.5
        transport.broadcast(v, 0)
        checks["broadcast"] = v.item() == 2.5
        out[name] = checks
    return out


def stream_ordering(ablate: bool) -> bool:
    """The CuPy transport must start after the caller's queued work: the send buffer is written by a kernel queued
    behind a long sleep. Returns whether the received data is right (``ablate`` removes the event wait)."""
    import torch

    from ds_hecate.comm.gpu import nccl_comm
    dev = torch.device("cuda", 0)
    transport = nccl_comm.CupyTransport(None, 0, 1, dev, timeout_s=60)
    if ablate:
        def start(tensors, streams=transport.streams):
            return torch.cuda.stream(streams.stream)   # no wait_event: the bug this check must catch
        transport.streams.start = start
    send = torch.zeros(1 << 20, device=dev)
    recv = torch.empty_like(send)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)   # delay the producer on the caller's stream
    send.fill_(7.0)
    transport.all_to_all(recv, send, [send.numel()], [send.numel()], False)
    torch.cuda.synchronize()
    return bool((recv == 7.0).all())


def memcheck(timeout: float) -> dict:
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return {"ran": False, "why": "compute-sanitizer is not on PATH"}
    proc = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-m", "pytest", "-q",
                           "tests/gpu/test_gpu_kernels.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    return {"ran": True, "returncode": proc.returncode, "tail": (proc.stdout + proc.stderr).splitlines()[-10:]}


def dry_run(out: str) -> None:
    """CPU-side check of this script: every step it will run exists, the files it reads are there, and the
    training comparison runs (on the CPU, 2 steps)."""
    for path in ("tests/gpu", "tests/gpu/test_gpu_kernels.py", "tests/gpu/test_gpu_comm.py", "tests/test_kernels.py"):
        if not (ROOT / path).exists():
            sys.exit(f"gpu_check --dry-run: {path} is missing")
    for fn in (run_tests, compare_training, nccl_round_trips, stream_ordering, memcheck, micro_benchmarks):
        assert callable(fn)
    from ds_hecate.comm.gpu.nccl_comm import CupyTransport  # noqa: F401  (imports without CuPy or a GPU)
    losses = demo_losses("cpu", 2)
    report = {"dry_run": True, "cpu_losses": losses, "steps": ["tests/gpu", "training cuda vs cpu (20 steps)",
              "1-rank NCCL round trips", "stream ordering (+ablation)", "compute-sanitizer memcheck",
              "micro-benchmarks"]}
    Path(out).write_text(json.dumps(report, indent=1))
    print(f"gpu_check dry run ok: {len(report['steps'])} steps, demo losses {losses}; wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="check this script on the CPU; no GPU needed")
    args = parser.parse_args()
    if args.dry_run:
        dry_run(args.out)
        return
    t0 = time.perf_counter()
    import torch
    report = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    from ds_hecate.comm.gpu import cupy_status
    report["cupy"] = cupy_status()[1]
    if not torch.cuda.is_available() or not cupy_status()[0]:
        print(json.dumps(report, indent=1))
        sys.exit("gpu_check needs a CUDA build of torch, a GPU and a working CuPy with NCCL "
                 "(pip install 'ds_hecate[gpu]')")
    report["device"] = torch.cuda.get_device_name(0)
    report["nominal_bandwidth_gbs"] = nominal_bandwidth_gbs()
    if not args.skip_tests:
        report["tests"] = run_tests(timeout=150)
        print("\n".join(report["tests"]["tail"]))
    failures = []

    def step(name, fn, *a):
        try:
            report[name] = fn(*a)
        except Exception as exc:  # noqa: BLE001 - every step reports; the exit code says whether all passed
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
            failures.append(name)
        print(f"{name}: {report[name]}")
    step("training_cuda_vs_cpu", compare_training, 20)
    step("nccl_round_trips", nccl_round_trips)
    step("stream_ordering", stream_ordering, False)
    step("stream_ordering_ablated", stream_ordering, True)
    step("memcheck", memcheck, 150)
    from ds_hecate.comm.gpu.kernels import compile_all
    compile_all(0)
    report["micro"] = micro_benchmarks(True)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    ok = (not failures and report.get("tests", {}).get("returncode") in (0, None)
          and report["training_cuda_vs_cpu"].get("ok") and report["stream_ordering"] is True
          and report["stream_ordering_ablated"] is False
          and all(all(c.values()) for c in report["nccl_round_trips"].values())
          and report["memcheck"].get("returncode", 0) == 0)
    report["ok"] = bool(ok)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\ngpu_check {'passed' if ok else 'FAILED'} in {report['seconds']} s; figures in {args.out}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
