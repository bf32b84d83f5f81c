"""Stage ``device``: the GPU, torch, CUDA, CuPy and its NCCL, and the ceilings the later stages report against: HBM
bandwidth nominal (memory clock x bus width) and measured (a copy), and the dense bf16 matmul rate."""
from __future__ import annotations

import shutil
import subprocess
from typing import Any, Dict

from .common import Context, result

# CUDA device attributes (cudaDeviceAttr): the memory clock in kHz and the bus width in bits.
_ATTR_MEMORY_CLOCK_KHZ, _ATTR_BUS_WIDTH_BITS = 36, 37


def nominal_hbm_gbs(index: int = 0):
    """Nominal memory bandwidth in GB/s (2 transfers per clock x bus width), or None if unreadable."""
    import torch
    props = torch.cuda.get_device_properties(index)
    clock, width = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if not (clock and width):
        try:
            import cupy
            rt = cupy.cuda.runtime
            clock = rt.deviceGetAttribute(getattr(rt, "cudaDevAttrMemoryClockRate", _ATTR_MEMORY_CLOCK_KHZ), index)
            width = rt.deviceGetAttribute(getattr(rt, "cudaDevAttrGlobalMemoryBusWidth", _ATTR_BUS_WIDTH_BITS),
                                          index)
        except Exception:  # noqa: BLE001 - no CuPy: the figure is left out
            return None
    return 2.0 * clock * 1e3 * width / 8 / 1e9


def _nvidia_smi() -> str:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return "nvidia-smi not on PATH"
    proc = subprocess.run([tool, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                           "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    return (proc.stdout or proc.stderr).strip()


def run(ctx: Context) -> dict:
    import torch

    from ds_hecate.comm.gpu import cupy_status
    figures: Dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if not ctx.dry_run and not torch.cuda.is_available():
        return result(False, f"torch {torch.__version__} sees no CUDA device", **figures)
    with ctx.stand_in():   # dry run: the same code on the GPU stand-in (its figures are the CPU's)
        figures.update(cupy=cupy_status()[1], cupy_usable=cupy_status()[0])
        dev = torch.device("cuda", 0)
        props = torch.cuda.get_device_properties(0)
        figures.update(device_name=props.name, gpus=torch.cuda.device_count(), sms=props.multi_processor_count,
                       memory_gib=round(props.total_memory / 2 ** 30, 1), capability=f"{props.major}.{props.minor}",
                       nvidia_smi=_nvidia_smi(), nominal_hbm_gbs=nominal_hbm_gbs(0) or None)
        repeat = 2 if ctx.dry_run else (5 if ctx.quick else 10)
        nbytes = (1 << 20) if ctx.dry_run else ((1 << 28) if ctx.quick else (1 << 30))
        src = torch.ones(nbytes // 4, device=dev)   # bytes read + written per second of a device-to-device copy
        dst = torch.empty_like(src)
        figures["copy_gbs"] = 2 * nbytes / ctx.timed(lambda: dst.copy_(src), repeat) / 1e9
        n = 128 if ctx.dry_run else (4096 if ctx.quick else 8192)   # a dense bf16 n x n x n product, random data
        a, b = (torch.randn(n, n, device=dev).to(torch.bfloat16) for _ in range(2))
        figures.update(bf16_matmul_n=n, bf16_matmul_tflops=2 * n ** 3 / ctx.timed(lambda: a @ b, repeat) / 1e12)
    nominal = figures["nominal_hbm_gbs"]
    hbm = f"HBM nominal {nominal:,.0f} GB/s" if nominal else "HBM nominal unreadable"
    summary = (f"{'dry run: ' if ctx.dry_run else ''}{props.name}, {figures['gpus']} GPU(s), torch "
               f"{torch.__version__} (CUDA {torch.version.cuda}); {hbm}, copy {figures['copy_gbs']:,.1f} GB/s; "
               f"bf16 matmul {figures['bf16_matmul_tflops']:.3g} TFLOP/s; {figures['cupy']}")
    return result(True, summary, **figures)
