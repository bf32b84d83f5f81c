"""Whether this rank can run the CuPy pieces: the CuPy+NCCL transport (:func:`cupy_status`, :func:`local_status`)
and ds_hecate's CUDA kernels (:func:`kernels_status`). Cached probes, no collective; the choice all ranks agree on
from them is :mod:`ds_hecate.comm.backend`'s.
"""
from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Any, Tuple

import torch

from .kernels import compile_all, device_index, kernel_dir


def _cupy_gpus(with_nccl: bool) -> Tuple[Any, str, int]:
    """(cupy module or None, its version or why it cannot run, visible GPUs): the probe both status functions start
    with. ``with_nccl`` also imports CuPy's NCCL module (its warning when libnccl is missing is silenced: the
    caller reports it)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy
            if with_nccl:
                from cupy.cuda import nccl  # noqa: F401 - what the CuPy transport needs
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken CUDA install raising at import
        return None, (f"cupy is not importable ({type(exc).__name__}: {exc}); install it with pip install "
                      "'ds_hecate[gpu]' (CUDA 12) or 'ds_hecate[gpu13]' (CUDA 13)"), 0
    version = getattr(cupy, "__version__", "(no version)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - cupy_backends CUDARuntimeError: no driver / insufficient driver
        return None, f"cupy {version} is installed but sees no usable GPU ({type(exc).__name__}: {exc})", 0
    if count == 0:
        return None, f"cupy {version} is installed but sees no GPU", 0
    return cupy, version, count


@functools.lru_cache(maxsize=None)
def cupy_status() -> Tuple[bool, str]:
    """(usable, reason): whether CuPy can run Hecate's kernels and NCCL here, and if not, why. Cached."""
    cupy, version, count = _cupy_gpus(with_nccl=True)
    if cupy is None:
        return False, version
    if not getattr(cupy.cuda.nccl, "available", False):
        return False, f"cupy {version} is installed but cannot load NCCL (libnccl.so.2); install it with " \
                      "pip install nvidia-nccl-cu12 (or nvidia-nccl-cu13 for CUDA 13)"
    try:
        kernel_dir()
    except Exception as exc:
        return False, str(exc)
    return True, f"cupy {version}, {count} GPU(s), NCCL available"


@functools.lru_cache(maxsize=None)
def kernels_status(index: int) -> Tuple[bool, str]:
    """(usable, reason): whether ds_hecate's CUDA kernels compile and can run on CUDA device ``index`` (CuPy
    importable, a GPU, the sources found, every kernel compiled by NVRTC now rather than at a first launch in the
    middle of a layer call). NCCL is not needed. Cached per device."""
    cupy, version, count = _cupy_gpus(with_nccl=False)
    if cupy is None:
        return False, version
    if index >= count:
        return False, f"cupy {version} sees {count} GPU(s), not device {index}"
    try:
        compile_all(index)
    except Exception as exc:  # noqa: BLE001 - a missing source or an NVRTC error: the kernels cannot run here
        return False, f"the CUDA kernels did not compile ({type(exc).__name__}: {str(exc)[:300]})"
    return True, f"cupy {version}, kernels compiled for device {index}"


def local_kernels_status(device: torch.device) -> Tuple[bool, str]:
    """(usable, reason) of the CUDA kernels on this rank, for Hecate's working ``device``."""
    if device.type != "cuda":
        return False, f"Hecate's tensors are on '{device.type}', not CUDA"
    return kernels_status(device_index(device))


def local_status(device: torch.device) -> Tuple[bool, str]:
    """(usable, reason) of the CuPy transport on this rank, for Hecate's working ``device``."""
    if device.type != "cuda":
        # No CuPy probe here: importing cupy costs ~0.5 s per process and cannot change the answer.
        installed = importlib.util.find_spec("cupy") is not None
        return False, (f"Hecate's tensors are on '{device.type}', not CUDA (cupy is "
                       f"{'installed' if installed else 'not installed'})")
    return cupy_status()
