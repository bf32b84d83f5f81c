"""GPU path of ds_hecate: CUDA kernels (kernels/*.cu via CuPy), their torch reference contracts, and the
CuPy+NCCL communication backend with its selection (``hecate.comm_backend``).

Importing this package never imports CuPy; CuPy is loaded only when the CuPy backend or a kernel is used, so
everything works on machines without CuPy or without a GPU (on the torch.distributed backend).
"""
from .backend import BACKENDS, agree_backend, agree_device_ops, build_communicator, cupy_status, kernels_status

__all__ = ["BACKENDS", "agree_backend", "agree_device_ops", "build_communicator", "cupy_status", "kernels_status"]
