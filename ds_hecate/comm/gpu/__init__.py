"""GPU path of ds_hecate: CUDA kernels (kernels/*.cu via CuPy), their torch reference contracts, the CuPy+NCCL
transport, and the probes that say whether a rank can run them (the choice itself, ``hecate.comm_backend`` and
``hecate.device_kernels``, is :mod:`ds_hecate.comm.backend`'s).

Importing this package never imports CuPy; CuPy is loaded only when the CuPy backend or a kernel is used, so
everything works on machines without CuPy or without a GPU (on the torch.distributed backend).
"""
from .backend import cupy_status, kernels_status, local_status

__all__ = ["cupy_status", "kernels_status", "local_status"]
