"""A/B of ``copy_chunk``'s unroll (kernels/sparse_collectives.cu, ``HECATE_UNROLL``) on one GPU, in one process:
pack and unpack of 64 chunks x 16 MiB fp32 built with ``-DHECATE_UNROLL=1`` (one 16-byte load in flight per
thread, the kernels before 2026-12-04) and with the default (4), alternating, against torch's batched copy.

Two runs of the GPU check on different machines are no A/B: on the first run of the day every memory-bound figure,
torch's own included, read up to 60% lower. Usage (on a GPU): ``python -m benchmarks.gpu.unroll_ab [--rounds 3]``.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from ds_hecate.comm.gpu import kernels as K


def build(unroll: int) -> None:
    """Recompile the kernels with ``HECATE_UNROLL=unroll`` (the loader's caches cleared)."""
    import cupy
    K._module.cache_clear()
    K._function.cache_clear()
    source = K.kernel_source("sparse_collectives.cu")
    module = cupy.RawModule(code=source, options=("--std=c++14", f"-DHECATE_UNROLL={unroll}"))
    original = K._module

    def patched(name):
        return module if name == "sparse_collectives.cu" else original(name)
    K._module = patched  # type: ignore[assignment]


def timed(fn, repeat: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    n, numel = 64, 1 << 22
    src = torch.randn(n, numel, device=dev)
    chunks = list(src.unbind(0))
    out32 = torch.empty(n, numel, device=dev)
    out16 = torch.empty(n, numel, dtype=torch.bfloat16, device=dev)
    dsts = [torch.empty(numel, device=dev) for _ in range(n)]
    flat = out32.view(-1)
    loader = K._module
    rows = []
    for rnd in range(args.rounds):
        for unroll in (1, 4):
            K._module = loader
            build(unroll)
            gbs = {
                "pack fp32->fp32": 2 * n * numel * 4 / timed(lambda: K.pack_chunks(chunks, flat, numel)),
                "pack fp32->bf16": n * numel * 6 / timed(lambda: K.pack_chunks(chunks, out16.view(-1), numel)),
                "unpack fp32->fp32": 2 * n * numel * 4 / timed(lambda: K.unpack_chunks(flat, dsts, numel)),
                "torch.stack fp32": 2 * n * numel * 4 / timed(lambda: torch.stack(chunks, out=out32)),
            }
            rows.append({"round": rnd, "unroll": unroll, **{k: round(v / 1e9) for k, v in gbs.items()}})
            print(json.dumps(rows[-1]), flush=True)
    for unroll in (1, 4):
        mine = [r for r in rows if r["unroll"] == unroll]
        print(f"unroll {unroll}: median GB/s " + ", ".join(
            f"{k} {statistics.median(r[k] for r in mine):,.0f}" for k in rows[0] if k not in ("round", "unroll")))


if __name__ == "__main__":
    main()
