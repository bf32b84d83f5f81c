"""Pure-torch statements of the CUDA kernels' contracts (kernels/*.cu).

Each function here is what the matching kernel must compute, written the way the torch paths of ds_hecate compute
it (same dtypes, same summation order), so the CPU test suite can check the contracts against the existing code
paths and tests/gpu/ can compare kernel and reference on the same inputs. They also serve as the torch fallback of
:mod:`ds_hecate.comm.gpu.kernels` for CPU tensors.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def pack_chunks(srcs: Sequence[torch.Tensor], out_dtype: torch.dtype, numel: int,
                device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """Send buffer of SparseAllGather / SparseReduceScatter: chunk c = ``srcs[c]`` flattened, cast to ``out_dtype``.

    Kernel: ``pack_<in>_<out>_v<V>`` (one pointer per chunk, one contiguous output).
    """
    if not srcs:
        return torch.empty(0, dtype=out_dtype, device=device)
    for s in srcs:
        if s.numel() != numel:
            raise ValueError(f"pack_chunks: a chunk has {s.numel()} elements, expected {numel}")
    return torch.cat([s.reshape(-1).to(out_dtype) for s in srcs])


def unpack_chunks(buf: torch.Tensor, dsts: Sequence[torch.Tensor], numel: int) -> None:
    """Receive side: ``dsts[c]`` (any dtype, contiguous) = chunk c of the flat ``buf``, cast. In place.

    Kernel: ``unpack_<in>_<out>_v<V>``.
    """
    for c, d in enumerate(dsts):
        d.view(-1).copy_(buf.narrow(0, c * numel, numel))


def chunk_segments(chunks_per_output: Sequence[Sequence[int]]) -> Tuple[List[int], List[int]]:
    """CSR form of the reduce lists: (seg_ptr, chunk_idx), output j sums chunks chunk_idx[seg_ptr[j]:seg_ptr[j+1]]."""
    seg_ptr, idx = [0], []
    for chunks in chunks_per_output:
        idx.extend(int(c) for c in chunks)
        seg_ptr.append(len(idx))
    return seg_ptr, idx


def reduce_chunks(bases: Sequence[torch.Tensor], recv: torch.Tensor, chunks_per_output: Sequence[Sequence[int]],
                  numel: int) -> List[torch.Tensor]:
    """SparseReduceScatter on the owner: output j = fp32(bases[j]) + received chunks listed for j, added one at a
    time in fp32 in list order (the owner's own copy first, then by source rank), as
    :meth:`ds_hecate.comm.collectives.Communicator.start_sparse_reduce_scatter` does.

    Kernel: ``reduce_<base>_<wire>_v<V>`` (output always fp32).
    """
    outs = []
    for base, chunks in zip(bases, chunks_per_output):
        total = base.reshape(-1).to(torch.float32)
        for c in chunks:
            total = total + recv.narrow(0, int(c) * numel, numel).to(torch.float32)
        outs.append(total)
    return outs


def expert_histogram(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``num_experts + 1`` int64 bins: tokens per expert for 0 <= e < E, and in the last bin the count of indices
    >= E (out of range: the runtime's health flag). Negative indices are dropped slots and not counted.

    Kernel: ``expert_histogram``.
    """
    flat = indices.reshape(-1).long()
    valid = flat[flat >= 0]
    return torch.bincount(valid.clamp(max=num_experts), minlength=num_experts + 1)


def permute_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[index[r]]``: token rows into send order. Kernel: ``permute_rows_u<B>`` (byte copy)."""
    return x.index_select(0, index.long())


def slot_positions(send_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Inverse of the send order: position in the returned rows of each (route, token) slot, -1 if dropped."""
    pos = torch.full((num_slots,), -1, dtype=torch.long, device=send_slots.device)
    pos[send_slots.long()] = torch.arange(send_slots.numel(), device=send_slots.device)
    return pos


def unpermute_combine(y: torch.Tensor, pos: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Weighted un-permute with the top-k combine: ``out[t] = sum_j gates[j, t] * y[pos[j*S + t]]`` (0 for a dropped
    slot, ``pos < 0``), fp32 products and sum, cast to ``y.dtype``: the runtime's ``index_copy`` into slot order
    followed by :func:`ds_hecate.moe_layer.combine_routes` (DeepSpeed's ``_sparse_decode``).

    ``gates`` is ``[k, S]``; ``pos`` has ``k * S`` entries. Kernel: ``unpermute_combine_<dtype>_v<V>``.
    """
    k, num_tokens = gates.shape
    pos = pos.reshape(-1).long()
    valid = pos >= 0
    slots = y.new_zeros(k * num_tokens, y.shape[-1])
    slots[valid] = y.index_select(0, pos[valid])
    routed = slots.view(k, num_tokens, y.shape[-1])
    return (routed * gates.to(torch.float32).unsqueeze(-1)).sum(0).to(y.dtype)
