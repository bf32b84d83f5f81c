"""The expert compute's ops (``ops/grouped_ffn.py``, ``ops/group_gemm.py``, ``ops/grouped_experts.py``).

- The grouped FFN's written-out backward is autograd's, op for op: bit for bit the gradients autograd computes
  through the same forward on grouped GEMMs, for every written-out activation, gated or not, fused or not, biased,
  fp32 and bf16, with empty groups.
- Grouped GEMMs and the per-expert loop give the same outputs and gradients (bit for bit for Linear-act-Linear;
  SwiGLU's fused gate/up GEMM sums the input gradient's two products inside one GEMM, so that one gradient may
  differ by a rounding; the unfused grouped FFN is the loop bit for bit).
- Where ``F.grouped_mm`` would read its offsets on the host, the GEMMs loop over the host sizes instead, with the
  same bits; an expert with no rows gets a zero weight gradient whatever the grouped GEMM leaves in its slot.
"""
from __future__ import annotations


from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_hecate.experts import ExpertKernel, SwiGLUExpert
from ds_hecate.ops import group_gemm, grouped_experts
from ds_hecate.ops.group_gemm import RowGroups
from ds_hecate.ops.grouped_experts import expert_outputs, grouped_path
from ds_hecate.ops.grouped_ffn import GradPart, GroupedFFN

pytestmark = pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="torch without grouped_mm")


def _experts(kind: str, n: int, hidden: int = 32, ffn: int = 64) -> List[nn.Module]:
    torch.manual_seed(0)
    if kind == "swiglu":
        return [SwiGLUExpert(hidden, ffn) for _ in range(n)]
    if kind == "swiglu-bias":
        return [SwiGLUExpert(hidden, ffn, bias=True) for _ in range(n)]
    act = {"linear": nn.GELU, "linear-bias": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh, "silu": nn.SiLU}[kind]
    bias = kind == "linear-bias"
    return [nn.Sequential(nn.Linear(hidden, ffn, bias=bias), act(), nn.Linear(ffn, hidden, bias=bias))
            for _ in range(n)]


def _operands(kind: str, sizes: List[int], dtype: torch.dtype):
    experts = _experts(kind, len(sizes))
    kernel = ExpertKernel(experts[0])
    buffer = torch.stack([kernel.flatten(e) for e in experts]).to(dtype)
    torch.manual_seed(1)
    rows = torch.randn(sum(sizes), 32).to(dtype)
    grad_out = torch.randn(sum(sizes), 32).to(dtype)
    return kernel, buffer, rows, grad_out, RowGroups.build(sizes, rows.device)


def _run(kind: str, sizes: List[int], dtype: torch.dtype, mode: str, monkeypatch):
    """(grouped path taken, output, row gradient, expert-buffer gradient) of one call in ``mode``."""
    monkeypatch.setenv(grouped_experts.GROUPED_MM_ENV, "1" if mode == "grouped" else "0")
    kernel, buffer, rows, grad_out, groups = _operands(kind, sizes, dtype)
    buffer.requires_grad_(True)
    rows.requires_grad_(True)
    used = grouped_path(kernel, dtype)
    out = expert_outputs(kernel, buffer, rows, groups)
    d_rows, d_buffer = torch.autograd.grad(out, (rows, buffer), grad_out)
    return used, out.detach(), d_rows, d_buffer


def _autograd_reference(kernel: ExpertKernel, buffer: torch.Tensor, rows: torch.Tensor, groups: RowGroups,
                        grad_out: torch.Tensor, fuse: bool):
    """The same forward through autograd (grouped GEMMs, the row bias), and autograd's gradients."""
    b, r = buffer.clone().requires_grad_(True), rows.clone().requires_grad_(True)
    views = kernel.grouped_views(b, fuse)
    rows_of: List[torch.Tensor] = []

    def proj(h: torch.Tensor, name: str, bias) -> torch.Tensor:
        out = F.grouped_mm(h.contiguous(), views[name].transpose(1, 2), offs=groups.offs)
        return out if bias is None else group_gemm.add_row_bias(out, views[bias], groups, rows_of)
    assert kernel.form is not None
    out = kernel.form.run(proj, r, fuse)
    d_rows, d_buffer = torch.autograd.grad(out, (r, b), grad_out)
    return out.detach(), d_rows, d_buffer


class _Whole:
    """A GradTarget over a zero-filled ``[experts, numel]`` gradient, every contribution added."""

    def __init__(self, like: torch.Tensor) -> None:
        self.tensor = torch.zeros_like(like)

    def rows(self):
        return self.tensor

    def columns_view(self, lo, hi, shape):
        return self.tensor[:, lo:hi].view(self.tensor.shape[0], *shape)

    def is_fresh(self, name):
        return False

    def written(self, names=None):
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,fuse", [("swiglu", True), ("swiglu", False), ("swiglu-bias", False),
                                       ("linear", False), ("linear-bias", False), ("relu", False),
                                       ("tanh", False), ("silu", False)])
def test_written_out_backward_is_autograds_bit_for_bit(kind, fuse, dtype):
    """Every gradient GroupedFFN computes equals autograd's through the same grouped forward (the activations'
    own backward ops, ``mul``'s, ``chunk``'s ``cat``, the GEMMs' products), with an expert that has no rows."""
    kernel, buffer, rows, grad_out, groups = _operands(kind, [5, 0, 17, 1, 9], dtype)
    ffn = GroupedFFN(kernel, fuse=fuse)
    assert ffn.fuse == fuse
    views = kernel.grouped_views(buffer, ffn.fuse)
    out, saved = ffn.forward(views, rows, groups, native=True)
    target = _Whole(buffer)
    d_rows = ffn.backward(views, saved, grad_out, groups, GradPart(target, kernel), native=True, need_input=True)
    assert d_rows is not None
    ref_out, ref_rows, ref_buffer = _autograd_reference(kernel, buffer, rows, groups, grad_out, ffn.fuse)
    assert torch.equal(out, ref_out)
    assert torch.equal(d_rows, ref_rows), (d_rows - ref_rows).abs().max()
    assert torch.equal(target.tensor, ref_buffer), (target.tensor.float() - ref_buffer.float()).abs().max()
    assert not target.tensor[1].any()   # the expert without rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["swiglu", "linear"])
def test_grouped_equals_loop(kind, dtype, monkeypatch):
    sizes = [5, 0, 17, 1, 0, 9, 3, 12]   # empty groups included
    used_g, *grouped = _run(kind, sizes, dtype, "grouped", monkeypatch)
    used_l, *loop = _run(kind, sizes, dtype, "loop", monkeypatch)
    assert used_g and not used_l
    for a, b, what in zip(grouped, loop, ("output", "row gradient", "expert gradient")):
        if kind == "swiglu" and what == "row gradient":   # dx = dh1 W1 + dh3 W3 in one fused GEMM: one rounding
            tol: Dict[str, Any] = (dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32
                                   else dict(rtol=2 ** -7, atol=2 ** -7))
            torch.testing.assert_close(a, b, **tol)
        else:
            assert torch.equal(a, b), f"{kind} {dtype} {what}: max diff {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unfused_grouped_swiglu_is_the_loop_bit_for_bit(dtype, monkeypatch):
    """Gate and up apart, the grouped FFN computes what the per-expert loop computes, every gradient included."""
    sizes = [5, 0, 17, 1, 9]
    kernel, buffer, rows, grad_out, groups = _operands("swiglu", sizes, dtype)
    ffn = GroupedFFN(kernel, fuse=False)
    views = kernel.grouped_views(buffer, False)
    out, saved = ffn.forward(views, rows, groups, native=True)
    target = _Whole(buffer)
    d_rows = ffn.backward(views, saved, grad_out, groups, GradPart(target, kernel), native=True, need_input=True)
    assert d_rows is not None
    _, loop_out, loop_rows, loop_buffer = _run("swiglu", sizes, dtype, "loop", monkeypatch)
    assert torch.equal(out, loop_out) and torch.equal(d_rows, loop_rows) and torch.equal(target.tensor, loop_buffer)


@pytest.mark.parametrize("kind", ["swiglu-bias", "linear-bias"])
def test_grouped_biased_fp32_equals_loop(kind, monkeypatch):
    sizes = [4, 7, 0, 11]
    used_g, *grouped = _run(kind, sizes, torch.float32, "grouped", monkeypatch)
    _, *loop = _run(kind, sizes, torch.float32, "loop", monkeypatch)
    assert used_g
    for a, b in zip(grouped, loop):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_biased_half_precision_takes_the_loop(monkeypatch):
    used, *_ = _run("swiglu-bias", [3, 4], torch.bfloat16, "grouped", monkeypatch)
    assert not used


@pytest.mark.parametrize("kind", ["swiglu", "linear-bias"])
def test_gemms_over_the_host_sizes_equal_grouped_gemms(kind):
    """Without a native grouped GEMM (fp32 on CUDA, pre-Hopper GPUs, unaligned operands) the products loop over
    the host sizes: the same bits as the grouped GEMMs, which on the CPU loop over ``mm`` themselves."""
    kernel, buffer, rows, grad_out, groups = _operands(kind, [6, 0, 2, 9], torch.float32)
    results = []
    for native in (True, False):
        ffn = GroupedFFN(kernel)
        views = kernel.grouped_views(buffer, ffn.fuse)
        out, saved = ffn.forward(views, rows, groups, native)
        target = _Whole(buffer)
        d_rows = ffn.backward(views, saved, grad_out, groups, GradPart(target, kernel), native, need_input=True)
        results.append((out, d_rows, target.tensor))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_unaligned_rows_take_the_host_sized_gemms():
    """Rows starting 1 element into their storage (not 16-byte aligned) cannot take grouped GEMM."""
    from ds_hecate.ops.grouped_experts import native_for
    rows = torch.randn(33)[1:].view(4, 8)
    assert not native_for([rows]) and native_for([torch.randn(4, 8)])


def test_an_expert_without_rows_gets_a_zero_weight_gradient_whatever_grouped_mm_leaves(monkeypatch):
    """``F.grouped_mm`` leaves the product of a group without rows undefined on some GPUs (sm100 returns garbage,
    pytorch/pytorch#172439): the weight gradient of an expert this call routed nothing to must be zero when written
    and unchanged when added, whatever the GEMM put in its slot. A stand-in fills empty groups' products with NaN."""
    real = F.grouped_mm

    def garbage_for_empty_groups(a, b, offs=None, **kwargs):
        out = real(a, b, offs=offs, **kwargs)
        if out.dim() == 3:   # the weight-gradient form: one [out, in] product per group
            ends = offs.tolist()
            starts = [0] + ends[:-1]
            for e, (lo, hi) in enumerate(zip(starts, ends)):
                if hi == lo:
                    out[e] = float("nan")
        return out
    monkeypatch.setattr(F, "grouped_mm", garbage_for_empty_groups)
    sizes = [3, 0, 5]
    groups = RowGroups.build(sizes, torch.device("cpu"))
    grad, rows = torch.randn(8, 8), torch.randn(8, 4)
    written = torch.full((3, 8, 4), 7.0)
    group_gemm.weight_grads(grad, rows, groups, written, accumulate=False, native=True)
    assert torch.equal(written[1], torch.zeros(8, 4))
    added = torch.full((3, 8, 4), 7.0)
    group_gemm.weight_grads(grad, rows, groups, added, accumulate=True, native=True)
    assert torch.equal(added[1], torch.full((8, 4), 7.0))
    assert torch.isfinite(written).all() and torch.isfinite(added).all()
