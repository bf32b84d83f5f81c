"""Tests of ExpertKernel: running an expert from one flat parameter vector (fast FFN path and generic path)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_hecate.experts import ExpertKernel, SwiGLUExpert

HIDDEN, FFN = 12, 20
ATOL = 1e-6


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _module_grads_flat(module: nn.Module, kernel: ExpertKernel) -> torch.Tensor:
    """The module's .grad in the kernel's layout order (zeros for parameters that got no gradient)."""
    params = dict(module.named_parameters())
    parts = []
    for name in kernel.names:
        p = params[name]
        parts.append((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float32))
    return torch.cat(parts)


def _module_out(module, x):
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def check_kernel_matches_module(module: nn.Module, kind: str, x: torch.Tensor) -> ExpertKernel:
    kernel = ExpertKernel(module)
    assert kernel.kind == kind
    assert (kernel.kind, kernel.numel) == (kind, sum(p.numel() for p in module.parameters()))
    assert kernel.names == [n for n, _ in module.named_parameters()]

    flat = kernel.flatten(module)
    assert flat.dtype == torch.float32 and flat.dim() == 1 and flat.numel() == kernel.numel
    assert not flat.requires_grad

    # forward equality
    with torch.no_grad():
        expected = _module_out(module, x)
        got = kernel(flat, x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)

    # gradients flow into the flat vector and equal the module's parameter gradients
    upstream = torch.randn_like(expected)
    module.zero_grad(set_to_none=True)
    (_module_out(module, x) * upstream).sum().backward()
    expected_grad = _module_grads_flat(module, kernel)
    assert expected_grad.abs().sum() > 0

    leaf = flat.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    (kernel(leaf, x2) * upstream).sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == flat.shape
    torch.testing.assert_close(leaf.grad, expected_grad, atol=1e-5, rtol=1e-5)

    # gradient w.r.t. the input too
    x3 = x.clone().requires_grad_(True)
    (_module_out(module, x3) * upstream).sum().backward()
    torch.testing.assert_close(x2.grad, x3.grad, atol=1e-5, rtol=1e-5)
    return kernel


# ---------------------------------------------------------------------------------------------------------------
# Fast path
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", [nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Identity])
@pytest.mark.parametrize("bias1,bias2", [(True, True), (False, False), (True, False), (False, True)])
def test_linear_act_linear_fast_path(act, bias1, bias2):
    m = nn.Sequential(nn.Linear(HIDDEN, FFN, bias=bias1), act(), nn.Linear(FFN, HIDDEN, bias=bias2))
    x = torch.randn(7, HIDDEN)
    kernel = check_kernel_matches_module(m, "ffn", x)
    assert kernel.fast_path is not None
    expected_names = ["0.weight"] + (["0.bias"] if bias1 else []) + ["2.weight"] + (["2.bias"] if bias2 else [])
    assert kernel.names == expected_names


def test_fast_path_leading_batch_dims_and_empty_batch():
    m = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
    kernel = ExpertKernel(m)
    flat = kernel.flatten(m)
    x = torch.randn(2, 3, HIDDEN)
    torch.testing.assert_close(kernel(flat, x), m(x).detach(), atol=ATOL, rtol=ATOL)
    empty = torch.zeros(0, HIDDEN)
    assert kernel(flat, empty).shape == (0, HIDDEN)


def test_fast_path_is_really_used():
    """The fast path must not call the module: a module whose forward is sabotaged still runs via F.linear."""
    m = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN))
    x = torch.randn(4, HIDDEN)
    expected = m(x).detach()
    kernel = ExpertKernel(m)
    flat = kernel.flatten(m)

    def boom(*_a, **_k):
        raise AssertionError("module forward called on the fast path")
    kernel._template.forward = boom
    torch.testing.assert_close(kernel(flat, x), expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_fast_path(bias):
    m = SwiGLUExpert(HIDDEN, FFN, bias=bias)
    x = torch.randn(9, HIDDEN)
    kernel = check_kernel_matches_module(m, "ffn", x)
    assert set(kernel.names) == {f"w{i}.{p}" for i in (1, 2, 3) for p in (("weight", "bias") if bias else ("weight",))}


def test_swiglu_forward_formula():
    m = SwiGLUExpert(HIDDEN, FFN)
    x = torch.randn(3, HIDDEN)
    ref = m.w2(torch.nn.functional.silu(m.w1(x)) * m.w3(x))
    torch.testing.assert_close(m(x), ref)


# ---------------------------------------------------------------------------------------------------------------
# Generic path
# ---------------------------------------------------------------------------------------------------------------
class NormedExpert(nn.Module):
    """LayerNorm + FFN with a buffer: not a fast-path shape."""

    scale: torch.Tensor   # a buffer

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, FFN))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(x))) * self.scale)


class BiasTupleExpert(nn.Module):
    """Returns (out, bias) like Megatron-style layers; the kernel keeps the first element."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN, bias=False)
        self.out_bias = nn.Parameter(torch.randn(HIDDEN))

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))), self.out_bias


class TiedExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = self.a

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Linear2(nn.Linear):
    pass


@pytest.mark.parametrize("factory", [
    NormedExpert,
    BiasTupleExpert,
    TiedExpert,
    # fast-path look-alikes that must fall back to the generic path
    lambda: nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(approximate="tanh"), nn.Linear(FFN, HIDDEN)),
    lambda: nn.Sequential(nn.Linear(HIDDEN, FFN), nn.LeakyReLU(0.1), nn.Linear(FFN, HIDDEN)),
    lambda: nn.Sequential(Linear2(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN)),
    lambda: nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN), nn.Tanh()),
    lambda: nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Dropout(0.0), nn.Linear(FFN, HIDDEN)),
], ids=["layernorm_buffer", "tuple_out_bias", "tied", "gelu_tanh", "leaky_relu", "linear_subclass",
        "four_layers", "dropout"])
def test_generic_path_matches_module(factory):
    m = factory()
    x = torch.randn(6, HIDDEN)
    kernel = check_kernel_matches_module(m, "generic", x)
    assert kernel.fast_path is None


def test_generic_path_uses_buffer_and_holds_no_parameter_memory():
    m = NormedExpert()
    kernel = ExpertKernel(m)
    # template parameters are meta tensors; the buffer is a real copy
    assert all(p.device.type == "meta" for p in kernel._template.parameters())
    assert kernel._template.scale.device.type == "cpu"
    torch.testing.assert_close(kernel._template.scale, m.scale)
    # the buffer matters: a template with a different buffer gives a different result
    x = torch.randn(3, HIDDEN)
    flat = kernel.flatten(m)
    base = kernel(flat, x).detach()
    kernel._template.scale.mul_(2.0)
    assert not torch.allclose(kernel(flat, x), base)


def test_generic_path_tuple_output_first_element():
    m = BiasTupleExpert()
    kernel = ExpertKernel(m)
    x = torch.randn(5, HIDDEN)
    out = kernel(kernel.flatten(m), x)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, m(x)[0].detach(), atol=ATOL, rtol=ATOL)
    # out_bias is in the layout but receives no gradient through the first element
    leaf = kernel.flatten(m).requires_grad_(True)
    kernel(leaf, x).sum().backward()
    assert leaf.grad is not None
    views = kernel.views(leaf.grad)
    assert torch.count_nonzero(views["out_bias"]) == 0
    assert torch.count_nonzero(views["fc1.weight"]) > 0


def test_expert_without_parameters_rejected():
    with pytest.raises(ValueError, match="parameters"):
        ExpertKernel(nn.Sequential(nn.ReLU()))


# ---------------------------------------------------------------------------------------------------------------
# Layout: flatten / views / unflatten_into
# ---------------------------------------------------------------------------------------------------------------
FACTORIES = [
    lambda: nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)),
    lambda: SwiGLUExpert(HIDDEN, FFN, bias=True),
    NormedExpert,
    BiasTupleExpert,
]


@pytest.mark.parametrize("factory", FACTORIES)
def test_flatten_layout_order(factory):
    m = factory()
    kernel = ExpertKernel(m)
    flat = kernel.flatten(m)
    expected = torch.cat([p.detach().reshape(-1) for _, p in m.named_parameters()])
    assert torch.equal(flat, expected)
    assert kernel.numels == [p.numel() for p in m.parameters()]
    assert kernel.shapes == [p.shape for p in m.parameters()]
    # flatten copies: changing the flat vector does not touch the module
    before = [p.detach().clone() for p in m.parameters()]
    flat.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


@pytest.mark.parametrize("factory", FACTORIES)
def test_views_are_views(factory):
    m = factory()
    kernel = ExpertKernel(m)
    flat = kernel.flatten(m)
    views = kernel.views(flat)
    assert list(views) == kernel.names
    start = flat.data_ptr()
    end = start + flat.numel() * flat.element_size()
    offset = 0
    for name, shape, numel in zip(kernel.names, kernel.shapes, kernel.numels):
        v = views[name]
        assert v.shape == shape
        assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert v.data_ptr() == start + offset * flat.element_size()
        assert start <= v.data_ptr() and v.data_ptr() + v.numel() * v.element_size() <= end
        offset += numel
    assert offset == flat.numel()
    # writes through a view land in the flat vector
    first = kernel.names[0]
    views[first].fill_(3.25)
    assert torch.all(flat[: kernel.numels[0]] == 3.25)
    assert not torch.all(flat[kernel.numels[0]:] == 3.25)


@pytest.mark.parametrize("factory", FACTORIES)
def test_unflatten_into_round_trips(factory):
    src, dst = factory(), factory()
    kernel = ExpertKernel(src)
    flat = kernel.flatten(src)
    assert not torch.equal(kernel.flatten(dst), flat)
    kernel.unflatten_into(flat, dst)
    assert torch.equal(kernel.flatten(dst), flat)
    for (n1, p1), (n2, p2) in zip(src.named_parameters(), dst.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    # an arbitrary flat vector round-trips too, and the module then computes what the kernel computes
    other = torch.randn(kernel.numel)
    kernel.unflatten_into(other, dst)
    assert torch.equal(kernel.flatten(dst), other)
    x = torch.randn(4, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(kernel(other, x), _module_out(dst, x), atol=ATOL, rtol=ATOL)
    # unflatten copies: the module does not alias the flat vector
    other.zero_()
    assert kernel.flatten(dst).abs().sum() > 0


def test_one_kernel_serves_all_experts_of_a_layer():
    experts = [nn.Sequential(nn.Linear(HIDDEN, FFN), nn.SiLU(), nn.Linear(FFN, HIDDEN)) for _ in range(3)]
    kernel = ExpertKernel(experts[0])
    chunk = torch.cat([kernel.flatten(e) for e in experts])
    x = torch.randn(5, HIDDEN)
    for i, e in enumerate(experts):
        part = chunk.narrow(0, i * kernel.numel, kernel.numel)
        torch.testing.assert_close(kernel(part, x), e(x).detach(), atol=ATOL, rtol=ATOL)


def test_flatten_casts_to_fp32():
    m = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN)).to(torch.bfloat16)
    kernel = ExpertKernel(m)
    flat = kernel.flatten(m)
    assert flat.dtype == torch.float32
    assert torch.equal(flat.to(torch.bfloat16), torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    back = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN)).to(torch.bfloat16)
    kernel.unflatten_into(flat, back)
    assert all(p.dtype == torch.bfloat16 for p in back.parameters())
    assert torch.equal(kernel.flatten(back), flat)
