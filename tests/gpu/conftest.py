"""GPU-only tests (issue 7): skipped, with the reason, unless torch sees CUDA and CuPy can run kernels and NCCL."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch (GPU-only test)"
    from ds_hecate.comm.gpu import cupy_status
    usable, why = cupy_status()
    return None if usable else f"CuPy cannot run here: {why}"


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=reason))
