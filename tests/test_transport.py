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

    import ds_hecate.comm.gpu
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

    def capture(requested, group, rank, world, device, timeout_s=None):
        seen["device"] = device
        raise KeyboardInterrupt  # stop before building the runtime

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: FakeAccelerator())
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: None)
    monkeypatch.setattr(ds_hecate.comm.gpu, "build_communicator", capture)
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


class FakeNccl:
    """Stand-ins for cupy.cuda.nccl (module constants) and an NCCL communicator over in-process ranks."""

    NCCL_UINT8 = 0
    NCCL_FLOAT32, NCCL_FLOAT64, NCCL_FLOAT16, NCCL_BFLOAT16, NCCL_INT32, NCCL_INT64 = 1, 2, 3, 4, 5, 6
    NCCL_SUM, NCCL_MAX, NCCL_MIN, NCCL_PROD = 0, 1, 2, 3

    def groupStart(self):
        pass

    def groupEnd(self):
        pass


class StallingComm:
    """An NCCL communicator whose operations never complete (a dead peer)."""

    def __init__(self):
        self.aborted = False

    def send(self, *a):
        pass

    recv = allGather = allReduce = bcast = send

    def abort(self):
        self.aborted = True


class StalledStreams:
    """Communication stream stand-in whose completion events never fire."""

    def start(self, tensors):
        import contextlib
        return contextlib.nullcontext()

    def handle(self):
        return 0

    def done(self):
        return SimpleNamespace(query=lambda: False)

    def join(self, event):
        raise AssertionError("joined an event that never completed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cupy_transport_timeout_aborts_and_names_the_collective(dtype):
    """A collective that does not complete within collective_timeout_s aborts the NCCL communicator and raises
    HecateCollectiveError naming the collective, the layer and the phase (fp16 included: no kernel restriction)."""
    from device_shim import cuda_shim
    from ds_hecate.comm.collectives import Communicator
    from ds_hecate.errors import HecateCollectiveError
    from ds_hecate.comm.gpu.nccl_comm import CupyTransport

    comm_nccl = StallingComm()
    result = {}

    def body():
        with cuda_shim():
            transport = CupyTransport(None, 0, 2, torch.device("cuda", 0), timeout_s=0.3, comm=comm_nccl,
                                      streams=StalledStreams(), nccl=FakeNccl())
            comm = Communicator(None, 0, 2, timeout_s=0.3, transport=transport)
            x = torch.randn(6, 8).to("cuda").to(dtype)
            with comm.during("dispatch of MoE layer 'blocks.1.moe'"):
                try:
                    comm.all_to_all(x, [3, 3], [3, 3])
                except HecateCollectiveError as exc:
                    result["error"] = str(exc)
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the CuPy transport waited forever on a stalled collective"
    message = result.get("error", "")
    assert "'token all-to-all'" in message and "blocks.1.moe" in message and "dispatch" in message, message
    assert "collective_timeout_s = 0.3 s" in message and comm_nccl.aborted


# -- transport choice agreed by all ranks -------------------------------------------------------------------------
def _agree(rank, world, requested):
    import torch.distributed as dist

    import ds_hecate.comm.gpu.backend as backend
    from ds_hecate.errors import HecateConfigError
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # rank 0 could use CuPy, rank 1 cannot (e.g. libnccl missing on that node)
    backend.cupy_status = lambda: (True, "ok") if rank == 0 else (False, "cupy cannot load NCCL on this node")
    backend.CUPY_VERIFIED = True   # as after a green GPU check: 'auto' would consider CuPy
    try:
        comm = backend.build_communicator(requested, dist.group.WORLD, rank, world, torch.device("cuda", rank))
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


def test_auto_uses_torch_distributed_on_cuda_until_a_gpu_check_passed(monkeypatch):
    import ds_hecate.comm.gpu.backend as backend
    monkeypatch.setattr(backend, "cupy_status", lambda: (True, "cupy 13, 1 GPU(s), NCCL available"))
    from ds_hecate.comm.gpu import build_communicator
    comm = build_communicator("auto", None, 0, 1, torch.device("cuda", 0))
    assert type(getattr(comm, "transport", comm)).__name__ == "TorchTransport"
