"""Stage ``micro``: each CUDA kernel's effective bandwidth (bytes read + written / median time) against the HBM
bandwidth, nominal and measured (the ``device`` stage's, else a copy here), and against the torch op it replaces
(through the transport's device ops, what training calls). Target: pack/unpack at >= 70% of the memory bandwidth on
large chunks. Dry run: tiny sizes under the GPU stand-in."""
from __future__ import annotations

from typing import Optional, Tuple

from .common import Context, result


def measure(ctx: Context, nominal, copy_gbs) -> Tuple[list, dict, Optional[float]]:
    import torch

    from ds_hecate.comm.gpu import kernels as K
    from ds_hecate.comm.gpu import reference as ref
    from ds_hecate.comm.gpu.device_ops import KernelDeviceOps
    from ds_hecate.comm.transport import TORCH_DEVICE_OPS
    K.compile_all(0)   # under the GPU stand-in in a dry run: launches checked, contracts computed
    ops = KernelDeviceOps(K)
    dev = torch.device("cuda", 0)
    repeat = 2 if ctx.dry_run else (5 if ctx.quick else 20)
    rows = []

    def add(name, nbytes, t_kernel, t_torch, torch_op):
        gbs = nbytes / t_kernel / 1e9
        rows.append({"op": name, "bytes": nbytes, "kernel_s": t_kernel, "kernel_gbs": gbs,
                     "pct_nominal": 100 * gbs / nominal if nominal else None,
                     "pct_copy": 100 * gbs / copy_gbs if copy_gbs else None, "torch_op": torch_op,
                     "torch_s": t_torch, "torch_gbs": nbytes / t_torch / 1e9 if t_torch else None})
    n_chunks, numel = (4, 1 << 10) if ctx.dry_run else (16 if ctx.quick else 64, 1 << 22)   # 64 x 16 MiB: 1 GiB
    src = torch.randn(n_chunks, numel, device=dev)
    chunks = list(src.unbind(0))
    big = torch.empty(n_chunks, numel, device=dev)
    if copy_gbs is None:
        copy_gbs = 2 * src.numel() * 4 / ctx.timed(lambda: big.copy_(src), repeat) / 1e9
    nbytes = 2 * n_chunks * numel * 4
    add("pack fp32->fp32", nbytes, ctx.timed(lambda: ops.pack(chunks, big), repeat),
        ctx.timed(lambda: TORCH_DEVICE_OPS.pack(chunks, big), repeat), "DeviceOps.pack (torch.stack)")
    half = torch.empty(n_chunks, numel, dtype=torch.bfloat16, device=dev)
    add("pack fp32->bf16", n_chunks * numel * 6, ctx.timed(lambda: ops.pack(chunks, half), repeat),
        ctx.timed(lambda: TORCH_DEVICE_OPS.pack(chunks, half), repeat), "DeviceOps.pack (torch.stack, cast)")
    outs = [torch.empty(numel, device=dev) for _ in range(n_chunks)]
    flat = big.view(-1)
    add("unpack fp32->fp32", nbytes, ctx.timed(lambda: K.unpack_chunks(flat, outs, numel), repeat),
        ctx.timed(lambda: [o.copy_(flat.narrow(0, i * numel, numel)) for i, o in enumerate(outs)], repeat),
        "per-chunk copy_")
    n_out = n_chunks // 4
    lists = [[3 * j + i for i in range(3)] for j in range(n_out)]
    recv = flat.narrow(0, 0, 3 * n_out * numel)
    add("reduce fp32 (own + 3 received)", n_out * numel * 4 * 5,
        ctx.timed(lambda: K.reduce_chunks(chunks[:n_out], recv, lists, numel), repeat),
        ctx.timed(lambda: ref.reduce_chunks(chunks[:n_out], recv, lists, numel), repeat), "reference (torch adds)")
    target = torch.zeros(n_out, numel, device=dev)
    wire = half[:3 * n_out]
    target_rows = [j for j in range(n_out) for _ in range(3)]
    add("accumulate fp32 += 3 bf16 rows each", n_out * numel * (4 * 2 + 3 * 2),
        ctx.timed(lambda: ops.accumulate(target, wire, target_rows), repeat),
        ctx.timed(lambda: TORCH_DEVICE_OPS.accumulate(target, wire, target_rows), repeat),
        "DeviceOps.accumulate (index_add_ rounds)")
    del src, chunks, big, half, outs, flat, recv, target, wire   # freed before the token benchmarks

    tokens, hidden = (256, 64) if ctx.dry_run else ((1 << 15, 4096) if ctx.quick else (1 << 17, 4096))
    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    index = torch.randperm(tokens, device=dev)
    add("permute rows bf16", 2 * x.numel() * 2, ctx.timed(lambda: K.permute_rows(x, index), repeat),
        ctx.timed(lambda: x.index_select(0, index), repeat), "index_select")
    k = 2
    y = x.repeat(k, 1)
    pos = torch.randperm(k * tokens, device=dev)
    gates = torch.rand(k, tokens, device=dev)
    add("unpermute+combine bf16 k=2", (k + 1) * tokens * hidden * 2,
        ctx.timed(lambda: ops.combine(y, pos, gates), repeat),
        ctx.timed(lambda: ref.unpermute_combine(y, pos, gates), repeat), "torch weighted un-permute")
    idx = torch.randint(0, 64, (2, (1 << 10) if ctx.dry_run else (1 << 22)), device=dev)
    add("expert histogram (64 experts)", idx.numel() * 8, ctx.timed(lambda: K.expert_histogram(idx, 64), repeat),
        ctx.timed(lambda: torch.bincount(idx.view(-1), minlength=64), repeat), "torch.bincount")
    return rows, ops.used, copy_gbs


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec if abs(value) >= 10 else ".2f")


def run(ctx: Context) -> dict:
    nominal, copy_gbs = (None, None) if ctx.dry_run else (   # a CPU figure is no ceiling
        ctx.prior_figure("device", "nominal_hbm_gbs"), ctx.prior_figure("device", "copy_gbs"))
    with ctx.stand_in():
        rows, used, copy_gbs = measure(ctx, nominal, copy_gbs)
    table = {"title": "Kernel micro-benchmarks (GB/s = bytes read + written / median time)"
                      + (" - dry run: the kernels' contracts on the CPU, not kernels" if ctx.dry_run else ""),
             "header": ["op", "kernel GB/s", "% of nominal HBM", "% of measured copy", "torch op", "torch GB/s"],
             "rows": [[r["op"], _fmt(r["kernel_gbs"], ",.0f"), _fmt(r["pct_nominal"], ".0f"),
                       _fmt(r["pct_copy"], ".0f"), r["torch_op"], _fmt(r["torch_gbs"], ",.0f")] for r in rows]}
    pack = [r for r in rows if r["op"].startswith(("pack", "unpack"))]
    worst = min((r["pct_copy"] for r in pack if r["pct_copy"] is not None), default=None)
    kernels_ran = used.get("pack", 0) > 0 and used.get("accumulate", 0) > 0 and used.get("combine", 0) > 0
    summary = (f"pack/unpack at >= {worst:.0f}% of the measured copy" if worst is not None else
               "pack/unpack: no bandwidth ceiling to compare with") + f"; device ops used: {used}"
    return result(bool(kernels_ran), summary, rows=rows, device_ops_used=used, nominal_hbm_gbs=nominal,
                  copy_gbs=copy_gbs, tables=[table])
