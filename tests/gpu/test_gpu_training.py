"""Training on CUDA follows training on the CPU (``make gpu-check``'s stages ``training`` and ``training_bf16``).

A small ds_hecate.MoE model (tests/gpu_training.py) trained on 1 rank on the CPU and on CUDA three times: over the
torch transport with the CUDA kernels as its device work (``device_kernels: auto``, the default, which must run
them on a GPU), with torch ops alone, and over the CuPy transport. fp32: every CUDA run's losses within 1e-4
(relative) of the CPU run's at every step; the combine runs on the kernel, nothing is packed (the masters are the
resident weights). bf16: after every optimizer step the resident bf16 weights are refreshed from the fp32 masters
through the pack kernel; the kernel runs must pack and combine, follow the torch-ops run on CUDA within 1e-3 (the
kernels are bit-equal to their contracts; atomics may reorder sums), and end with every resident row equal to its
master cast to bf16 (the CPU run's difference is reported: bf16 products round differently on two devices). Under
the GPU stand-in (no GPU): 2 steps, the kernels checked at launch and computed by their contracts.
"""
from __future__ import annotations

import pytest

from gpu_training import (BF16_TOLERANCE, CUDA_RUNS, compare, demo_losses, fp32_everywhere,
                          kernel_use_problems)


def _runs(gpu, dtype_name: str) -> dict:
    steps = 20 if gpu.real else 2
    fp32_everywhere()
    cpu = demo_losses("cpu", steps, dtype_name=dtype_name)
    runs = {name: demo_losses("cuda", steps, transport, kernels, dtype_name) for name, transport, kernels in CUDA_RUNS}
    if dtype_name == "fp32":
        return {name: compare(cpu, run) for name, run in runs.items()}
    return {name: {**compare(runs["cuda_torch_ops"], run, BF16_TOLERANCE), "vs_cpu": compare(cpu, run)["max_rel_diff"]}
            for name, run in runs.items()}


def test_fp32_training_on_cuda_follows_the_cpu(gpu):
    out = _runs(gpu, "fp32")
    assert all(r["ok"] for r in out.values()), out
    assert kernel_use_problems(out, "fp32") == [], out


@pytest.mark.parametrize("dtype_name", ["bf16"])
def test_bf16_kernel_runs_follow_torch_ops_and_refresh_the_resident_rows(gpu, dtype_name):
    out = _runs(gpu, dtype_name)
    assert all(r["ok"] for r in out.values()), out
    assert kernel_use_problems(out, dtype_name) == [], out
    assert all(r["resident_error"] == 0.0 for r in out.values()), out
