"""CPU-side checks of the GPU path (issue 7): the CUDA sources compile, the torch reference of every kernel contract
agrees with the code paths it replaces, the kernels ship with the package, and backend selection works (and says
why CuPy is not used) without a GPU. The kernels themselves run in tests/gpu/ (CUDA only)."""
from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple, cast

import pytest
import torch

from ds_hecate.comm.buffers import TensorAccumulator
from ds_hecate.comm.collectives import CommCounters, Communicator
from ds_hecate.config import parse_hecate_section
from ds_hecate.errors import HecateConfigError, HecateError
from ds_hecate.comm.gpu import reference as ref
from ds_hecate.comm.backend import agree_backend
from ds_hecate.comm.gpu.kernels import KERNEL_NAMES, SOURCES, kernel_dir
from ds_hecate.comm.gpu.layout import gather_layout, owned_materialized, reduce_chunk_lists, reduce_layout
from ds_hecate.moe_layer import combine_routes
from ds_hecate.planning import Placement

ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc")


# -- the CUDA sources ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES)
def test_kernel_compiles_with_nvcc(source, arch, tmp_path):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH: the CUDA sources cannot be compiled on this machine")
    out = tmp_path / f"{source}.{arch}.ptx"
    proc = subprocess.run([NVCC, "-ptx", f"-arch={arch}", "-std=c++14", "-Werror", "all-warnings",
                           str(ROOT / "kernels" / source), "-o", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    ptx = out.read_text()
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx))
    missing = set(KERNEL_NAMES[source]) - entries
    assert not missing, f"kernels the loader launches are missing from {source}: {sorted(missing)}"
    # The vectorised variants must really issue 16-byte loads (the bandwidth target depends on them).
    assert re.search(r"ld\.global(\.nc)?\.v4\.(f32|u32)", ptx), "no 16-byte vector load in the PTX"


def test_kernel_sources_found_in_checkout():
    assert kernel_dir() in (ROOT / "kernels", ROOT / "ds_hecate" / "kernels")


def test_kernels_ship_with_the_package(tmp_path):
    """build_py (what pip install . runs) puts kernels/*.cu into ds_hecate/kernels/, where the loader looks."""
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shipped = sorted(p.name for p in (tmp_path / "ds_hecate" / "kernels").glob("*.cu"))
    assert shipped == sorted(SOURCES)
    probe = "from ds_hecate.comm.gpu.kernels import kernel_dir; print(kernel_dir())"
    # the build first; what else the interpreter needs (deepspeed from a wheelhouse on an offline GPU machine) after
    path = os.pathsep.join([str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                              if p and Path(p).resolve() != ROOT])
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(tmp_path / "ds_hecate" / "kernels")


# -- simulated world: the torch Communicator on N in-process ranks --------------------------------------------------
class _LoopComm(Communicator):
    """Communicator whose all_to_all is served from a shared mailbox, so N ranks run in one process: a first pass
    records every rank's sends, a second pass hands each rank what the others sent it."""

    def __init__(self, rank: int, world_size: int, mailbox: Dict, replay: bool) -> None:
        super().__init__(None, rank, world_size)
        self.mailbox, self.replay, self.calls = mailbox, replay, 0

    def all_to_all(self, send, send_splits, recv_splits, async_op=False, collective="token all-to-all", out=None,
                   transport=None):
        key = self.calls
        self.calls += 1
        if not self.replay:
            self.mailbox[(self.rank, key)] = (send.clone(), list(send_splits))
            recv = send.new_zeros((sum(recv_splits),) + tuple(send.shape[1:]))
        else:
            parts = []
            for src in range(self.world_size):
                data, splits = self.mailbox[(src, key)]
                start = sum(splits[:self.rank])
                parts.append(data.narrow(0, start, splits[self.rank]))
            recv = torch.cat(parts)
        if out is not None:   # the weight traffic receives into the caller's buffer
            out.copy_(recv)
            recv = out
        return (recv, None) if async_op else recv


def _simulate(world_size: int, run: Callable[[Communicator], Any]) -> Tuple[List[Any], Dict]:
    mailbox: Dict = {}
    for r in range(world_size):
        run(_LoopComm(r, world_size, mailbox, replay=False))
    return [run(_LoopComm(r, world_size, mailbox, replay=True)) for r in range(world_size)], mailbox


def _random_placement(rng: random.Random, world: int, num_experts: int) -> Placement:
    owners = tuple(rng.randrange(world) for _ in range(num_experts))
    materialized = tuple(tuple(sorted({e for e in range(num_experts) if owners[e] == r}
                                      | {e for e in range(num_experts) if rng.random() < 0.4}))
                         for r in range(world))
    return Placement(owners, materialized)


def _exchange(sends: List[torch.Tensor], counts: List[List[int]], numel: int) -> List[torch.Tensor]:
    """What each rank receives when rank s sends ``counts[s][d]`` chunks of ``sends[s]`` to d, in rank order."""
    world = len(sends)
    out = []
    for dst in range(world):
        parts = []
        for src in range(world):
            start = sum(counts[src][:dst]) * numel
            parts.append(sends[src].narrow(0, start, counts[src][dst] * numel))
        out.append(torch.cat(parts))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_contract_matches_sparse_all_gather(seed, dtype):
    rng = random.Random(seed)
    world, num_experts, numel = rng.choice([2, 3, 4]), rng.choice([3, 8]), rng.choice([5, 16])
    placement = _random_placement(rng, world, num_experts)
    torch.manual_seed(seed)
    masters = torch.randn(num_experts, numel)
    owned = [{e: masters[e].clone() for e in range(num_experts) if placement.owners[e] == r} for r in range(world)]

    def run(comm: Communicator):
        return comm.start_sparse_all_gather(placement, owned[comm.rank], numel, dtype, CommCounters()).wait().flats()
    results, mailbox = _simulate(world, run)

    sends, counts = [], []
    for r in range(world):
        lay = gather_layout(placement, r)
        send = ref.pack_chunks([owned[r][e] for e in lay.send_experts], dtype, numel)
        if placement.num_moved:
            assert torch.equal(send, mailbox[(r, 0)][0]), "pack contract != torch path's send buffer"
        sends.append(send)
        counts.append(lay.send_counts)
    received = _exchange(sends, counts, numel)
    for r in range(world):
        lay = gather_layout(placement, r)
        assert lay.recv_counts == [counts[s][r] for s in range(world)]
        unpacked = [torch.empty(numel, dtype=dtype) for _ in lay.recv_experts]
        ref.unpack_chunks(received[r], unpacked, numel)
        assert sorted(results[r]) == sorted(placement.materialized[r])
        for e, t in zip(lay.recv_experts, unpacked):
            assert torch.equal(t, results[r][e])
            assert torch.equal(t, masters[e].to(dtype))  # and it is the owner's expert


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("compute, wire", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_reduce_contract_matches_sparse_reduce_scatter(seed, compute, wire):
    rng = random.Random(100 + seed)
    world, num_experts, numel = rng.choice([2, 3, 4]), rng.choice([3, 8]), rng.choice([7, 16])
    placement = _random_placement(rng, world, num_experts)
    torch.manual_seed(seed)
    grads = [{e: torch.randn(numel).to(compute) for e in placement.materialized[r]} for r in range(world)]

    def run(comm: Communicator):
        own = owned_materialized(placement, comm.rank)
        experts = own + gather_layout(placement, comm.rank).recv_experts   # the gathered buffer's rows
        rows = torch.stack([grads[comm.rank][e] for e in experts]) if experts else torch.empty(0, numel)
        accumulator = torch.zeros(len(own), numel)
        cast = rows.to(compute)
        comm.start_sparse_reduce_scatter(placement, experts, cast[:len(own)], cast[len(own):], wire, CommCounters(),
                                         TensorAccumulator(accumulator))()
        return dict(zip(own, accumulator.unbind(0)))
    results, _ = _simulate(world, run)

    sends, counts = [], []
    for r in range(world):
        lay = reduce_layout(placement, r)
        sends.append(ref.pack_chunks([grads[r][e] for e in lay.send_experts], wire, numel))
        counts.append(lay.send_counts)
    received = _exchange(sends, counts, numel)
    for r in range(world):
        own = owned_materialized(placement, r)
        totals = ref.reduce_chunks([grads[r][e] for e in own], received[r], reduce_chunk_lists(placement, r), numel)
        assert sorted(results[r]) == own
        for e, total in zip(own, totals):
            assert total.dtype == torch.float32
            assert torch.equal(total, results[r][e]), f"rank {r} expert {e}: reduce contract != torch path"
            # and it is the sum over every copy of the expert's gradient
            every = cast(torch.Tensor, sum(grads[s][e].to(wire if s != r else compute).float() for s in range(world)
                                           if e in placement.materialized[s]))
            assert torch.allclose(total, every, atol=1e-5, rtol=1e-5)


def test_expert_histogram_contract():
    torch.manual_seed(0)
    num_experts = 6
    indices = torch.randint(-1, num_experts + 2, (2, 500))
    counts = ref.expert_histogram(indices, num_experts)
    flat = indices.reshape(-1).tolist()
    assert counts.tolist() == [flat.count(e) for e in range(num_experts)] + [sum(i >= num_experts for i in flat)]
    # the runtime's count: torch.bincount of the valid slots; overflow bin = its out-of-range flag
    valid = indices.reshape(-1)[indices.reshape(-1) >= 0]
    runtime = torch.bincount(valid, minlength=num_experts)
    assert torch.equal(counts[:num_experts], runtime[:num_experts])
    assert bool(counts[num_experts] > 0) == bool(runtime.numel() > num_experts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_and_combine_contracts_match_the_runtime(dtype):
    """permute_rows = the dispatch gather; unpermute_combine = index_copy into slot order + combine_routes."""
    torch.manual_seed(1)
    k, num_tokens, hidden = 2, 37, 12
    x = torch.randn(num_tokens, hidden).to(dtype)
    indices = torch.randint(0, 5, (k, num_tokens))
    indices[0, 3] = indices[1, 8] = -1  # dropped slots
    gates = torch.rand(k, num_tokens)
    flat = indices.reshape(-1)
    valid_slots = torch.nonzero(flat >= 0).squeeze(1)
    send_slots = valid_slots[torch.randperm(valid_slots.numel())]  # any send order
    rows = ref.permute_rows(x, send_slots % num_tokens)
    for i, slot in enumerate(send_slots.tolist()):
        assert torch.equal(rows[i], x[slot % num_tokens])
    y_back = (rows.float() * 1.5 + 0.25).to(dtype)  # stand-in expert output, one row per sent slot
    slots = y_back.new_zeros(flat.numel(), hidden).index_copy(0, send_slots, y_back)  # the runtime's combine
    expected = combine_routes(slots, gates, dtype)
    got = ref.unpermute_combine(y_back, ref.slot_positions(send_slots, flat.numel()), gates)
    assert got.dtype == dtype and torch.equal(got, expected)


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_accumulate_contract_matches_the_device_ops(wire):
    """The in-place sum's contract (the accumulate kernel's) is the torch DeviceOps' arithmetic, bit for bit: an
    expert received from several ranks adds them one at a time in receive order, fp32."""
    from ds_hecate.comm.transport import TORCH_DEVICE_OPS
    torch.manual_seed(3)
    numel, rows = 37, [2, 0, 2, 1, 2, 0, 3, 2]
    recv = (torch.randn(len(rows), numel) * 1e3).to(wire)
    base = torch.randn(4, numel)
    want, got = base.clone(), base.clone()
    TORCH_DEVICE_OPS.accumulate(want, recv, rows)
    ref.accumulate_rows(got, recv, rows)
    assert torch.equal(got, want)
    sequential = base.clone()
    for i, t in enumerate(rows):
        sequential[t] = sequential[t] + recv[i].float()
    assert torch.equal(got, sequential)
    targets, seg_ptr, idx = ref.accumulate_segments(rows)
    assert targets == [2, 0, 1, 3] and seg_ptr == [0, 4, 6, 7, 8]
    assert idx == [0, 2, 4, 7, 1, 5, 3, 6]   # each row's received chunks in receive order


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_contract_matches_the_weighted_unpermute(k, dtype):
    """The combine kernel's contract is the layer call's weighted un-permute (DeepSpeed arithmetic), bit for bit,
    also for k > 2 (fp32 adds in route order), dropped slots included."""
    from ds_hecate.ops.combine import weighted_unpermute
    torch.manual_seed(k)
    num_tokens, hidden = 29, 12
    rows = k * num_tokens - 5
    y = torch.cat([torch.randn(rows, hidden).to(dtype), torch.zeros(1, hidden, dtype=dtype)])   # + the zero row
    pos = torch.randperm(k * num_tokens) % (rows + 1)   # a few slots point at the zero row: dropped
    gates = torch.rand(k, num_tokens)
    want = weighted_unpermute(y, gates, pos.view(k, num_tokens), "deepspeed")
    got = ref.unpermute_combine(y, torch.where(pos == rows, -1, pos), gates)
    assert got.dtype == dtype and torch.equal(got, want)


def _kernel_device_ops():
    sys.path.insert(0, str(ROOT))
    from gpu_fakes import reference_launchers
    from ds_hecate.comm.gpu.device_ops import KernelDeviceOps
    return KernelDeviceOps(reference_launchers())


def test_kernel_device_ops_run_the_kernels_and_match_the_torch_device_ops():
    """KernelDeviceOps (the CuPy transport's) hands CUDA operands to the kernels, whose contracts it gets here (the
    CUDA stand-in), and gives the torch DeviceOps' results bit for bit; what the kernels do not take (float16, a
    strided view, CPU tensors) falls back to the torch statement."""
    from device_shim import cuda_shim
    from ds_hecate.comm.transport import TORCH_DEVICE_OPS
    ops = _kernel_device_ops()
    torch.manual_seed(4)
    with cuda_shim() as shim:
        dev = torch.device("cuda", 0)
        srcs = [torch.randn(50).to(dev) for _ in range(5)]
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got, want = torch.empty(5, 50, dtype=dtype, device=dev), torch.empty(5, 50, dtype=dtype, device=dev)
            ops.pack(srcs, got)
            TORCH_DEVICE_OPS.pack(srcs, want)
            assert torch.equal(got, want)
        strided = torch.randn(50, 2).to(dev)[:, 0]
        ops.pack([strided], torch.empty(1, 50, device=dev))
        rows = [1, 1, 0, 2, 1]
        for wire in (torch.float32, torch.bfloat16, torch.float16):
            recv = torch.randn(5, 50).to(dev).to(wire)
            got, want = torch.zeros(3, 50, device=dev), torch.zeros(3, 50, device=dev)
            ops.accumulate(got, recv, rows)
            TORCH_DEVICE_OPS.accumulate(want, recv, rows)
            assert torch.equal(got, want)
        y = torch.randn(9, 6).to(dev).to(torch.bfloat16)
        pos, gates = torch.tensor([0, 4, -1, 8, 2, 5]).to(dev), torch.rand(2, 3).to(dev)
        assert torch.equal(ops.combine(y, pos, gates), ref.unpermute_combine(y, pos, gates))
        assert not any(r in ("nonzero", "boolean-mask indexing") for r in shim.host_reads)
    assert ops.used == {"pack": 2, "pack:torch": 2, "accumulate": 2, "accumulate:torch": 1, "combine": 1}
    cpu = _kernel_device_ops()
    cpu.pack([torch.zeros(4)], torch.empty(1, 4))
    cpu.accumulate(torch.zeros(1, 4), torch.ones(1, 4), [0])
    cpu.combine(torch.ones(2, 4), torch.tensor([0, 1]), torch.ones(1, 2))
    assert cpu.used == {"pack:torch": 1, "accumulate:torch": 1, "combine:torch": 1}


def test_cupy_transport_device_ops_are_the_kernels():
    from ds_hecate.comm.gpu.device_ops import KernelDeviceOps
    from ds_hecate.comm.gpu.nccl_comm import CupyTransport
    sys.path.insert(0, str(ROOT))
    from gpu_fakes import FakeNccl, ImmediateStreams, LoopbackComm
    transport = CupyTransport(None, 0, 1, torch.device("cuda", 0), comm=LoopbackComm(), streams=ImmediateStreams(),
                              nccl=FakeNccl())
    assert type(transport.device_ops) is KernelDeviceOps and transport.device_ops.launchers.__name__.endswith(
        "comm.gpu.kernels")
    assert transport.device_ops.combine is not None


def test_one_rank_cupy_transport_needs_no_process_group():
    """On one rank the CuPy transport runs without torch.distributed (the NCCL unique id is not broadcast, object
    collectives return the rank's own): the first GPU run failed here, in a pytest process with no group."""
    import torch.distributed as dist
    from ds_hecate.comm.gpu.nccl_comm import CupyTransport
    sys.path.insert(0, str(ROOT))
    from gpu_fakes import FakeNccl, ImmediateStreams, LoopbackComm
    assert not dist.is_initialized()
    transport = CupyTransport(None, 0, 1, torch.device("cuda", 0), comm=LoopbackComm(), streams=ImmediateStreams(),
                              nccl=FakeNccl())
    assert transport.all_gather_object({"rank": 0}) == [{"rank": 0}]


def test_training_through_the_cupy_transport_runs_its_kernels_and_matches_torch():
    """A 1-rank training run over the CuPy transport (fakes for NCCL, the kernels' contracts for the kernels, the
    CUDA stand-in): the layer call's combine goes through the transport's device ops, and the losses are the torch
    transport's. Nothing is packed: fp32 compute, so the masters are the resident weights the call computes from
    (a bf16 run's refresh after each step packs through the same device op)."""
    sys.path.insert(0, str(ROOT))
    from gpu_training import demo_losses
    from device_shim import cuda_shim
    with cuda_shim():
        torch_run = demo_losses("cuda", 2, "torch")
        cupy_run = demo_losses("cuda", 2, "cupy-fake")
    assert cupy_run[0] == torch_run[0] and cupy_run[1] == torch_run[1]
    assert cupy_run[2].get("pack", 0) == 0 and cupy_run[2].get("combine", 0) >= 2, cupy_run[2]


# -- backend selection ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,unknown", [("comm_backend", "nccl"), ("device_kernels", "triton")])
def test_backend_config_keys(key, unknown):
    """The config takes the names the registry defines (ds_hecate.comm.backend), and those are these three."""
    from typing import get_args

    from ds_hecate.comm import backend
    from ds_hecate.config import HecateConfig
    registry = {"comm_backend": backend.COMM_BACKENDS, "device_kernels": backend.DEVICE_KERNELS}[key]
    assert get_args(HecateConfig.model_fields[key].annotation) == registry == ("auto", "torch", "cupy")
    assert getattr(parse_hecate_section({}), key) == "auto"
    for value in ("auto", "torch", "cupy"):
        assert getattr(parse_hecate_section({key: value}), key) == value
    with pytest.raises(HecateConfigError, match=key):
        parse_hecate_section({key: unknown})


def test_device_work_follows_device_kernels(monkeypatch):
    """``hecate.device_kernels``: on CUDA where the kernels compile, ``auto`` gives the token and the weight transport
    the kernels as their device work (over torch.distributed too: the kernels need no NCCL); ``torch`` keeps torch
    ops; ``cupy`` refuses, naming the key and the reason, where they cannot run; on the CPU, torch ops."""
    from ds_hecate.comm import backend as choice
    from ds_hecate.comm.gpu import backend
    from ds_hecate.comm.gpu.device_ops import KernelDeviceOps
    from ds_hecate.comm.transport import TORCH_DEVICE_OPS
    cuda, weights = torch.device("cuda", 0), object()

    def ops(kernels, device=cuda):
        comm = choice.build_communicator("torch", None, 0, 1, device, weight_group=weights, device_kernels=kernels)
        assert comm.separate_weight_traffic and comm.weights.device_ops is comm.transport.device_ops
        return comm.transport.device_ops

    assert ops("auto", torch.device("cpu")) is TORCH_DEVICE_OPS
    reason = choice.agree_device_ops("auto", torch.device("cpu"), None, 1)[1]
    assert reason is not None and reason.endswith("not CUDA")
    monkeypatch.setattr(backend, "kernels_status", lambda index: (True, "cupy (stand-in), kernels compiled"))
    assert type(ops("auto")) is KernelDeviceOps and type(ops("cupy")) is KernelDeviceOps
    assert ops("torch") is TORCH_DEVICE_OPS
    monkeypatch.setattr(backend, "kernels_status", lambda index: (False, "the CUDA kernels did not compile (x)"))
    assert ops("auto") is TORCH_DEVICE_OPS
    with pytest.raises(HecateConfigError, match=r"device_kernels='cupy' but the CUDA kernels cannot run \(rank 0: "
                                                r"the CUDA kernels did not compile"):
        ops("cupy")
    with pytest.raises(HecateConfigError, match="device_kernels='triton'"):
        choice.agree_device_ops("triton", cuda, None, 1)


def test_training_over_torch_distributed_runs_the_kernels_where_chosen(monkeypatch):
    """The default on CUDA (``device_kernels: auto`` where the kernels compile) runs the layer call's combine
    through the kernels over the torch transport too (their contracts here, under the CUDA stand-in), with the
    losses and routing of torch ops alone (no pack: fp32 masters are the resident weights the call computes from)."""
    sys.path.insert(0, str(ROOT))
    from gpu_fakes import reference_launchers
    from gpu_training import demo_losses
    from device_shim import cuda_shim
    from ds_hecate.comm import backend
    from ds_hecate.comm.gpu import device_ops
    # the kernels chosen as on a GPU (the stand-in's own probe says they cannot take its tensors), run as their
    # contracts
    choose = backend.agree_device_ops
    monkeypatch.setattr(backend, "agree_device_ops", lambda requested, *a: (
        ("cupy", None) if requested == "auto" else choose(requested, *a)))
    monkeypatch.setattr(device_ops, "_kernels", reference_launchers())
    with cuda_shim():
        kernels = demo_losses("cuda", 2, "torch")
        torch_ops = demo_losses("cuda", 2, "torch", "torch")
    assert kernels[0] == torch_ops[0] and kernels[1] == torch_ops[1]
    assert kernels[2].get("pack", 0) == 0 and kernels[2].get("combine", 0) >= 2, kernels[2]
    assert torch_ops[2] == {}


def resolve_backend(requested, device):
    return agree_backend(requested, device, None, 1)


def test_backend_resolution_on_cpu():
    assert resolve_backend("torch", torch.device("cpu")) == ("torch", None)
    backend, why = resolve_backend("auto", torch.device("cpu"))
    assert backend == "torch" and "not CUDA" in why
    with pytest.raises(HecateConfigError, match=r"comm_backend='cupy' but the CuPy\+NCCL transport cannot be used"):
        resolve_backend("cupy", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_cuda_device_without_gpu_names_the_reason():
    """A CUDA device where CuPy cannot run: 'auto' uses torch.distributed (CuPy is opt-in until a GPU check has
    passed), 'cupy' refuses and names the rank and the reason."""
    backend, why = resolve_backend("auto", torch.device("cuda", 0))
    assert backend == "torch" and "has not passed a GPU check" in why
    with pytest.raises(HecateConfigError, match="cannot be used \\(rank 0: "):
        resolve_backend("cupy", torch.device("cuda", 0))


def test_cupy_backend_refuses_a_cpu_device():
    from ds_hecate.comm.gpu.nccl_comm import CupyTransport
    with pytest.raises(HecateError, match="needs a CUDA device"):
        CupyTransport(None, 0, 1, torch.device("cpu"))


_BUILD_RUNTIME = """
import os, tempfile, torch, torch.distributed as dist
import ds_hecate
from ds_hecate.comm.collectives import Communicator
from ds_hecate.config import parse_hecate_section
from ds_hecate.deepspeed_glue.initialize import build_runtime
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
runtime = build_runtime(parse_hecate_section({"enabled": True}), {})
assert type(runtime.comm) is Communicator, type(runtime.comm)
assert runtime.comm.exchange_counts(torch.tensor([3, 4])).tolist() == [[3, 4]]
print("OK")
"""


def test_build_runtime_uses_torch_backend_and_logs_why_once():
    """With no GPU (CuPy installed or not) Hecate runs on torch.distributed and says why in exactly one line."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_HECATE_LOG_LEVEL": "INFO"}
    proc = subprocess.run([sys.executable, "-c", _BUILD_RUNTIME], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "CuPy" in line]
    assert len(lines) == 1, proc.stderr
    installed = importlib.util.find_spec("cupy") is not None
    assert lines[0].startswith("[ds_hecate] communication backend: torch.distributed; CuPy+NCCL not used: ")
    assert f"cupy is {'installed' if installed else 'not installed'}" in lines[0]


def test_cupy_backend_imports_without_gpu():
    """CuPy installed, no GPU: the GPU modules import and the probe explains itself instead of failing."""
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy is not installed")
    probe = ("import ds_hecate.comm.gpu.kernels, ds_hecate.comm.gpu.nccl_comm\n"
             "from ds_hecate.comm.gpu import cupy_status\n"
             "usable, why = cupy_status(); print(usable); print(why)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    usable, why = proc.stdout.strip().splitlines()[-2:]
    if not torch.cuda.is_available():
        assert usable == "False" and why.startswith("cupy ") and "installed but" in why
