"""The CuPy transport's device work: the sparse collectives' pack and owner-side sum, and the layer call's weighted
un-permute, as the CUDA kernels of ``kernels/*.cu`` (:mod:`ds_hecate.comm.gpu.kernels`).

:class:`KernelDeviceOps` has the contract of :class:`ds_hecate.comm.transport.DeviceOps` (the torch statement, which
stays the CPU path) and the kernels' contracts in :mod:`ds_hecate.comm.gpu.reference`. Each call runs its kernel
when the kernels can take the operands (CUDA tensors, float32 or bfloat16, contiguous, one device) and falls back
to the torch statement otherwise (float16, a CPU tensor, a strided view): same results either way, so the choice
never changes training. The kernels pick their vectorised or scalar variant from the operands' alignment
themselves. Everything runs on the caller's current stream; the host builds the small index tables and uploads
them pinned and non-blocking (never a host stall).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..transport import DeviceOps
from . import kernels as _kernels
from . import reference as _reference

#: at most this many chunks (grid.y) in one pack launch
MAX_CHUNKS = 65535


class KernelDeviceOps(DeviceOps):
    """:class:`~ds_hecate.comm.transport.DeviceOps` with the CuPy raw kernels; the torch statement as fallback.

    ``launchers`` (default :mod:`ds_hecate.comm.gpu.kernels`) provides ``supports``, ``pack_chunks``,
    ``accumulate_rows`` and ``unpermute_combine``; the CPU tests and the GPU check's dry run hand in the torch
    references under the CUDA stand-in. ``used`` counts, per operation, the calls the kernels ran and the calls
    that fell back (``"pack"`` / ``"pack:torch"``, ...), for tests and the benchmarks.
    """

    def __init__(self, launchers: Optional[Any] = None) -> None:
        self.launchers = launchers if launchers is not None else _kernels
        self.used: dict = {}

    def _count(self, what: str) -> None:
        self.used[what] = self.used.get(what, 0) + 1

    def _takes(self, tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
        return all(t.is_cuda and t.device == device and t.is_contiguous() and self.launchers.supports(t.dtype)
                   for t in tensors)

    def pack(self, srcs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """``out[i] = srcs[i]`` flattened and cast (``pack_<in>_<out>`` kernel, one launch for every chunk)."""
        if not srcs:
            return
        numel = out.shape[1] if out.dim() == 2 else out.numel() // len(srcs)
        if (len(srcs) <= MAX_CHUNKS and self._takes([out, *srcs], out.device)
                and len({s.dtype for s in srcs}) == 1 and all(s.numel() == numel for s in srcs)):
            self._count("pack")
            self.launchers.pack_chunks(srcs, out.view(-1), numel)
            return
        self._count("pack:torch")
        super().pack(srcs, out)

    def accumulate(self, target: torch.Tensor, recv: torch.Tensor, target_rows: Sequence[int]) -> None:
        """``target[target_rows[i]] += recv[i]`` in fp32, i ascending (``accumulate_<wire>`` kernel: one block row
        per accumulator row, the adds in receive order, no atomics)."""
        if not target_rows:
            return
        if (target.dtype == torch.float32 and target.dim() == 2 and target.is_contiguous()
                and self._takes([target, recv], target.device)
                and recv.numel() >= len(target_rows) * target.shape[1] and recv.shape[-1] == target.shape[1]
                and len(set(target_rows)) <= MAX_CHUNKS):
            self._count("accumulate")
            self.launchers.accumulate_rows(target, recv, target_rows)
            return
        self._count("accumulate:torch")
        super().accumulate(target, recv, target_rows)

    def combine(self, y: torch.Tensor, pos: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``out[t] = sum_j gates[j, t] * y[pos[j*S + t]]`` in fp32, cast to ``y.dtype`` (``unpermute_combine``
        kernel; forward only, :class:`ds_hecate.ops.combine.WeightedUnpermute` does the backward)."""
        if self._takes([y], y.device) and pos.device == y.device and gates.device == y.device:
            self._count("combine")
            return self.launchers.unpermute_combine(y, pos, gates)
        self._count("combine:torch")
        return _reference.unpermute_combine(y, pos, gates)
