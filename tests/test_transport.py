"""The transport layer under Hecate's collectives (issue 15): one implementation of the collectives, the CuPy+NCCL
transport's timeout and stream handling (with stand-ins for NCCL and CUDA events), the transport choice agreed by
all ranks, the working device taken from the local rank, and non-blocking host-to-device tables."""
from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace

import pytest
import torch

from dist_utils import run_ranks


# -- initialize: the working device is the local rank's ---------------------------------------------------------
def test_build_runtime_takes_the_device_of_the_local_rank(monkeypatch):
    """Before DeepSpeed's engine sets the device, the current device is cuda:0 on every rank; Hecate must use
    LOCAL_RANK's device (NCCL refuses two ranks on one GPU)."""
    import deepspeed.accelerator
    import torch.distributed as dist

    import ds_hecate.comm.backend
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.initialize import build_runtime

    class FakeAccelerator:
        current = 0

        def device_name(self, index=None):
            return "cuda" if index is None else f"cuda:{index}"

        def current_device_name(self):
            return f"cuda:{self.current}"

        def set_device(self, index):
            self.current = index

    seen = {}

    def capture(requested, group, rank, world, device, timeout_s=None, weight_group=None, device_kernels="auto",
                one_rank_shortcuts=True):
        seen["device"], seen["device_kernels"] = device, device_kernels
        raise KeyboardInterrupt  # stop before building the runtime

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: FakeAccelerator())
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: None)
    monkeypatch.setattr(ds_hecate.comm.backend, "build_communicator", capture)
    with pytest.raises(KeyboardInterrupt):
        build_runtime(parse_hecate_section({"enabled": True}), {})
    assert seen["device"] == torch.device("cuda", 1)


# -- one forward/step on one rank with a CUDA working device ---------------------------------------------------
def test_single_rank_forward_and_cost_timing_on_a_cuda_device():
    """LayerBinding.run builds its health flags on the working device (no CPU tensor stacked with a CUDA one), and
    the cost model's compute and gap figures come from CUDA events, not host clocks around launches."""
    from test_device_semantics import _train
    out = run_ranks(1, _train_counting_events)[0]
    assert out["master_devices"] == ["cuda:0"] and len(out["losses"]) == 4
    assert out["events"] >= 4 * 2 and out["timing_events"]


def _train_counting_events(rank, world):
    import device_shim
    from test_device_semantics import _train
    device_shim.FakeEvent.created = 0
    out = _train(rank, world, "cuda", "hecate", "fp32", None)
    out["events"] = device_shim.FakeEvent.created
    import ds_hecate.runtime.timing as timing
    out["timing_events"] = "torch.cuda.Event(enable_timing=True)" in inspect.getsource(timing)
    return out


# -- host-to-device tables of the kernels ---------------------------------------------------------------------
def test_kernel_pointer_tables_are_pinned_and_non_blocking():
    from device_shim import cuda_shim
    from ds_hecate.comm.gpu import kernels
    chunks = [torch.zeros(4) for _ in range(3)]
    with cuda_shim() as shim:
        table = kernels._ptr_table(chunks, torch.device("cuda", 0))
    assert table.device.type == "cuda"
    assert shim.copies == [(True, True)], "a pageable or blocking copy on the kernel launch path"


# -- one implementation of the collectives -----------------------------------------------------------------------
def test_cupy_module_holds_only_the_transport():
    import ds_hecate.comm.gpu.nccl_comm as nccl_comm
    from ds_hecate.comm.collectives import Communicator
    source = inspect.getsource(nccl_comm)
    for name in ("start_sparse_all_gather", "start_sparse_reduce_scatter", "move_experts", "exchange_counts",
                 "pack_chunks", "reduce_chunks"):
        assert name not in source, f"ds_hecate/comm/gpu/nccl_comm.py re-implements {name}"
    assert not any(issubclass(obj, Communicator) for obj in vars(nccl_comm).values() if inspect.isclass(obj))
    import ds_hecate.runtime.profiling as profiling
    import ds_hecate.runtime.resharding as resharding
    for module in (profiling, resharding):
        src = inspect.getsource(module)
        assert "comm._" not in src and "dist.broadcast" not in src, f"{module.__name__} bypasses the interface"


class StallingComm:
    """An NCCL communicator whose operations never complete (a dead peer)."""

    def __init__(self):
        self.aborted = False

    def send(self, *a):
        pass

    recv = allGather = allReduce = bcast = send

    def abort(self):
        self.aborted = True


def _fakes():
    import gpu_fakes
    return gpu_fakes


def _stalled(timeout_s, comm=None):
    """A CuPy transport (2 ranks, rank 0) whose collectives never complete, over the CUDA stand-in."""
    from ds_hecate.comm.gpu.nccl_comm import CupyTransport
    fakes = _fakes()
    return CupyTransport(None, 0, 2, torch.device("cuda", 0), timeout_s=timeout_s, comm=comm or StallingComm(),
                         streams=fakes.StalledStreams(), nccl=fakes.FakeNccl())


def _in_thread(body, limit=20):
    """Run ``body`` in a thread; fail if it is still running after ``limit`` s (the transport hung)."""
    result = {}

    def run():
        try:
            result["value"] = body()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), "the CuPy transport waited forever on a stalled collective"
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cupy_transport_timeout_aborts_and_names_the_collective(dtype):
    """A collective that does not complete within collective_timeout_s: the call returns at once (its wait is on
    the stream, not the host), the watchdog aborts the NCCL communicator off the caller's thread, and the next call
    raises HecateCollectiveError naming the collective, the stalled NCCL primitive, the layer and the phase (fp16
    included: no kernel restriction)."""
    import time

    from device_shim import cuda_shim
    from ds_hecate.comm.collectives import Communicator
    from ds_hecate.errors import HecateCollectiveError

    comm_nccl = StallingComm()

    def body():
        with cuda_shim():
            comm = Communicator(None, 0, 2, timeout_s=0.3, transport=_stalled(0.3, comm_nccl))
            x = torch.randn(6, 8).to("cuda").to(dtype)
            with comm.during("dispatch of MoE layer 'blocks.1.moe'"):
                start = time.monotonic()
                comm.all_to_all(x, [3, 3], [3, 3])
                returned_s = time.monotonic() - start
                while not comm_nccl.aborted and time.monotonic() - start < 10:
                    time.sleep(0.01)   # the host does other work; nobody waits on the collective
                aborted_s = time.monotonic() - start
                with pytest.raises(HecateCollectiveError) as info:
                    comm.all_to_all(x, [3, 3], [3, 3])
        return returned_s, aborted_s, str(info.value)
    out = _in_thread(body)
    assert "error" not in out, out.get("error")
    returned_s, aborted_s, message = out["value"]
    assert returned_s < 0.3, f"the synchronous call blocked the host for {returned_s:.2f} s"
    assert comm_nccl.aborted and aborted_s < 3, f"the watchdog aborted after {aborted_s:.2f} s"
    assert "'token all-to-all'" in message and "blocks.1.moe" in message and "dispatch" in message, message
    assert "NCCL all-to-all did not complete within 0.3 s" in message, message
    assert "collective_timeout_s = 0.3 s" in message


def test_cupy_count_exchange_waits_on_the_host_bounded_by_the_timeout():
    """The count exchange is the one primitive whose result the host reads: its wait blocks the host, and a stalled
    one ends in HecateCollectiveError within the timeout (never a hang)."""
    from device_shim import cuda_shim
    from ds_hecate.comm.collectives import Communicator
    from ds_hecate.errors import HecateCollectiveError
    comm_nccl = StallingComm()

    def body():
        with cuda_shim():
            comm = Communicator(None, 0, 2, timeout_s=0.3, transport=_stalled(0.3, comm_nccl))
            with comm.during("MoE layer 'blocks.0.moe'"):
                comm.exchange_counts(torch.tensor([1, 2]).to("cuda"))
    out = _in_thread(body)
    assert isinstance(out.get("error"), HecateCollectiveError), out
    message = str(out["error"])
    assert "'token-count exchange'" in message and "NCCL all-gather did not complete within 0.3 s" in message
    assert comm_nccl.aborted


def test_cupy_waits_are_stream_side_and_the_watchdog_polls_off_the_caller_thread():
    """Every wait but the count exchange's makes the caller's stream wait on the event and returns; only the
    watchdog's thread queries events. Completed work leaves the watchdog empty, and nothing expires."""
    import time

    from device_shim import cuda_shim
    from ds_hecate.comm.collectives import Communicator
    fakes = _fakes()
    caller = threading.get_ident()
    queried_by = []

    import gpu_fakes

    class Event(gpu_fakes.DoneEvent):
        def query(self):
            queried_by.append(threading.get_ident())
            return True

    class Streams(gpu_fakes.ImmediateStreams):
        def done(self):
            return Event()

    with cuda_shim():
        transport = fakes.loopback_transport(torch.device("cuda", 0), timeout_s=5)
        transport.streams = Streams()
        comm = Communicator(None, 0, 1, timeout_s=5, transport=transport)
        x = torch.randn(4, 3).to("cuda")
        recv = torch.empty_like(x)
        work = transport.all_to_all(recv, x, [4], [4], True)
        work.wait()
        transport.all_reduce(x)
        transport.broadcast(x, 0)
        comm.pack([x[0], x[1]], 3, torch.bfloat16)
        assert torch.equal(recv, x)
        assert transport.streams.joins == 3
        start = time.monotonic()
        while transport.watchdog.pending() and time.monotonic() - start < 5:
            time.sleep(0.01)
        assert transport.watchdog.pending() == 0 and transport.failure is None
        assert queried_by and caller not in queried_by, "the caller's thread polled an event"
        transport.all_gather(torch.empty(2, dtype=torch.int64, device="cuda"), torch.tensor([1, 2]).to("cuda"))
        assert caller in queried_by, "the count exchange must wait on the host"
    assert transport.watchdog._thread.daemon


def test_cupy_transport_without_timeout_starts_no_watchdog():
    from device_shim import cuda_shim
    fakes = _fakes()
    with cuda_shim():
        transport = fakes.loopback_transport(torch.device("cuda", 0), timeout_s=None)
        x = torch.ones(3).to("cuda")
        transport.all_reduce(x)
        out = torch.empty(3, device="cuda")
        transport.all_gather(out, x)
    assert transport.watchdog is None and transport.streams.joins == 2 and torch.equal(out, x)


def test_cupy_build_communicator_gives_weights_their_own_nccl_communicator_and_stream(monkeypatch):
    """comm_backend 'cupy' with a weight group: two CuPy transports, each with its own NCCL communicator (created
    over its own process group) and its own stream."""
    import sys
    import types

    import ds_hecate.comm.backend as choice
    import ds_hecate.comm.gpu.backend as backend
    import ds_hecate.comm.gpu.nccl_comm as nccl_comm
    fakes = _fakes()
    cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    setattr(cuda, "nccl", fakes.FakeNccl())
    setattr(cupy, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    groups = []

    def communicator(self):
        groups.append(self.group)
        return fakes.LoopbackComm()
    monkeypatch.setattr(choice, "agree_backend", lambda *a: ("cupy", None))
    monkeypatch.setattr(backend, "cupy_status", lambda: (True, "cupy (stand-in)"))
    monkeypatch.setattr(backend, "kernels_status", lambda index: (True, "cupy (stand-in)"))   # never cached
    monkeypatch.setattr(nccl_comm, "CudaStreams", lambda device: fakes.ImmediateStreams())
    monkeypatch.setattr(nccl_comm.CupyTransport, "_nccl_communicator", communicator)
    tokens_group, weights_group = object(), object()
    comm = choice.build_communicator("cupy", tokens_group, 0, 1, torch.device("cuda", 0), timeout_s=9,
                                     weight_group=weights_group)
    assert comm.separate_weight_traffic and groups == [tokens_group, weights_group]
    assert comm.transport.comm is not comm.weights.comm and comm.transport.streams is not comm.weights.streams
    assert comm.transport.watchdog is not comm.weights.watchdog and comm.weights.timeout_s == 9


# -- transport choice agreed by all ranks -------------------------------------------------------------------------
def _agree(rank, world, requested):
    import torch.distributed as dist

    import ds_hecate.comm.backend as choice
    import ds_hecate.comm.gpu.backend as backend
    from ds_hecate.errors import HecateConfigError
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # rank 0 could use CuPy, rank 1 cannot (e.g. libnccl missing on that node)
    setattr(backend, "cupy_status",
            lambda: (True, "ok") if rank == 0 else (False, "cupy cannot load NCCL on this node"))
    choice.CUPY_VERIFIED = True   # as after a green GPU check: 'auto' would consider CuPy
    try:
        comm = choice.build_communicator(requested, dist.group.WORLD, rank, world, torch.device("cuda", rank))
        return ("ok", type(comm.transport).__name__ if hasattr(comm, "transport") else type(comm).__name__)
    except HecateConfigError as exc:
        return ("refused", str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return ("error", f"{type(exc).__name__}: {exc}")


def test_cupy_refused_on_every_rank_when_one_rank_cannot_use_it():
    results = run_ranks(2, _agree, "cupy")
    assert [r[0] for r in results] == ["refused", "refused"], results
    assert all("rank 1: cupy cannot load NCCL" in r[1] for r in results)


def test_auto_falls_back_on_every_rank_when_one_rank_cannot_use_cupy():
    results = run_ranks(2, _agree, "auto")
    assert results == [("ok", "TorchTransport"), ("ok", "TorchTransport")], results


def _agree_kernels(rank, world, requested):
    import torch.distributed as dist

    import ds_hecate.comm.backend as choice
    import ds_hecate.comm.gpu.backend as backend
    from ds_hecate.errors import HecateConfigError
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # rank 0 compiles the kernels, rank 1 cannot (e.g. no NVRTC on that node)
    setattr(backend, "kernels_status",
            lambda index: (True, "ok") if rank == 0 else (False, "the CUDA kernels did not compile"))
    try:
        comm = choice.build_communicator("torch", dist.group.WORLD, rank, world, torch.device("cuda", rank),
                                         device_kernels=requested)
        return ("ok", type(comm.transport.device_ops).__name__)
    except HecateConfigError as exc:
        return ("refused", str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return ("error", f"{type(exc).__name__}: {exc}")


def test_cuda_kernels_refused_on_every_rank_when_one_rank_cannot_run_them():
    """``device_kernels: cupy`` is agreed in one collective: a rank that cannot run the kernels makes every rank
    raise (alone it would leave the others waiting); ``auto`` decides per rank (kernels and torch ops give the same
    bits), with no collective."""
    refused = run_ranks(2, _agree_kernels, "cupy")
    assert [r[0] for r in refused] == ["refused", "refused"], refused
    assert all("rank 1: the CUDA kernels did not compile" in r[1] for r in refused)
    assert run_ranks(2, _agree_kernels, "auto") == [("ok", "KernelDeviceOps"), ("ok", "DeviceOps")]


def test_auto_uses_torch_distributed_on_cuda_until_a_gpu_check_passed(monkeypatch):
    import ds_hecate.comm.gpu.backend as backend
    monkeypatch.setattr(backend, "cupy_status", lambda: (True, "cupy 13, 1 GPU(s), NCCL available"))
    from ds_hecate.comm.backend import build_communicator
    comm = build_communicator("auto", None, 0, 1, torch.device("cuda", 0))
    assert type(getattr(comm, "transport", comm)).__name__ == "TorchTransport"


def test_cupy_relay_scope_queues_the_chain_on_the_communication_stream_and_joins_once():
    """The relay trees' chain (ds_hecate.comm.relay) runs on the CuPy transport's own stream: the scope starts it
    after the caller's work with the caller's tensors marked, the event is recorded when the scope closes, and the
    join the scope gives orders the caller's stream after it (once, stream-side). A failed transport raises at the
    join, not later."""
    from device_shim import cuda_shim
    fakes = _fakes()
    with cuda_shim():
        transport = fakes.loopback_transport(torch.device("cuda", 0), timeout_s=None)
        assert transport.stream_ordered
        x = torch.randn(4, 3).to("cuda")
        recv = torch.empty_like(x)
        starts, joins = transport.streams.starts, transport.streams.joins
        with transport.relay_scope([x]) as join:
            work = transport.all_to_all(recv, x, [4], [4], True)
            work.wait()
        assert transport.streams.starts == starts + 2           # the scope, then the primitive inside it
        assert transport.streams.joins == joins + 1              # the primitive's wait, on the chain's stream
        join()
        assert transport.streams.joins == joins + 2 and torch.equal(recv, x)
        with transport.relay_scope([x]) as join:
            pass
        transport.failure = "NCCL all-to-all did not complete within 1 s"
        with pytest.raises(TimeoutError, match="did not complete"):
            join()


def test_torch_transport_is_stream_ordered_only_with_nccl_on_cuda():
    """gloo works complete on the host: no relay scope there, the deeper relay stages wait for the wait."""
    from ds_hecate.comm.transport import TorchTransport
    transport = TorchTransport(None, 0, 1, torch.device("cpu"))
    assert not transport.stream_ordered and transport.relay_scope([]) is None


# -- one-rank shortcuts: off, a 1-rank group issues its collectives like N ranks (python -m benchmarks.layer) -------
def _one_rank_collectives(rank, world):
    import torch.distributed as dist

    from ds_hecate.comm.collectives import Communicator
    from ds_hecate.comm.transport import TorchTransport

    dist.init_process_group("gloo", rank=rank, world_size=world)

    class Recording(TorchTransport):
        def __init__(self):
            super().__init__(dist.group.WORLD, 0, 1, torch.device("cpu"))
            self.calls = []

        def __getattribute__(self, name):
            if name in ("all_to_all", "all_gather", "all_reduce", "reduce_scatter", "broadcast",
                        "all_gather_object"):
                object.__getattribute__(self, "calls").append(name)
            return object.__getattribute__(self, name)

    out = {}
    for shortcuts in (True, False):
        transport = Recording()
        comm = Communicator(dist.group.WORLD, 0, 1, transport=transport, one_rank_shortcuts=shortcuts)
        rows = torch.arange(12.0).reshape(6, 2)
        got = [comm.all_to_all(rows, [6], [6]).tolist(), comm.exchange_counts(torch.tensor([3, 0, 5])).tolist(),
               comm.all_reduce(torch.tensor([2.0])).tolist(),
               comm.reduce_scatter(torch.empty(3), torch.tensor([1.0, 2.0, 3.0])).tolist(),
               comm.all_gather_into(torch.empty(2), torch.tensor([4.0, 5.0])).tolist(),
               comm.broadcast(torch.tensor([7.0])).tolist(), comm.all_gather_object({"a": 1})]
        out[shortcuts] = (got, transport.calls)
    return out


def test_one_rank_shortcuts_off_issues_every_collective_through_the_transport():
    out = run_ranks(1, _one_rank_collectives)[0]
    (with_shortcuts, calls_on), (without, calls_off) = out[True], out[False]
    assert calls_on == []   # default: a 1-rank group never reaches its transport
    assert calls_off == ["all_to_all", "all_gather", "all_reduce", "reduce_scatter", "all_gather", "broadcast",
                         "all_gather_object"]
    assert without == with_shortcuts   # the same results either way
