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
    seg_ptr: List[int] = [0]
    idx: List[int] = []
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


def accumulate_segments(target_rows: Sequence[int]) -> Tuple[List[int], List[int], List[int]]:
    """CSR form of ``target[target_rows[i]] += recv[i]``, grouped by target row: (rows, seg_ptr, chunk_idx), row
    ``rows[j]`` (distinct, in first-occurrence order) adds the received chunks ``chunk_idx[seg_ptr[j]:seg_ptr[j+1]]``
    (ascending: receive order). The host builds it; the kernel gets one row per block row, so no two blocks write
    one accumulator row and the order of the adds is the list's."""
    slot: dict = {}
    lists: List[List[int]] = []
    for i, t in enumerate(target_rows):
        j = slot.setdefault(int(t), len(lists))
        if j == len(lists):
            lists.append([])
        lists[j].append(i)
    seg_ptr, idx = chunk_segments(lists)
    return list(slot), seg_ptr, idx


def accumulate_rows(target: torch.Tensor, recv: torch.Tensor, target_rows: Sequence[int]) -> None:
    """SparseReduceScatter's in-place sum on the owner (:meth:`ds_hecate.comm.transport.DeviceOps.accumulate`):
    ``target[target_rows[i]] += fp32(recv[i])`` for i ascending (``target``: fp32 ``[n, numel]``, ``recv``: ``[m,
    numel]`` in fp32 or bf16), each add rounded in fp32, so an expert received from several ranks sums them in
    receive order (source rank ascending).

    Kernel: ``accumulate_<wire>_v<V>`` over :func:`accumulate_segments`.
    """
    rows, seg_ptr, idx = accumulate_segments(target_rows)
    for j, row in enumerate(rows):
        for c in idx[seg_ptr[j]:seg_ptr[j + 1]]:
            target[row].add_(recv[c].to(torch.float32))


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
    """Weighted un-permute with the top-k combine: ``out[t] = sum_j gates[j, t] * y[pos[j*S + t]]`` (``0 * gates[j,
    t]`` for a dropped slot, ``pos < 0``), each product rounded in fp32 and added in fp32 for j ascending, cast to
    ``y.dtype``: the runtime's weighted un-permute (:mod:`ds_hecate.ops.combine`, ``"deepspeed"`` arithmetic) and
    :func:`ds_hecate.moe_layer.combine_routes` (DeepSpeed's ``_sparse_decode``).

    ``gates`` is ``[k, S]``; ``pos`` has ``k * S`` entries. No host read: dropped slots point at a zero row appended
    to ``y``. Kernel: ``unpermute_combine_<dtype>_v<V>``.
    """
    k, num_tokens = gates.shape
    hidden = y.shape[-1]
    if k == 0:
        return y.new_zeros(num_tokens, hidden)
    rows = torch.cat([y.reshape(-1, hidden), y.new_zeros(1, hidden)])
    pos = pos.reshape(k, num_tokens).long()
    pos = torch.where(pos < 0, rows.shape[0] - 1, pos)
    out = None
    for j in range(k):
        term = rows.index_select(0, pos[j]).to(torch.float32) * gates[j].to(torch.float32).unsqueeze(-1)
        out = term if out is None else out.add_(term)
    assert out is not None   # k > 0 routes were added
    return out.to(y.dtype)
