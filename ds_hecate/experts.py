"""Running experts from flat parameter vectors: one expert, or all of a layer call's experts at once.

Hecate moves whole experts as flat chunks (one contiguous vector per expert), so an expert has to run from such
a chunk. Any ``nn.Module`` works through ``torch.func.functional_call`` on a parameter-less template. The common
FFN shapes (Linear-act-Linear, :class:`SwiGLUExpert`, Hugging Face's fused gate/up experts) have an
:class:`FFNForm`: the same arithmetic written once over a *projection* callback, which is ``F.linear`` for one
expert and a grouped GEMM over every materialized expert of a layer call in
:mod:`ds_hecate.ops.grouped_experts`.

Views into a flat vector are taken with ``split``, never ``narrow``: the backward of a ``narrow`` zero-fills its
whole base before adding the slice, once per parameter, where ``split``'s backward concatenates the pieces once.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: Dict[type, Callable[[torch.Tensor], torch.Tensor]] = {
    nn.GELU: F.gelu, nn.ReLU: F.relu, nn.SiLU: F.silu, nn.Tanh: torch.tanh, nn.Identity: lambda t: t,
}

#: ``proj(x, weight name, bias name or None)``: ``x @ W.T (+ b)`` for the named parameters.
Projection = Callable[[torch.Tensor, str, Optional[str]], torch.Tensor]


class SwiGLUExpert(nn.Module):
    """LLaMA-style gated FFN, ``w2(silu(w1 x) * w3 x)``; Hecate runs it on its fast path."""

    def __init__(self, hidden_size: int, ffn_size: int, bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.w3 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.w2 = nn.Linear(ffn_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass(frozen=True)
class FFNForm:
    """An FFN expert as projections of named parameters: ``down(act(up x))`` or, gated,
    ``down(act(gate x) * up x)``, optionally followed by a parameter-free ``post`` (a post-expert norm).

    ``gate_up`` names one ``[2F, H]`` operand holding the gate and up rows (Hugging Face's fused experts): the first
    ``F`` outputs are the gate, or, ``interleaved``, the even ones (gate0, up0, gate1, ...), taken as strided views
    of the product (the weights stay as stored). ``glu`` replaces ``act(gate) * up`` on that product by the
    experts' own function of all ``2F`` outputs (a Hugging Face class's ``_apply_gate``: clamped or scaled
    SwiGLU variants, which read the layout themselves). For a SwiGLU expert without biases the adjacent
    ``w1``/``w3`` weights form that operand in the grouped path (:attr:`fusable`), so one GEMM computes both.

    ``bias_apart``: the bias is added to the rounded product (``x W^T`` then ``+ b``, Hugging Face's arithmetic)
    rather than fused into it (``F.linear``'s one rounding); the same numbers in fp32, one more rounding in 16 bit,
    which is what lets the grouped path (product, then bias) run such experts in 16 bit too.
    """

    act: Callable[[torch.Tensor], torch.Tensor]
    down: str
    down_bias: Optional[str] = None
    up: Optional[str] = None
    up_bias: Optional[str] = None
    gate: Optional[str] = None
    gate_bias: Optional[str] = None
    gate_up: Optional[str] = None
    gate_up_bias: Optional[str] = None
    interleaved: bool = False
    glu: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    post: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    bias_apart: bool = False

    @property
    def has_bias(self) -> bool:
        return any(b is not None for b in (self.up_bias, self.gate_bias, self.gate_up_bias, self.down_bias))

    def gated(self, product: torch.Tensor) -> torch.Tensor:
        """The hidden activation from the fused gate/up product ``[..., 2F]``."""
        if self.glu is not None:
            return self.glu(product)
        if self.interleaved:
            gate, up = product[..., 0::2], product[..., 1::2]
        else:
            gate, up = product.chunk(2, dim=-1)
        return self.act(gate) * up

    def run(self, proj: Projection, x: torch.Tensor, fuse_gate_up: bool = False) -> torch.Tensor:
        """The expert's output through ``proj``; ``fuse_gate_up`` runs gate and up as one operand (grouped path,
        only when :attr:`fusable`): the operand's name is ``gate + '+' + up``."""
        if self.gate_up is not None:
            hidden = self.gated(proj(x, self.gate_up, self.gate_up_bias))
        elif self.gate is not None:
            assert self.up is not None, "a gated FFN form names its up projection"
            if fuse_gate_up:
                gate, up = proj(x, f"{self.gate}+{self.up}", None).chunk(2, dim=-1)
            else:
                gate, up = proj(x, self.gate, self.gate_bias), proj(x, self.up, self.up_bias)
            hidden = self.act(gate) * up
        else:
            assert self.up is not None, "an FFN form without gate_up names its up projection"
            hidden = self.act(proj(x, self.up, self.up_bias))
        out = proj(hidden, self.down, self.down_bias)
        return self.post(out) if self.post is not None else out

    def fusable(self, names: Sequence[str]) -> bool:
        """Gate and up weights adjacent in the flat layout (gate first) and without biases: one ``[2F, H]`` view."""
        if self.gate is None or self.gate_bias is not None or self.up_bias is not None:
            return False
        return self.gate in names and names.index(self.gate) + 1 == names.index(self.up)


def linear(form: FFNForm, params: Dict[str, torch.Tensor]) -> Projection:
    """``proj`` for one expert's named weights: ``F.linear``, with the bias fused, or added to the product when
    the form says so (:attr:`FFNForm.bias_apart`)."""
    if form.bias_apart:
        def apart(h: torch.Tensor, w: str, b: Optional[str]) -> torch.Tensor:
            out = F.linear(h, params[w])
            return out + params[b] if b is not None else out
        return apart
    return lambda h, w, b: F.linear(h, params[w], params[b] if b is not None else None)


def stack_as_stored(pieces: List[torch.Tensor], params: List[Tuple[str, Tuple[int, ...], bool]],
                    dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """Per parameter ``(name, per-expert shape, transposed)`` its ``[E, numel]`` columns as the module stores the
    parameter: ``[E, *shape]``, or ``[E, in, out]`` when transposed (contiguous, own storage)."""
    out = {}
    for piece, (name, shape, transposed) in zip(pieces, params):
        t = piece.reshape((piece.shape[0],) + tuple(shape))
        if transposed:
            t = t.transpose(1, 2)
        out[name] = (t.to(dtype) if dtype is not None else t).clone(memory_format=torch.contiguous_format)
    return out


def _linear_act_linear(module: nn.Module) -> Optional[FFNForm]:
    if not (isinstance(module, nn.Sequential) and len(module) == 3):
        return None
    first, act, second = module[0], module[1], module[2]
    if type(first) is not nn.Linear or type(second) is not nn.Linear or type(act) not in _ACTIVATIONS:
        return None
    if isinstance(act, nn.GELU) and act.approximate != "none":
        return None
    return FFNForm(act=_ACTIVATIONS[type(act)], up="0.weight", up_bias="0.bias" if first.bias is not None else None,
                   down="2.weight", down_bias="2.bias" if second.bias is not None else None)


def _swiglu(module: nn.Module) -> Optional[FFNForm]:
    if type(module) is not SwiGLUExpert:
        return None
    bias = module.w1.bias is not None
    return FFNForm(act=F.silu, gate="w1.weight", gate_bias="w1.bias" if bias else None, up="w3.weight",
                   up_bias="w3.bias" if bias else None, down="w2.weight", down_bias="w2.bias" if bias else None)


def detect_form(module: nn.Module) -> Optional[FFNForm]:
    """The :class:`FFNForm` of ``module`` if it is one of the FFN shapes Hecate runs directly, else None."""
    return _linear_act_linear(module) or _swiglu(module)


class ExpertKernel:
    """Layout of one expert's parameters in a flat vector, and how to run the expert from that vector."""

    def __init__(self, expert: nn.Module, form: Optional[FFNForm] = None) -> None:
        named = [(n, p) for n, p in expert.named_parameters()]
        if not named:
            raise ValueError("an expert must have parameters")
        self.names: List[str] = [n for n, _ in named]
        self.shapes: List[torch.Size] = [p.shape for _, p in named]
        self.numels: List[int] = [p.numel() for _, p in named]
        self.numel: int = sum(self.numels)
        #: the names as a set (which parameters' gradient columns are fresh is a subset of it, asked every call)
        self.name_set: frozenset = frozenset(self.names)
        #: The FFN shape of the expert, run without module dispatch (per expert or grouped); None: generic.
        self.form: Optional[FFNForm] = form if form is not None else detect_form(expert)
        #: How the module the experts came from stores them, when that differs from this flat layout (a Hugging
        #: Face experts module: fused 3-D tensors, possibly transposed); checkpoints record it for consolidation.
        self.source_layout: Optional[Dict[str, Any]] = None
        # Template for the generic path: same module, parameters replaced by meta tensors (no memory). Buffers
        # stay on the template, shared by all experts of the layer.
        template = copy.deepcopy(expert)
        for mod in template.modules():
            for pname, param in list(mod._parameters.items()):
                if param is not None:
                    mod._parameters[pname] = nn.Parameter(torch.empty(param.shape, device="meta"),
                                                          requires_grad=param.requires_grad)
        self._template = template

    @property
    def kind(self) -> str:
        return "ffn" if self.form is not None else "generic"

    @property
    def fast_path(self) -> Optional[Callable[[Dict[str, torch.Tensor], torch.Tensor], torch.Tensor]]:
        """``run(named views, x)`` for an FFN expert (``F.linear`` calls, no module dispatch), else None."""
        if self.form is None:
            return None
        form = self.form

        def run(p: Dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return form.run(linear(form, p), x)
        return run

    def flatten(self, expert: nn.Module) -> torch.Tensor:
        """The expert's parameters as one fp32 vector, in layout order."""
        params = dict(expert.named_parameters())
        return torch.cat([params[n].detach().reshape(-1).to(torch.float32) for n in self.names])

    def flatten_grad(self, expert: nn.Module) -> torch.Tensor:
        """The expert's parameter gradients as one fp32 vector (zeros where a gradient is missing)."""
        params = dict(expert.named_parameters())
        return torch.cat([(g if (g := params[n].grad) is not None else torch.zeros_like(params[n]))
                          .detach().reshape(-1).to(torch.float32) for n in self.names])

    def views(self, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Named views into a flat vector (differentiable: gradients land in the flat vector)."""
        pieces = flat.split(self.numels)
        return {name: piece.view(shape) for name, piece, shape in zip(self.names, pieces, self.shapes)}

    def grouped_views(self, buffer: torch.Tensor, fuse_gate_up: bool = False) -> Dict[str, torch.Tensor]:
        """Named ``[E, *shape]`` views into an ``[E, numel]`` buffer of E experts (one ``split`` along the
        parameters); with ``fuse_gate_up`` the adjacent gate and up weights are one ``[E, 2F, H]`` view named
        ``gate + '+' + up``."""
        names, numels, shapes = list(self.names), list(self.numels), [tuple(s) for s in self.shapes]
        if fuse_gate_up:
            assert self.form is not None and self.form.gate is not None, "only a fusable form fuses gate and up"
            i = names.index(self.form.gate)
            names[i:i + 2] = [f"{names[i]}+{names[i + 1]}"]
            numels[i:i + 2] = [numels[i] + numels[i + 1]]
            shapes[i:i + 2] = [(shapes[i][0] + shapes[i + 1][0],) + shapes[i][1:]]
        experts = buffer.shape[0]
        return {name: piece.view((experts,) + shape)
                for name, piece, shape in zip(names, buffer.split(numels, dim=1), shapes)}

    def unflatten_into(self, flat: torch.Tensor, expert: nn.Module) -> None:
        """Copy a flat vector into a real expert module's parameters (used for export and tests)."""
        params = dict(expert.named_parameters())
        for name, view in self.views(flat).items():
            params[name].data.copy_(view.to(params[name].dtype))

    def __call__(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        params = self.views(flat)
        run = self.fast_path
        if run is not None:
            return run(params, x)
        out = torch.func.functional_call(self._template, params, (x,))
        return out[0] if isinstance(out, tuple) else out  # DeepSpeed's Experts ignore a returned bias too

