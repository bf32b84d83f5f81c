"""Every CUDA kernel against its torch reference (ds_hecate.comm.gpu.reference) on the same inputs, both vectorised
and scalar variants (aligned / unaligned, divisible / odd sizes)."""
import pytest
import torch

from ds_hecate.comm.gpu import kernels as K
from ds_hecate.comm.gpu import reference as ref

DEV = "cuda"
PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
         (torch.bfloat16, torch.float32)]


def _chunks(n, numel, dtype, offset=0):
    base = torch.randn(n * (numel + offset) + offset, device=DEV).to(dtype)
    return [base.narrow(0, offset + i * (numel + offset), numel) for i in range(n)]  # offset>0: unaligned views


@pytest.mark.parametrize("numel, offset", [(4096, 0), (1000003, 0), (77, 0), (4096, 1)])
@pytest.mark.parametrize("src_dtype, dst_dtype", PAIRS)
def test_pack_unpack(numel, offset, src_dtype, dst_dtype):
    torch.manual_seed(0)
    srcs = _chunks(5, numel, src_dtype, offset)
    srcs[1][:3] = float("nan")
    out = torch.empty(5 * numel, dtype=dst_dtype, device=DEV)
    K.pack_chunks(srcs, out, numel)
    expected = ref.pack_chunks(srcs, dst_dtype, numel, torch.device(DEV))
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())
    dsts = _chunks(5, numel, src_dtype, offset)
    K.unpack_chunks(out, dsts, numel)
    want = _chunks(5, numel, src_dtype, offset)
    ref.unpack_chunks(out, want, numel)
    for a, b in zip(dsts, want):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("numel", [4096, 1001])
@pytest.mark.parametrize("base_dtype, wire_dtype", PAIRS)
def test_reduce(numel, base_dtype, wire_dtype):
    torch.manual_seed(1)
    bases = _chunks(4, numel, base_dtype)
    recv = torch.randn(7 * numel, device=DEV).to(wire_dtype)
    lists = [[0, 3, 5], [], [6, 1], [2, 4]]
    got = K.reduce_chunks(bases, recv, lists, numel)
    want = ref.reduce_chunks(bases, recv, lists, numel)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and torch.equal(a, b)  # same order, same roundings: bit for bit


@pytest.mark.parametrize("num_experts", [1, 8, 300])
def test_histogram(num_experts):
    idx = torch.randint(-1, num_experts + 3, (2, 100003), device=DEV)
    assert torch.equal(K.expert_histogram(idx, num_experts), ref.expert_histogram(idx, num_experts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("hidden", [1024, 7, 1])
def test_permute_rows(dtype, hidden):
    x = (torch.randn(513, hidden, device=DEV) * 50).to(dtype)
    index = torch.randint(0, 513, (2000,), device=DEV)
    assert torch.equal(K.permute_rows(x, index), ref.permute_rows(x, index))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, hidden", [(1, 512), (2, 1024), (2, 13), (4, 256)])
def test_unpermute_combine(dtype, k, hidden):
    torch.manual_seed(2)
    num_tokens = 3001
    pos = torch.randperm(k * num_tokens, device=DEV)
    pos[torch.rand(k * num_tokens, device=DEV) < 0.1] = -1  # dropped slots
    y = torch.randn(k * num_tokens, hidden, device=DEV).to(dtype)
    gates = torch.rand(k, num_tokens, device=DEV)
    got = K.unpermute_combine(y, pos, gates)
    want = ref.unpermute_combine(y, pos, gates)
    if k <= 2:  # a sum of two terms has one rounding order
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want)
