"""Hecate's CUDA kernels (kernels/*.cu), loaded as ``cupy.RawModule`` and launched on torch's current CUDA stream.

Sources ship with the package (``ds_hecate/kernels/*.cu`` in an installed copy, ``kernels/`` in a checkout); each
module is compiled by NVRTC once per process (and by CuPy once per device architecture, cached on disk by CuPy).
Tensors are handed to CuPy zero-copy through ``__cuda_array_interface__`` (bf16 viewed as int16, since CuPy has
no bfloat16 dtype); pointer tables (one pointer per expert chunk) are uploaded as small int64 device tensors, pinned
and non-blocking.

Every launcher takes torch CUDA tensors and returns/writes torch tensors; the contracts are the functions of the
same name in :mod:`ds_hecate.comm.gpu.reference`.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ...errors import HecateError
from ..device import to_device

THREADS = 256  # HECATE_THREADS in the .cu files (launch bounds)
SOURCES = ("sparse_collectives.cu", "token_permute.cu")

#: Every kernel the launchers use, per source file (tests check each one is in the compiled PTX).
KERNEL_NAMES: Dict[str, List[str]] = {
    "sparse_collectives.cu": (
        [f"{op}_{pair}_v{v}" for pair, vec in (("f32_f32", 4), ("f32_bf16", 4), ("bf16_bf16", 8), ("bf16_f32", 8))
         for op in ("pack", "unpack") for v in (1, vec)]
        + [f"reduce_{pair}_v{v}" for pair in ("f32_f32", "f32_bf16", "bf16_f32", "bf16_bf16") for v in (1, 4)]
        + [f"accumulate_{wire}_v{v}" for wire in ("f32", "bf16") for v in (1, 4)]),
    "token_permute.cu": (["expert_histogram"] + [f"permute_rows_u{b}" for b in (16, 8, 4, 2, 1)]
                         + [f"unpermute_combine_{t}_v{v}" for t in ("f32", "bf16") for v in (1, 4)]),
}

_DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def kernel_dir() -> Path:
    """Directory holding the .cu sources: next to the installed package, else the checkout's ``kernels/``."""
    override = os.environ.get("DS_HECATE_KERNEL_DIR")
    candidates = ([Path(override)] if override else []) + [Path(__file__).resolve().parents[2] / "kernels",
                                                            Path(__file__).resolve().parents[3] / "kernels"]
    for path in candidates:
        if all((path / name).is_file() for name in SOURCES):
            return path
    raise HecateError("the CUDA kernel sources (" + ", ".join(SOURCES) + ") were not found in "
                      + " or ".join(str(p) for p in candidates) + "; reinstall ds_hecate with `pip install .`")


def kernel_source(name: str) -> str:
    return (kernel_dir() / name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def _module(name: str):
    import cupy
    return cupy.RawModule(code=kernel_source(name), options=("--std=c++14",))


@functools.lru_cache(maxsize=None)
def _function(source: str, kernel: str, device_index: int):
    import cupy
    with cupy.cuda.Device(device_index):
        return _module(source).get_function(kernel)


def compile_all(device_index: int = 0) -> None:
    """Compile every kernel now (the first launch would otherwise do it); raises on a compile error."""
    for source, names in KERNEL_NAMES.items():
        for kernel in names:
            _function(source, kernel, device_index)


# -- plumbing --------------------------------------------------------------------------------------------------
def _cp(t: torch.Tensor):
    """Zero-copy CuPy view of a contiguous torch CUDA tensor (bf16 as int16)."""
    import cupy
    t = t.detach()  # the kernels sit outside autograd; CAI refuses tensors that require grad
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return cupy.asarray(t)


def _ptr_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Chunk pointers as an int64 device table: a pinned, non-blocking upload (never a host stall per launch)."""
    return to_device(torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64), device)


def _launch(source: str, kernel: str, device: torch.device, grid, block, args, shared_mem: int = 0) -> None:
    import cupy
    index = device_index(device)
    fn = _function(source, kernel, index)
    with cupy.cuda.Device(index), _cupy_stream(torch.cuda.current_stream(device)):
        fn(grid, block, args, shared_mem=shared_mem)


def device_index(device: torch.device) -> int:
    """The CUDA device ordinal of ``device`` (``cuda`` without an index: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _cupy_stream(stream: "torch.cuda.Stream"):
    """torch's stream as a CuPy stream: through the CUDA stream protocol where this CuPy and torch both have it
    (CuPy 14 deprecates ``ExternalStream``), else by its handle."""
    import cupy
    if _stream_protocol_works():
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream)


@functools.lru_cache(maxsize=None)
def _stream_protocol_works() -> bool:
    """Whether ``cupy.cuda.Stream.from_external`` takes a torch stream and lands on the same CUDA stream (probed
    once per process on the current stream)."""
    import cupy
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None or not hasattr(torch.cuda.Stream, "__cuda_stream__"):
        return False
    current = torch.cuda.current_stream()
    try:
        return from_external(current).ptr == current.cuda_stream
    except Exception:  # noqa: BLE001 - an older protocol on either side: the handle works everywhere
        return False


def _blocks(work_items: int, chunks: int, device: torch.device) -> int:
    """Blocks per chunk: enough to cover the chunk, capped so all chunks together fill the device ~8x over."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_chunk = max(1, (8 * sms * 2048 // THREADS) // max(chunks, 1))
    return max(1, min(-(-work_items // THREADS), per_chunk))


def _aligned(tensors: Sequence[torch.Tensor], bytes_: int = 16) -> bool:
    """Whether every tensor's first element is ``bytes_``-aligned (what a vector variant needs)."""
    return all(t.data_ptr() % bytes_ == 0 for t in tensors)


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise HecateError(f"the CUDA kernels handle float32 and bfloat16, not {dtype}") from None


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels handle ``dtype`` (float32 and bfloat16; not float16)."""
    return dtype in _DTYPE_NAMES


def _check(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if not t.is_cuda or not t.is_contiguous():
            raise HecateError(f"the CUDA kernels need contiguous CUDA tensors (got {t.device}, "
                              f"contiguous={t.is_contiguous()})")


# -- SparseAllGather / SparseReduceScatter ---------------------------------------------------------------------
def _copy_chunks(op: str, flat: torch.Tensor, chunks: Sequence[torch.Tensor], numel: int,
                 in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    if not chunks or numel == 0:
        return
    _check([flat, *chunks])
    if len(chunks) > 65535:
        raise HecateError(f"{op}_chunks: {len(chunks)} chunks in one launch; at most 65535 (grid.y)")
    pair = f"{_dtype_name(in_dtype)}_{_dtype_name(out_dtype)}"
    width = 4 if in_dtype == torch.float32 else 8
    # A V-wide access needs V * itemsize alignment on both sides (chunk offsets keep it when numel % V == 0).
    align = width * max(torch.empty((), dtype=in_dtype).element_size(), torch.empty((), dtype=out_dtype).element_size())
    vec = width if numel % width == 0 and _aligned([flat, *chunks], align) else 1
    grid = (_blocks(numel // vec, len(chunks), flat.device), len(chunks))
    table, buf = _cp(_ptr_table(chunks, flat.device)), _cp(flat)
    args = (table, buf, _i64(numel)) if op == "pack" else (buf, table, _i64(numel))
    _launch("sparse_collectives.cu", f"{op}_{pair}_v{vec}", flat.device, grid, (THREADS,), args)


def _i64(value: int):
    import numpy
    return numpy.int64(value)


def pack_chunks(srcs: Sequence[torch.Tensor], out: torch.Tensor, numel: int) -> torch.Tensor:
    """Kernel of :func:`ds_hecate.comm.gpu.reference.pack_chunks`, into the preallocated flat ``out``."""
    if srcs:
        _copy_chunks("pack", out, srcs, numel, srcs[0].dtype, out.dtype)
    return out


def unpack_chunks(buf: torch.Tensor, dsts: Sequence[torch.Tensor], numel: int) -> None:
    """Kernel of :func:`ds_hecate.comm.gpu.reference.unpack_chunks`."""
    if dsts:
        _copy_chunks("unpack", buf, dsts, numel, buf.dtype, dsts[0].dtype)


def reduce_chunks(bases: Sequence[torch.Tensor], recv: torch.Tensor, chunks_per_output: Sequence[Sequence[int]],
                  numel: int, outs: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
    """Kernel of :func:`ds_hecate.comm.gpu.reference.reduce_chunks`; outputs are new fp32 tensors unless given."""
    from .reference import chunk_segments

    if not bases:
        return []
    device = bases[0].device
    if outs is None:
        flat = torch.empty(len(bases), numel, dtype=torch.float32, device=device)
        outs = list(flat.unbind(0))
    if recv.numel() == 0:
        recv = torch.empty(1, dtype=recv.dtype, device=device)  # a valid pointer; no chunk is read
    _check([recv, *bases, *outs])
    base_dtype = bases[0].dtype
    pair = f"{_dtype_name(base_dtype)}_{_dtype_name(recv.dtype)}"
    vec = 4 if numel % 4 == 0 and _aligned([recv, *bases, *outs]) else 1
    seg_ptr, idx = chunk_segments(chunks_per_output)
    seg_t = to_device(torch.tensor(seg_ptr, dtype=torch.int64), device)
    idx_t = to_device(torch.tensor(idx or [0], dtype=torch.int64), device)
    grid = (_blocks(numel // vec, len(bases), device), len(bases))
    _launch("sparse_collectives.cu", f"reduce_{pair}_v{vec}", device, grid, (THREADS,),
            (_cp(_ptr_table(outs, device)), _cp(_ptr_table(bases, device)), _cp(recv), _cp(seg_t), _cp(idx_t),
             _i64(numel)))
    return list(outs)


def accumulate_rows(target: torch.Tensor, recv: torch.Tensor, target_rows: Sequence[int]) -> None:
    """Kernel of :func:`ds_hecate.comm.gpu.reference.accumulate_rows`: ``target[target_rows[i]] += recv[i]`` in
    fp32, i ascending, in place. Contract (checked by the caller,
    :class:`~ds_hecate.comm.gpu.device_ops.KernelDeviceOps`, as the other launchers' shapes are): ``target`` a
    float32 ``[n, numel]``, ``recv`` float32 or bfloat16 with at least ``len(target_rows)`` rows of ``numel``."""
    from .reference import accumulate_segments

    if not target_rows or target.numel() == 0:
        return
    _check([target, recv])
    numel = target.shape[1]
    rows, seg_ptr, idx = accumulate_segments(target_rows)
    if len(rows) > 65535:
        raise HecateError(f"accumulate_rows: {len(rows)} chunks in one launch; at most 65535 (grid.y)")
    # One pinned, non-blocking upload for the three index arrays: [rows | seg_ptr | chunk_idx].
    table = to_device(torch.tensor(rows + seg_ptr + idx, dtype=torch.int64), target.device)
    rows_t, seg_t, idx_t = table.split([len(rows), len(seg_ptr), len(idx)])
    vec = 4 if numel % 4 == 0 and _aligned([target]) and _aligned([recv], 4 * recv.element_size()) else 1
    grid = (_blocks(numel // vec, len(rows), target.device), len(rows))
    _launch("sparse_collectives.cu", f"accumulate_{_dtype_name(recv.dtype)}_v{vec}", target.device, grid,
            (THREADS,), (_cp(target), _cp(rows_t), _cp(recv), _cp(seg_t), _cp(idx_t), _i64(numel)))


# -- token movement ------------------------------------------------------------------------------------------
def expert_histogram(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Kernel of :func:`ds_hecate.comm.gpu.reference.expert_histogram` (``num_experts + 1`` int64 bins)."""
    import numpy
    idx = indices.reshape(-1).to(torch.int64).contiguous()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    if idx.numel() == 0:
        return counts
    _check([idx])
    sms = torch.cuda.get_device_properties(idx.device).multi_processor_count
    grid = (max(1, min(-(-idx.numel() // THREADS), 4 * sms)),)
    _launch("token_permute.cu", "expert_histogram", idx.device, grid, (THREADS,),
            (_cp(idx), _i64(idx.numel()), numpy.int32(num_experts), _cp(counts)), shared_mem=4 * (num_experts + 1))
    return counts


def _row_block(row_units: int):
    bx = 32
    while bx < row_units and bx < THREADS:
        bx *= 2
    return bx, THREADS // bx


def permute_rows(x: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Kernel of :func:`ds_hecate.comm.gpu.reference.permute_rows` (any dtype: rows are copied as bytes)."""
    x = x.contiguous()
    index = index.to(torch.int64).contiguous()
    rows = index.numel()
    if out is None:
        out = x.new_empty((rows,) + tuple(x.shape[1:]))
    if rows == 0 or x.numel() == 0:
        return out
    _check([x, out, index])
    row_bytes = x[0].numel() * x.element_size()
    unit = next(u for u in (16, 8, 4, 2, 1) if row_bytes % u == 0 and _aligned([x, out], u))
    xb, ob = x.view(-1).view(torch.uint8), out.view(-1).view(torch.uint8)
    bx, by = _row_block(row_bytes // unit)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (max(1, min(-(-rows // by), 32 * sms)),)
    _launch("token_permute.cu", f"permute_rows_u{unit}", x.device, grid, (bx, by),
            (_cp(xb), _cp(ob), _cp(index), _i64(rows), _i64(row_bytes // unit)))
    return out


def unpermute_combine(y: torch.Tensor, pos: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Kernel of :func:`ds_hecate.comm.gpu.reference.unpermute_combine`: ``[S, H]`` in ``y.dtype``."""
    import numpy
    k, num_tokens = gates.shape
    hidden = y.shape[-1]
    y = y.contiguous()
    pos = pos.reshape(-1).to(torch.int64).contiguous()
    g = gates.to(torch.float32).contiguous()
    out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    if num_tokens == 0 or hidden == 0:
        return out
    if y.numel() == 0:
        y = torch.zeros(1, hidden, dtype=y.dtype, device=y.device)  # every slot dropped: a valid pointer
    _check([y, pos, g, out])
    vec = 4 if hidden % 4 == 0 and _aligned([y, out], 4 * y.element_size()) else 1
    bx, by = _row_block(hidden // vec)
    sms = torch.cuda.get_device_properties(y.device).multi_processor_count
    grid = (max(1, min(-(-num_tokens // by), 32 * sms)),)
    _launch("token_permute.cu", f"unpermute_combine_{_dtype_name(y.dtype)}_v{vec}", y.device, grid, (bx, by),
            (_cp(y), _cp(pos), _cp(g), _cp(out), _i64(num_tokens), numpy.int32(k), _i64(hidden)))
    return out
