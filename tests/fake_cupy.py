"""A stand-in for CuPy on the CPU, so the GPU path's own code runs in CPU CI: ds_hecate's kernel launchers
(:mod:`ds_hecate.comm.gpu.kernels`), the probes (:mod:`ds_hecate.comm.gpu.backend`) and the CuPy+NCCL transport
(:mod:`ds_hecate.comm.gpu.nccl_comm`), under the CUDA stand-in of tests/device_shim.py.

- ``cupy.RawModule(code=...)`` reads the kernels' CUDA source (its function-like macros expanded) and
  ``get_function(name)`` gives a kernel only if the source defines it, with the parameter list the source declares.
- A launch checks what the GPU would refuse or get wrong: the argument count and each argument's kind against the
  declaration (a device array for a pointer, one of ``numpy.int64`` / ``numpy.int32`` for ``long long`` / ``int``,
  a table of int64 addresses for a pointer to pointers), element sizes, the grid's y limit, the block against the
  kernels' launch bounds, a vector variant's alignment and divisibility, and every element it reads or writes
  through an array it was given lying inside that array (a pointer table's entries point into tensors the launch
  is not given, so only their alignment is checked). Then it computes what the kernel computes, by its torch contract
  (:mod:`ds_hecate.comm.gpu.reference`) on the memory at the addresses it was given (host memory under the
  stand-in): a launcher that hands in the wrong pointer, offset, count or table gets wrong numbers, as on a GPU.
- ``cupy.cuda``: one device, streams that are handles, ``runtime.getDeviceCount``, and ``nccl``
  (:class:`gpu_fakes.FakeNccl`: one rank loops back, several go over gloo).

What this cannot check is the CUDA C itself (its arithmetic, its vector loads): tests/test_kernels.py compiles
it with nvcc, and only a GPU runs it (tests/gpu on a GPU, ``make gpu-check``).

:func:`gpu_stand_in` enters the CUDA stand-in with this CuPy installed: on a machine without a GPU, CuPy, the
kernels and NCCL then all answer as usable, and run.
"""
from __future__ import annotations

import contextlib
import re
import sys
import types
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy
import torch

from gpu_fakes import FakeNccl, host_view

#: bytes per element of the C element types the kernels declare (the byte-copy kernels' vector types included)
C_SIZES = {"float": 4, "bf16_t": 2, "long long": 8, "unsigned long long": 8, "int": 4, "uint4": 16, "uint2": 8,
           "unsigned int": 4, "unsigned short": 2, "unsigned char": 1}
#: the numpy scalar type a by-value parameter takes
SCALARS = {"long long": numpy.int64, "int": numpy.int32}
#: the torch dtype of a kernel name's dtype part
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
MAX_GRID_Y = 65535
MAX_SHARED_BYTES = 48 * 1024


class Param:
    """One declared kernel parameter: its C element type and pointer depth (0: by value)."""

    def __init__(self, decl: str) -> None:
        words = decl.replace("*", " * ").replace("const", " ").replace("__restrict__", " ").split()
        self.depth = words.count("*")
        self.name = words[-1]
        self.ctype = " ".join(w for w in words[:-1] if w != "*")

    def __repr__(self) -> str:
        return f"{self.ctype}{'*' * self.depth} {self.name}"


def expand_macros(source: str) -> str:
    """The source with its function-like macros (``#define NAME(a, b) body``, continuation lines, ``##``) expanded
    where they are invoked at the start of a line: how the kernels' variants are stamped out."""
    joined = re.sub(r"\\\n", " ", source)
    macros: Dict[str, Tuple[List[str], str]] = {}
    kept = []
    for line in joined.splitlines():
        m = re.match(r"\s*#define\s+(\w+)\(([^)]*)\)\s*(.*)$", line)
        if m:
            macros[m.group(1)] = ([p.strip() for p in m.group(2).split(",")], m.group(3))
        else:
            kept.append(line)
    out = []
    for line in kept:
        m = re.match(r"\s*(\w+)\((.*)\)\s*;?\s*$", line)
        if m and m.group(1) in macros:
            params, body = macros[m.group(1)]
            args = [a.strip() for a in m.group(2).split(",")]
            for p, a in sorted(zip(params, args), key=lambda pa: -len(pa[0])):
                body = re.sub(rf"\b{p}\b", a, body)
            line = body.replace("##", "")
        out.append(line)
    return "\n".join(out)


def kernel_signatures(source: str) -> Dict[str, List[Param]]:
    """Every ``extern "C" __global__`` kernel of ``source`` with its parameters."""
    expanded = expand_macros(source)
    found = re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\(\w+\)\s*)?(\w+)\s*\(([^)]*)\)',
                       expanded)
    return {name: [Param(d) for d in params.split(",") if d.strip()] for name, params in found}


def launch_bound(source: str) -> int:
    m = re.search(r"#define\s+HECATE_THREADS\s+(\d+)", source)
    return int(m.group(1)) if m else 1024


class FakeArray:
    """``cupy.asarray`` of a torch "CUDA" tensor: its address, element type and extent."""

    def __init__(self, tensor: torch.Tensor) -> None:
        inner = getattr(tensor, "inner", tensor)
        if inner.device.type != "cpu" or not inner.is_contiguous():
            raise ValueError(f"cupy stand-in: asarray of a tensor on {inner.device}, contiguous="
                             f"{inner.is_contiguous()}")
        self.tensor = inner
        self.ptr = inner.data_ptr()
        self.dtype = inner.dtype
        self.size = inner.numel()
        self.nbytes = self.size * inner.element_size()

    def values(self) -> List[int]:
        return self.tensor.tolist()


class Memory:
    """The arrays a launch was given: element views at addresses, checked to lie inside one of them."""

    def __init__(self, arrays: Sequence[FakeArray]) -> None:
        self.extents = [(a.ptr, a.ptr + a.nbytes) for a in arrays]

    def view(self, ptr: int, count: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if count and not any(lo <= ptr and ptr + nbytes <= hi for lo, hi in self.extents):
            raise RuntimeError(f"cupy stand-in: {what} reads or writes {nbytes} bytes at {ptr:#x}, outside every "
                               "array the launch was given (an illegal address on a GPU)")
        return host_view(ptr, count, dtype)


def _aligned(ptr: int, nbytes: int, what: str, kernel: str) -> None:
    if ptr % nbytes:
        raise RuntimeError(f"cupy stand-in: {kernel}: {what} at {ptr:#x} is not {nbytes}-byte aligned (a vector "
                           "access there is a misaligned address on a GPU)")


class FakeKernel:
    """One kernel of a :class:`FakeRawModule`: a launch checks its arguments and computes the kernel's contract."""

    def __init__(self, name: str, params: List[Param], threads: int, registry: "Registry") -> None:
        self.name, self.params, self.threads, self.registry = name, params, threads, registry

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        self._check(tuple(grid), tuple(block), tuple(args), shared_mem)
        self.registry.launches[self.name] = self.registry.launches.get(self.name, 0) + 1
        family = next(k for k in sorted(EMULATORS, key=len, reverse=True)
                      if self.name == k or self.name.startswith(k + "_"))
        EMULATORS[family](self, tuple(grid), tuple(args), shared_mem)

    def _check(self, grid, block, args, shared_mem: int) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"cupy stand-in: {self.name} takes {len(self.params)} arguments {self.params}, the "
                            f"launch gave {len(args)}")
        for p, a in zip(self.params, args):
            if p.depth == 0:
                want = SCALARS.get(p.ctype)
                if want is None or type(a) is not want:
                    needed = want.__name__ if want is not None else p.ctype
                    raise TypeError(f"cupy stand-in: {self.name}: parameter {p!r} needs a {needed}, got "
                                    f"{type(a).__name__}")
            elif not isinstance(a, FakeArray):
                raise TypeError(f"cupy stand-in: {self.name}: parameter {p!r} needs a device array, got "
                                f"{type(a).__name__}")
            elif p.depth == 2 and a.dtype != torch.int64:
                raise TypeError(f"cupy stand-in: {self.name}: parameter {p!r} needs a table of int64 addresses, "
                                f"got {a.dtype}")
            elif p.depth == 1 and p.ctype in ("float", "bf16_t", "long long", "unsigned long long", "int") \
                    and a.tensor.element_size() != C_SIZES[p.ctype]:
                raise TypeError(f"cupy stand-in: {self.name}: parameter {p!r} ({C_SIZES[p.ctype]}-byte elements) "
                                f"got a {a.dtype} array")
        threads = 1
        for b in block:
            threads *= int(b)
        if not 1 <= threads <= self.threads or len(block) > 3:
            raise RuntimeError(f"cupy stand-in: {self.name}: block {block} has {threads} threads, the kernel's "
                               f"launch bounds allow {self.threads}")
        if len(grid) > 3 or any(int(g) < 1 for g in grid) or (len(grid) > 1 and grid[1] > MAX_GRID_Y):
            raise RuntimeError(f"cupy stand-in: {self.name}: invalid grid {grid}")
        if shared_mem > MAX_SHARED_BYTES:
            raise RuntimeError(f"cupy stand-in: {self.name}: {shared_mem} bytes of shared memory")


def _vec(kernel: FakeKernel) -> int:
    return int(kernel.name.rsplit("_v", 1)[1])


def _emulate_copy(kernel: FakeKernel, grid, args, shared_mem: int) -> None:
    """``pack_<in>_<out>_v<V>(srcs**, dst*, numel)`` / ``unpack_<in>_<out>_v<V>(src*, dsts**, numel)``."""
    op, pair = kernel.name.split("_", 1)
    in_name, out_name = pair.rsplit("_v", 1)[0].split("_")
    src_t, dst_t = DTYPES[in_name], DTYPES[out_name]
    table, flat, numel = (args[0], args[1], int(args[2])) if op == "pack" else (args[1], args[0], int(args[2]))
    chunks, vec = grid[1] if len(grid) > 1 else 1, _vec(kernel)
    pointers = table.values()
    if len(pointers) < chunks:
        raise RuntimeError(f"cupy stand-in: {kernel.name}: grid.y {chunks} > {len(pointers)} table entries")
    if vec > 1 and numel % vec:
        raise RuntimeError(f"cupy stand-in: {kernel.name}: numel {numel} is not a multiple of {vec}")
    flat_t = src_t if op == "unpack" else dst_t
    item = {src_t: src_t.itemsize, dst_t: dst_t.itemsize}
    mem = Memory([flat])
    for c in range(chunks):
        flat_ptr = flat.ptr + c * numel * flat_t.itemsize
        chunk = mem.view(flat_ptr, numel, flat_t, f"chunk {c} of the flat buffer")
        other_t = dst_t if op == "unpack" else src_t
        other = host_view(pointers[c], numel, other_t)
        if vec > 1:
            _aligned(flat_ptr, vec * item[flat_t], f"chunk {c} of the flat buffer", kernel.name)
            _aligned(pointers[c], vec * item[other_t], f"chunk {c}'s pointer", kernel.name)
        if op == "pack":
            chunk.copy_(other.to(dst_t))
        else:
            other.copy_(chunk.to(dst_t))


def _csr(args_seg: FakeArray, args_idx: FakeArray, outputs: int, kernel: FakeKernel) -> Tuple[List[int], List[int]]:
    seg, idx = args_seg.values(), args_idx.values()
    if len(seg) < outputs + 1:
        raise RuntimeError(f"cupy stand-in: {kernel.name}: {outputs} outputs, seg_ptr has {len(seg)} entries")
    if seg[outputs] > len(idx):
        raise RuntimeError(f"cupy stand-in: {kernel.name}: seg_ptr ends at {seg[outputs]}, chunk_idx has "
                           f"{len(idx)} entries")
    return seg, idx


def _emulate_reduce(kernel: FakeKernel, grid, args, shared_mem: int) -> None:
    """``reduce_<base>_<recv>_v<V>(outs**, bases**, recv*, seg_ptr*, chunk_idx*, numel)``."""
    base_name, recv_name = kernel.name.split("_")[1:3]
    base_t, recv_t = DTYPES[base_name], DTYPES[recv_name.split("_v")[0]]
    outs, bases, recv, seg_a, idx_a, numel = args[0], args[1], args[2], args[3], args[4], int(args[5])
    outputs, vec = grid[1] if len(grid) > 1 else 1, _vec(kernel)
    seg, idx = _csr(seg_a, idx_a, outputs, kernel)
    out_ptrs, base_ptrs = outs.values(), bases.values()
    mem = Memory([recv])
    if vec > 1 and numel % vec:
        raise RuntimeError(f"cupy stand-in: {kernel.name}: numel {numel} is not a multiple of {vec}")
    for j in range(outputs):
        base = host_view(base_ptrs[j], numel, base_t)
        total = base.to(torch.float32)
        for s in range(seg[j], seg[j + 1]):
            ptr = recv.ptr + idx[s] * numel * recv_t.itemsize
            if vec > 1:
                _aligned(ptr, vec * recv_t.itemsize, f"received chunk {idx[s]}", kernel.name)
            total = total + mem.view(ptr, numel, recv_t, f"received chunk {idx[s]}").to(torch.float32)
        if vec > 1:
            _aligned(out_ptrs[j], vec * 4, f"outs[{j}]", kernel.name)
            _aligned(base_ptrs[j], vec * base_t.itemsize, f"bases[{j}]", kernel.name)
        host_view(out_ptrs[j], numel, torch.float32).copy_(total)


def _emulate_accumulate(kernel: FakeKernel, grid, args, shared_mem: int) -> None:
    """``accumulate_<wire>_v<V>(target*, rows*, recv*, seg_ptr*, chunk_idx*, numel)``."""
    recv_t = DTYPES[kernel.name.split("_")[1]]
    target, rows_a, recv, seg_a, idx_a, numel = args[0], args[1], args[2], args[3], args[4], int(args[5])
    outputs, vec = grid[1] if len(grid) > 1 else 1, _vec(kernel)
    seg, idx = _csr(seg_a, idx_a, outputs, kernel)
    rows = rows_a.values()
    mem = Memory([target, recv])
    if vec > 1 and numel % vec:
        raise RuntimeError(f"cupy stand-in: {kernel.name}: numel {numel} is not a multiple of {vec}")
    for j in range(outputs):
        ptr = target.ptr + rows[j] * numel * 4
        if vec > 1:
            _aligned(ptr, vec * 4, f"target row {rows[j]}", kernel.name)
        row = mem.view(ptr, numel, torch.float32, f"target row {rows[j]}")
        for s in range(seg[j], seg[j + 1]):
            src = recv.ptr + idx[s] * numel * recv_t.itemsize
            if vec > 1:
                _aligned(src, vec * recv_t.itemsize, f"received row {idx[s]}", kernel.name)
            row.add_(mem.view(src, numel, recv_t, f"received row {idx[s]}").to(torch.float32))


def _emulate_histogram(kernel: FakeKernel, grid, args, shared_mem: int) -> None:
    """``expert_histogram(idx*, n, num_experts, counts*)``: ``num_experts + 1`` bins in shared memory."""
    from ds_hecate.comm.gpu import reference
    idx, n, num_experts, counts = args[0], int(args[1]), int(args[2]), args[3]
    if shared_mem < 4 * (num_experts + 1):
        raise RuntimeError(f"cupy stand-in: expert_histogram: {shared_mem} bytes of shared memory for "
                           f"{num_experts + 1} bins")
    if n > idx.size or counts.size < num_experts + 1:
        raise RuntimeError(f"cupy stand-in: expert_histogram: n {n} of {idx.size} indices, {counts.size} bins for "
                           f"{num_experts} experts")
    counts.tensor[:num_experts + 1] += reference.expert_histogram(idx.tensor[:n], num_experts)


def _emulate_permute(kernel: FakeKernel, grid, args, shared_mem: int) -> None:
    """``permute_rows_u<B>(x*, out*, index*, rows, row_units)``: row r of ``out`` = row ``index[r]`` of ``x``, as
    bytes (``row_units`` units of B bytes per row)."""
    unit = int(kernel.name.rsplit("_u", 1)[1])
    x, out, index, rows, units = args[0], args[1], args[2], int(args[3]), int(args[4])
    row_bytes = units * unit
    _aligned(x.ptr, unit, "x", kernel.name)
    _aligned(out.ptr, unit, "out", kernel.name)
    if rows > index.size or rows * row_bytes > out.nbytes:
        raise RuntimeError(f"cupy stand-in: {kernel.name}: {rows} rows of {row_bytes} bytes, out has {out.nbytes} "
                           f"bytes, index {index.size} entries")
    picks = index.tensor[:rows]
    if rows and (int(picks.min()) < 0 or (int(picks.max()) + 1) * row_bytes > x.nbytes):
        raise RuntimeError(f"cupy stand-in: {kernel.name}: an index outside x's {x.nbytes // row_bytes} rows")
    xb = host_view(x.ptr, x.nbytes // row_bytes * row_bytes, torch.uint8).view(-1, row_bytes)
    host_view(out.ptr, rows * row_bytes, torch.uint8).view(rows, row_bytes).copy_(xb.index_select(0, picks))


def _emulate_combine(kernel: FakeKernel, grid, args, shared_mem: int) -> None:
    """``unpermute_combine_<T>_v<V>(y*, pos*, gates*, out*, num_tokens, k, hidden)``."""
    from ds_hecate.comm.gpu import reference
    dtype, vec = DTYPES[kernel.name.split("_")[2]], _vec(kernel)
    y, pos, gates, out = args[0], args[1], args[2], args[3]
    num_tokens, k, hidden = int(args[4]), int(args[5]), int(args[6])
    if vec > 1:
        if hidden % vec:
            raise RuntimeError(f"cupy stand-in: {kernel.name}: hidden {hidden} is not a multiple of {vec}")
        _aligned(y.ptr, vec * dtype.itemsize, "y", kernel.name)
        _aligned(out.ptr, vec * dtype.itemsize, "out", kernel.name)
    if pos.size < k * num_tokens or gates.size < k * num_tokens or out.size < num_tokens * hidden:
        raise RuntimeError(f"cupy stand-in: {kernel.name}: {k} x {num_tokens} slots of width {hidden}: pos "
                           f"{pos.size}, gates {gates.size}, out {out.size} elements")
    y_rows = y.size // hidden
    slots = pos.tensor[:k * num_tokens]
    if slots.numel() and int(slots.max()) >= y_rows:
        raise RuntimeError(f"cupy stand-in: {kernel.name}: a slot points past y's {y_rows} rows")
    ys = host_view(y.ptr, y_rows * hidden, dtype).view(y_rows, hidden)
    result = reference.unpermute_combine(ys, slots, gates.tensor[:k * num_tokens].view(k, num_tokens))
    host_view(out.ptr, num_tokens * hidden, dtype).copy_(result.reshape(-1))


EMULATORS = {"pack": _emulate_copy, "unpack": _emulate_copy, "reduce": _emulate_reduce,
             "accumulate": _emulate_accumulate, "expert_histogram": _emulate_histogram, "permute": _emulate_permute,
             "permute_rows": _emulate_permute, "unpermute_combine": _emulate_combine}


class Registry:
    """What the stand-in CuPy saw: launches per kernel."""

    def __init__(self) -> None:
        self.launches: Dict[str, int] = {}


class FakeRawModule:
    def __init__(self, registry: Registry, code: str, options: Tuple[str, ...] = ()) -> None:
        self.registry = registry
        self.signatures = kernel_signatures(code)
        self.threads = launch_bound(code)

    def get_function(self, name: str) -> FakeKernel:
        if name not in self.signatures:
            raise RuntimeError(f"cupy stand-in: the module defines no kernel {name!r} (CUDA_ERROR_NOT_FOUND)")
        return FakeKernel(name, self.signatures[name], self.threads, self.registry)


def make_cupy(registry: Registry) -> types.ModuleType:
    """The ``cupy`` module stand-in (with ``cupy.cuda`` and ``cupy.cuda.nccl``)."""
    cupy: Any = types.ModuleType("cupy")
    cuda: Any = types.ModuleType("cupy.cuda")
    cupy.__version__ = "stand-in"

    def asarray(t: torch.Tensor) -> FakeArray:
        return FakeArray(t)

    class Device(contextlib.nullcontext):
        def __init__(self, index: int = 0) -> None:
            super().__init__()
            if int(index) != 0:
                raise RuntimeError(f"cupy stand-in: one device, not {index}")

    class ExternalStream(contextlib.nullcontext):
        def __init__(self, handle: int) -> None:
            super().__init__()
            self.ptr = handle

    class Stream:   # no from_external: the launcher falls back to ExternalStream, as with an older CuPy
        pass

    cupy.asarray = asarray
    cupy.RawModule = lambda code, options=(): FakeRawModule(registry, code, tuple(options))
    cuda.Device, cuda.ExternalStream, cuda.Stream = Device, ExternalStream, Stream
    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, deviceGetAttribute=lambda attr, index: 0)
    cuda.nccl = FakeNccl()
    cupy.cuda = cuda
    cupy.stand_in = registry
    return cupy


def _clear_caches() -> None:
    from ds_hecate.comm.gpu import backend, kernels
    for fn in (kernels._module, kernels._function, kernels._stream_protocol_works, backend.cupy_status,
               backend.kernels_status):
        getattr(fn, "cache_clear", lambda: None)()   # (the CUDA stand-in may have replaced a probe)


@contextlib.contextmanager
def fake_cupy() -> Iterator[types.ModuleType]:
    """``import cupy`` gives the stand-in inside the block (its probes' caches cleared on entry and exit)."""
    registry = Registry()
    module = make_cupy(registry)
    saved = {name: sys.modules.get(name) for name in ("cupy", "cupy.cuda", "cupy.cuda.nccl")}
    sys.modules.update({"cupy": module, "cupy.cuda": module.cuda, "cupy.cuda.nccl": module.cuda.nccl})
    _clear_caches()
    try:
        yield module
    finally:
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value
        _clear_caches()


@contextlib.contextmanager
def gpu_stand_in(kernels: bool = True) -> Iterator[types.SimpleNamespace]:
    """The CUDA stand-in (tests/device_shim.py) with the CuPy stand-in: the GPU path runs as on a machine with one
    GPU, CuPy and NCCL (``kernels``: the kernels' probe answers usable; False leaves the shim's answer, torch ops).
    Yields the shim (``.shim``) and the CuPy stand-in (``.cupy``, whose ``stand_in.launches`` counts launches)."""
    from device_shim import cuda_shim
    from ds_hecate.comm.gpu import backend
    probe = backend.kernels_status
    with cuda_shim() as shim, fake_cupy() as cupy:
        if kernels:
            backend.kernels_status = probe   # the shim says the kernels cannot take its tensors; these can
        getattr(probe, "cache_clear", lambda: None)()
        try:
            yield types.SimpleNamespace(shim=shim, cupy=cupy)
        finally:
            getattr(probe, "cache_clear", lambda: None)()


def launches(module: Optional[types.ModuleType] = None) -> Dict[str, int]:
    """Kernel launches the active CuPy stand-in has run, by kernel name."""
    module = module if module is not None else sys.modules.get("cupy")
    registry = getattr(module, "stand_in", None)
    return dict(registry.launches) if registry is not None else {}
