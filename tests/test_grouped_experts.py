"""``ops/grouped_experts.expert_outputs``: grouped GEMM and the per-expert loop give the same outputs and gradients
on the CPU (bit for bit for Linear-act-Linear in fp32 and bf16; SwiGLU's fused w1/w3 GEMM sums the input gradient's
two products inside one GEMM, so that one gradient may differ by a rounding), re-materialization's recomputing
backward equals autograd through the call, and the device rule picks between them. The training suites run
on the CPU with few experts per call, where the rule takes the loop; here both paths meet on every FFN form
(SwiGLU fused, Linear-act-Linear, biased, empty groups, unaligned operands), forced with DS_HECATE_GROUPED_MM."""
from __future__ import annotations

from typing import List

import pytest
import torch
from torch import nn

from ds_hecate.experts import ExpertKernel, SwiGLUExpert
from ds_hecate.ops import grouped_experts
from ds_hecate.ops.grouped_experts import (CPU_GROUPED_MIN_EXPERTS, RowGroups, expert_outputs, grouped_available,
                                          recomputed_expert_grads)

pytestmark = pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="torch without grouped_mm")


def _experts(kind: str, n: int, hidden: int = 32, ffn: int = 64) -> List[nn.Module]:
    torch.manual_seed(0)
    if kind == "swiglu":
        return [SwiGLUExpert(hidden, ffn) for _ in range(n)]
    if kind == "swiglu-bias":
        return [SwiGLUExpert(hidden, ffn, bias=True) for _ in range(n)]
    bias = kind == "linear-bias"
    return [nn.Sequential(nn.Linear(hidden, ffn, bias=bias), nn.GELU(), nn.Linear(ffn, hidden, bias=bias))
            for _ in range(n)]


def _run(kind: str, sizes: List[int], dtype: torch.dtype, mode: str, monkeypatch):
    """(grouped GEMM taken, output, row gradient, expert-buffer gradient) of one call in ``mode``."""
    monkeypatch.setenv(grouped_experts.GROUPED_MM_ENV, "1" if mode == "grouped" else "0")
    experts = _experts(kind, len(sizes))
    kernel = ExpertKernel(experts[0])
    buffer = torch.stack([kernel.flatten(e) for e in experts]).to(dtype).requires_grad_(True)
    torch.manual_seed(1)
    rows = torch.randn(sum(sizes), 32).to(dtype).requires_grad_(True)
    groups = RowGroups.build(sizes, rows.device)
    used = grouped_available(kernel, buffer)
    out = expert_outputs(kernel, buffer, rows, groups)
    grad_out = torch.randn_like(out)
    d_rows, d_buffer = torch.autograd.grad(out, (rows, buffer), grad_out)
    return used, out.detach(), d_rows, d_buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["swiglu", "linear"])
def test_grouped_equals_loop(kind, dtype, monkeypatch):
    sizes = [5, 0, 17, 1, 0, 9, 3, 12]   # empty groups included
    used_g, *grouped = _run(kind, sizes, dtype, "grouped", monkeypatch)
    used_l, *loop = _run(kind, sizes, dtype, "loop", monkeypatch)
    assert used_g and not used_l
    for a, b, what in zip(grouped, loop, ("output", "row gradient", "expert gradient")):
        if kind == "swiglu" and what == "row gradient":   # dx = dh1 W1 + dh3 W3 in one fused GEMM: one rounding
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
            torch.testing.assert_close(a, b, **tol)
        else:
            assert torch.equal(a, b), f"{kind} {dtype} {what}: max diff {(a.float() - b.float()).abs().max()}"


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


def test_unaligned_rows_fall_back_to_the_loop_with_the_same_result(monkeypatch):
    """Rows starting 1 element into their storage (not 16-byte aligned) cannot take grouped GEMM: the loop runs,
    bit for bit the loop's result on the same rows. (Against the loop on aligned rows it is equal only up to
    rounding where the CPU's GEMM picks its kernel by alignment, as on an avx512_bf16 Xeon without avx512_fp16.)"""
    sizes = [6, 2, 9]
    experts = _experts("swiglu", len(sizes))
    kernel = ExpertKernel(experts[0])
    buffer = torch.stack([kernel.flatten(e) for e in experts]).requires_grad_(True)
    torch.manual_seed(1)
    rows = torch.randn(sum(sizes), 32)
    storage = torch.empty(rows.numel() + 1)
    shifted = storage[1:].view(rows.shape)
    shifted.copy_(rows)
    shifted.requires_grad_(True)
    groups = RowGroups.build(sizes, shifted.device)
    outputs = {}
    for mode in ("0", "1"):   # the loop itself, then grouped GEMM asked for
        monkeypatch.setenv(grouped_experts.GROUPED_MM_ENV, mode)
        outputs[mode] = expert_outputs(kernel, buffer, shifted, groups).detach()
    assert torch.equal(outputs["1"], outputs["0"])
    _, aligned, _, _ = _run("swiglu", sizes, torch.float32, "loop", monkeypatch)
    torch.testing.assert_close(outputs["1"], aligned, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["grouped", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["swiglu", "linear-bias", "generic"])
def test_recomputed_gradients_equal_autograd_through_the_call(kind, dtype, mode, monkeypatch):
    """Re-materialization's backward (:func:`recomputed_expert_grads`: the loop one expert's gradient at a time,
    written into one buffer) gives exactly what autograd through :func:`expert_outputs` gives, in either mode, for
    the fast path and for a generic module; an expert without rows gets a zero gradient row."""
    monkeypatch.setenv(grouped_experts.GROUPED_MM_ENV, "1" if mode == "grouped" else "0")
    sizes = [3, 0, 8, 5]
    if kind == "generic":
        torch.manual_seed(0)
        experts = [nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.LayerNorm(64), nn.Linear(64, 32))
                   for _ in sizes]
    else:
        experts = _experts(kind, len(sizes))
    kernel = ExpertKernel(experts[0])
    assert (kernel.form is None) == (kind == "generic")
    buffer = torch.stack([kernel.flatten(e) for e in experts]).to(dtype)
    torch.manual_seed(1)
    rows = torch.randn(sum(sizes), 32).to(dtype)
    grad_out = torch.randn(sum(sizes), 32).to(dtype)
    groups = RowGroups.build(sizes, rows.device)
    b, r = buffer.clone().requires_grad_(True), rows.clone().requires_grad_(True)
    expected = torch.autograd.grad(expert_outputs(kernel, b, r, groups), (b, r), grad_out)
    for want_rows in (True, False):
        d_buffer, d_rows = recomputed_expert_grads(kernel, buffer, rows, groups, grad_out, want_rows)
        assert torch.equal(d_buffer, expected[0]), f"{kind} {dtype} {mode} expert gradient"
        assert (d_rows is None) != want_rows
        assert not want_rows or torch.equal(d_rows, expected[1]), f"{kind} {dtype} {mode} row gradient"
    assert not d_buffer[1].any()


def test_cpu_rule_takes_grouped_gemm_only_with_many_experts(monkeypatch):
    monkeypatch.delenv(grouped_experts.GROUPED_MM_ENV, raising=False)
    kernel = ExpertKernel(SwiGLUExpert(32, 48))
    few = torch.zeros(CPU_GROUPED_MIN_EXPERTS - 1, kernel.numel)
    many = torch.zeros(CPU_GROUPED_MIN_EXPERTS, kernel.numel)
    assert not grouped_available(kernel, few)
    assert grouped_available(kernel, many)
    monkeypatch.setenv(grouped_experts.GROUPED_MM_ENV, "1")
    assert grouped_available(kernel, few)
    monkeypatch.setenv(grouped_experts.GROUPED_MM_ENV, "0")
    assert not grouped_available(kernel, many)
