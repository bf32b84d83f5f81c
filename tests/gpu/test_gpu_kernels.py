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
    assert torch.equal(got, want)   # products rounded, then added in route order, no FMA: bit for bit for any k


@pytest.mark.parametrize("numel, offset", [(4096, 0), (1001, 0), (4096, 1)])
@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_accumulate(numel, offset, wire):
    """The in-place owner-side sum (vectorised, scalar and unaligned variants), repeated rows included, bit for
    bit against its contract (and so against the torch DeviceOps, tests/test_kernels.py)."""
    torch.manual_seed(5)
    rows = [3, 0, 3, 1, 3, 0, 2]
    base = torch.randn(len(rows) * numel + offset, device=DEV).to(wire)
    recv = base.narrow(0, offset, len(rows) * numel).view(len(rows), numel)   # offset: unaligned received rows
    storage = torch.randn(4 * numel + offset, device=DEV)
    target = storage.narrow(0, offset, 4 * numel).view(4, numel)   # offset: an unaligned accumulator
    want = target.clone()
    ref.accumulate_rows(want, recv, rows)
    K.accumulate_rows(target, recv, rows)
    assert torch.equal(target, want)


def test_kernel_device_ops_on_cuda_match_the_torch_device_ops():
    """What the CuPy transport runs in training: every op through the kernels (none fell back), equal to the torch
    statement (pack, accumulate) and to the layer call's torch combine."""
    from ds_hecate.comm.gpu.device_ops import KernelDeviceOps
    from ds_hecate.comm.transport import TORCH_DEVICE_OPS
    from ds_hecate.ops.combine import weighted_unpermute
    ops = KernelDeviceOps()
    torch.manual_seed(6)
    srcs = [torch.randn(3000, device=DEV) for _ in range(6)]
    for dtype in (torch.float32, torch.bfloat16):
        got, want = (torch.empty(6, 3000, dtype=dtype, device=DEV) for _ in range(2))
        ops.pack(srcs, got)
        TORCH_DEVICE_OPS.pack(srcs, want)
        assert torch.equal(got, want)
    rows = [0, 2, 0, 1, 0]
    for wire in (torch.float32, torch.bfloat16):
        recv = torch.randn(5, 3000, device=DEV).to(wire)
        got, want = torch.zeros(3, 3000, device=DEV), torch.zeros(3, 3000, device=DEV)
        ops.accumulate(got, recv, rows)
        TORCH_DEVICE_OPS.accumulate(want, recv, rows)
        assert torch.equal(got, want)
    k, tokens, hidden = 2, 700, 256
    y = torch.cat([torch.randn(k * tokens - 9, hidden, device=DEV), torch.zeros(1, hidden, device=DEV)])
    y = y.to(torch.bfloat16)
    pos = torch.randperm(k * tokens, device=DEV) % y.shape[0]
    gates = torch.rand(k, tokens, device=DEV)
    want = weighted_unpermute(y, gates, pos.view(k, tokens), "deepspeed")
    got = weighted_unpermute(y, gates, pos.view(k, tokens), "deepspeed", ops.combine)
    assert torch.equal(got, want)
    assert ops.used == {"pack": 2, "accumulate": 2, "combine": 1}, ops.used
