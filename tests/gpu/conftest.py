"""tests/gpu (issues 7 and 53): on a GPU with CuPy the kernels, NCCL and CUDA streams run for real; on a machine with
no GPU (CI) every test runs its own code under the GPU stand-in (tests/fake_cupy.py: the CUDA stand-in of
tests/device_shim.py, a CuPy whose kernels check their launch and compute their torch contracts, NCCL over gloo),
so a changed signature or a stale assertion fails on the CPU the day it is made.

A machine with a GPU that cannot run the GPU path (CuPy missing or unable to run) skips them with the reason:
there a green run would have run nothing of the kernels (the GPU check's ``tests`` stage fails on those reasons).
What needs the real device is marked ``real_gpu`` with its reason and skipped under the stand-in.
"""
import os
import sys
import tempfile
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def gpu_skip_reason() -> Optional[str]:
    """Why the real GPU path cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch (GPU-only test)"
    from ds_hecate.comm.gpu import cupy_status
    usable, why = cupy_status()
    return None if usable else f"CuPy cannot run here: {why}"


#: "cuda": the real device; "stand-in": no GPU here, the GPU stand-in; "unusable": a GPU without a usable CuPy
MODE = "cuda" if gpu_skip_reason() is None else ("unusable" if torch.cuda.is_available() else "stand-in")


def pytest_configure(config):
    config.addinivalue_line("markers", "real_gpu(reason): needs the real device; skipped under the GPU stand-in")


def pytest_report_header(config):
    return f"tests/gpu: {MODE}" + ("" if MODE == "cuda" else f" ({gpu_skip_reason()})")


def pytest_collection_modifyitems(config, items):
    if MODE != "unusable":
        return
    here = os.path.dirname(__file__)
    reason = gpu_skip_reason()
    assert reason is not None   # an unusable GPU has a reason
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def gpu(request):
    """Where the test runs: ``real`` (the GPU) or under the stand-in (``stand_in``: its shim and CuPy)."""
    if MODE == "cuda":
        yield SimpleNamespace(real=True, stand_in=None)
        return
    marker = request.node.get_closest_marker("real_gpu")
    if marker is not None:
        pytest.skip(f"needs the real device: {marker.kwargs.get('reason') or marker.args[0]}")
    from fake_cupy import gpu_stand_in
    with gpu_stand_in() as stand_in:
        yield SimpleNamespace(real=False, stand_in=stand_in)


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-process world (module-wide): NCCL on a GPU, gloo under the stand-in; destroyed after the module."""
    import torch.distributed as dist
    store = tempfile.mktemp(prefix="gpu_group_store_")
    real = MODE == "cuda"
    if real:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if real else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    if os.path.exists(store):
        os.remove(store)
