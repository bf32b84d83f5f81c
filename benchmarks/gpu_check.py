"""``make gpu-check``: the one-command check of ds_hecate's GPU path on a machine with a GPU, as it is (no network,
whatever CUDA torch and CuPy are installed).

Stages (each in its own process, with its own timeout; :mod:`benchmarks.gpu.runner` lists them): the GPU tests
(tests/gpu, tests/test_kernels.py); 20 training steps on CUDA (torch and CuPy transports) against the CPU with
deterministic routing; 1-rank NCCL round trips of every primitive and every Hecate collective (torch.distributed
and CuPy); 2-process NCCL where there are 2 GPUs; 2 ranks in 2 processes on one GPU over gloo, 20 training steps
against the same run on the CPU; stream ordering and its ablation, stream-side waits and the
timeout watchdog; compute-sanitizer memcheck; kernel micro-benchmarks against HBM bandwidth; one layer call of a
Qwen3-30B-A3B-like and a DeepSeek-V3-like layer, grouped GEMM against the per-expert loop, TFLOP/s against the
bf16 peak; the side-by-side benchmark (plain grouped-GEMM layer against ds_hecate) on the same two shapes, its
speed targets reported.

Usage: ``python benchmarks/gpu_check.py [--out FILE.json] [--markdown FILE.md] [--quick] [--dry-run]
[--stages a,b]``. The JSON is rewritten after every stage; the Markdown table is printed at the end. Exit status 0
only if every stage passed (or was skipped, saying why). ``--dry-run`` runs every stage's code path on the CPU
(CI).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
