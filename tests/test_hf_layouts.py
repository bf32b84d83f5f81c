"""The experts interface's layouts, one process, no training: what Hecate reads from a decorated class, the kernel
it builds (per expert, against an independent reference of the declared layout), the conversion to and from the
stored layout, and every refusal naming the module, the class and the feature. The real classes of the installed
transformers train in tests/test_hf_zoo.py; the classes here are made up to reach the layouts no released class has
(interleaved rows with the default gate, a parameter-free post-expert norm) and the refusals."""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

from ds_hecate.errors import HecateModelError  # noqa: E402
from ds_hecate.hf.experts import experts_kernel  # noqa: E402
from ds_hecate.hf.layouts import plan_experts  # noqa: E402

E, H, FF = 4, 6, 5


class ScaleNorm(nn.Module):
    """A parameter-free post-expert norm (RMS normalization)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class WeightedNorm(ScaleNorm):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))


def experts_class(*, concatenated=True, transposed=False, bias=False, gate=True, post_norm: Optional[type] = None):
    """A decorated experts class of the given layout with random weights (its forward is the interface's)."""

    @use_experts_implementation(is_concatenated=concatenated, is_transposed=transposed, has_bias=bias,
                                has_gate=gate)
    class MadeUpExperts(nn.Module):
        def __init__(self, config) -> None:
            super().__init__()
            first = "gate_up_proj" if gate else "up_proj"
            out = 2 * FF if gate else FF
            shape = (E, H, out) if transposed else (E, out, H)
            setattr(self, first, nn.Parameter(torch.randn(shape)))
            self.down_proj = nn.Parameter(torch.randn((E, FF, H) if transposed else (E, H, FF)))
            if bias:
                setattr(self, first + "_bias", nn.Parameter(torch.randn(E, out)))
                self.down_proj_bias = nn.Parameter(torch.randn(E, H))
            self.act_fn = nn.SiLU()
            if post_norm is not None:
                self.post_expert_norm = post_norm()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError

    module = MadeUpExperts(transformers.PretrainedConfig())
    setattr(module, "has_post_expert_norm", post_norm is not None)   # (5.10's decorator does not record it)
    return module


def reference(module: Any, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of ``module`` on ``x`` as its declared layout says, written without Hecate's code."""
    def proj(h, name):
        w = getattr(module, name)[e]
        out = h @ w if module.is_transposed else h @ w.t()
        b = getattr(module, name + "_bias", None)
        return out + b[e] if b is not None else out

    if module.has_gate:
        product = proj(x, "gate_up_proj")
        if getattr(type(module), "_apply_gate").__name__ != "_default_apply_gate":
            hidden = module._apply_gate(product)
        elif module.is_concatenated:
            hidden = F.silu(product[:, :FF]) * product[:, FF:]
        else:
            hidden = F.silu(product[:, 0::2]) * product[:, 1::2]
    else:
        hidden = F.silu(proj(x, "up_proj"))
    out = proj(hidden, "down_proj")
    return module.post_expert_norm(out) if module.has_post_expert_norm else out


def _check_kernel(module):
    spec = plan_experts("model.layers.0.mlp.experts", module)
    kernel = experts_kernel(spec, module)
    tensors = {n: p.detach() for n, p in module.named_parameters(recurse=False)}
    x = torch.randn(3, H)
    for e in range(E):
        torch.testing.assert_close(kernel(spec.expert_flat(tensors, e), x), reference(module, e, x).detach())
    return spec, kernel


@pytest.mark.parametrize("layout", [
    dict(), dict(concatenated=False), dict(transposed=True, bias=True), dict(concatenated=False, transposed=True),
    dict(gate=False), dict(gate=False, transposed=True, bias=True), dict(post_norm=ScaleNorm),
])
def test_kernel_computes_the_declared_layout(layout):
    """Interleaved gate/up rows (strided views of the product, with the default gate), transposed storage
    (converted once into the flat vector), biases, no gate, a parameter-free post-expert norm."""
    torch.manual_seed(0)
    _check_kernel(experts_class(**layout))


def test_interleaved_rows_stay_as_stored():
    """The interleaved layout is read as strided views of the product, not reordered: the flat vector holds the
    stored rows (a reordering there would need undoing at every export)."""
    torch.manual_seed(0)
    module = experts_class(concatenated=False)
    spec, kernel = _check_kernel(module)
    flat = spec.expert_flat({"gate_up_proj": module.gate_up_proj.detach(), "down_proj": module.down_proj.detach()}, 1)
    assert torch.equal(flat[:2 * FF * H].view(2 * FF, H), module.gate_up_proj[1].detach())
    assert kernel.form.interleaved and kernel.form.glu is None


def test_transposed_experts_convert_back_exactly():
    """Transposed storage with biases: flat experts back in the module's own layout, bit for bit (what
    state_dict, save_pretrained, export-hf and consolidate write)."""
    module = experts_class(transposed=True, bias=True, concatenated=False)
    spec = plan_experts("experts", module)
    tensors = {n: p.detach() for n, p in module.named_parameters(recurse=False)}
    flats = torch.stack([spec.expert_flat(tensors, e) for e in range(E)])
    back = spec.to_module_layout(flats)
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        assert back[name].shape == value.shape and torch.equal(back[name], value), name
    assert spec.source_layout("X")["transposed"] == ["gate_up_proj", "down_proj"]


def test_own_apply_gate_runs_its_submodules_without_hooks():
    """A class's own ``_apply_gate`` that calls ``self.act_fn`` gets the activation's hook-free forward (the
    ZeRO-3 rule: how often a rank runs it must stay invisible to the module trace)."""
    calls = []

    def own_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=self.limit)) * (up + 1)

    module = experts_class()
    type(module)._apply_gate = own_gate
    module.limit = 0.5
    module.act_fn.register_forward_pre_hook(lambda *args: calls.append(1))
    _check_kernel(module)
    assert len(calls) == E   # the reference calls the module (once per expert); the kernel never does


@pytest.mark.parametrize("make, feature", [
    (lambda: experts_class(post_norm=WeightedNorm), "post-expert norm 'post_expert_norm' (WeightedNorm) holds "
                                                    "parameters shared by every expert (weight)"),
    (lambda: _with(experts_class(), scale=nn.Parameter(torch.ones(E))), "parameters outside the experts' "
                                                                        "projections (scale)"),
    (lambda: _with(experts_class(), down_proj=nn.Parameter(torch.ones(E, H, FF + 1))), "do not fit a fused gate/up "
                                                                                      "and a down projection"),
    (lambda: _without(experts_class(bias=True), "down_proj_bias"), "has_bias=True but its 'down_proj_bias' is "
                                                                   "missing"),
    (lambda: _with(experts_class(), act_fn=nn.PReLU()), "its submodule 'act_fn' (PReLU)"),
    (lambda: _overridden(experts_class()), "overrides the decorated one without calling it"),
])
def test_refused_by_name(make, feature):
    with pytest.raises(HecateModelError) as info:
        spec = plan_experts("model.layers.3.mlp.experts", make())
        experts_kernel(spec, make(), "experts module 'model.layers.3.mlp.experts' (MadeUpExperts)")
    message = str(info.value)
    assert "model.layers.3.mlp.experts" in message and "MadeUpExperts" in message and feature in message


def _with(module, **attributes):
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def _without(module, name):
    delattr(module, name)
    return module


def _overridden(module):
    base: Any = type(module)   # the experts class of the module (any of the interface's)

    class Overriding(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    Overriding.__name__ = "MadeUpExperts"
    module.__class__ = Overriding
    return module


def test_a_refusal_leaves_the_model_as_it_was():
    """Every experts module is planned before the first is taken over: a refused one anywhere leaves every
    module with its parameters (nothing half-converted)."""
    from ds_hecate.hf.takeover import convert_hf_model

    model = nn.ModuleList([experts_class(), experts_class(post_norm=WeightedNorm)])
    before = [set(dict(m.named_parameters(recurse=False))) for m in model]
    with pytest.raises(HecateModelError, match="'1' .*post-expert norm"):
        convert_hf_model(model, runtime=None)
    assert [set(dict(m.named_parameters(recurse=False))) for m in model] == before


def test_transformers_biased_experts_take_the_grouped_path_in_16_bit():
    """Hugging Face's experts add the bias to the rounded product (``bias_apart``), which the grouped path
    computes exactly in bf16 too; a fused-bias expert (``F.linear``'s one rounding) keeps the loop there."""
    from ds_hecate.experts import ExpertKernel, SwiGLUExpert
    from ds_hecate.ops.grouped_experts import grouped_path

    module = experts_class(transposed=True, bias=True, concatenated=False)
    hf = experts_kernel(plan_experts("experts", module), module)
    fused = ExpertKernel(SwiGLUExpert(H, FF, bias=True))
    assert hf.form is not None
    assert hf.form.bias_apart and grouped_path(hf, torch.bfloat16)
    assert not grouped_path(fused, torch.bfloat16) and grouped_path(fused, torch.float32)
