"""Running one expert from a flat parameter vector.

Hecate moves whole experts as flat chunks (one contiguous vector per expert), so an expert has to run from such
a chunk. Any ``nn.Module`` works through ``torch.func.functional_call`` on a parameter-less template; the common
FFN shapes (Linear-act-Linear, and :class:`SwiGLUExpert`) take a direct path of ``F.linear`` calls that skips
module dispatch.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: Dict[type, Callable[[torch.Tensor], torch.Tensor]] = {
    nn.GELU: F.gelu, nn.ReLU: F.relu, nn.SiLU: F.silu, nn.Tanh: torch.tanh, nn.Identity: lambda t: t,
}


class SwiGLUExpert(nn.Module):
    """LLaMA-style gated FFN, ``w2(silu(w1 x) * w3 x)``; Hecate runs it on its fast path."""

    def __init__(self, hidden_size: int, ffn_size: int, bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.w3 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.w2 = nn.Linear(ffn_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _linear_act_linear(module: nn.Module) -> Optional[Callable]:
    if not (isinstance(module, nn.Sequential) and len(module) == 3):
        return None
    first, act, second = module[0], module[1], module[2]
    if type(first) is not nn.Linear or type(second) is not nn.Linear or type(act) not in _ACTIVATIONS:
        return None
    if isinstance(act, nn.GELU) and act.approximate != "none":
        return None
    act_fn = _ACTIVATIONS[type(act)]

    def run(p: Dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, p["0.weight"], p.get("0.bias"))
        return F.linear(act_fn(h), p["2.weight"], p.get("2.bias"))
    return run


def _swiglu(module: nn.Module) -> Optional[Callable]:
    if type(module) is not SwiGLUExpert:
        return None

    def run(p: Dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(F.linear(x, p["w1.weight"], p.get("w1.bias")))
        return F.linear(gate * F.linear(x, p["w3.weight"], p.get("w3.bias")), p["w2.weight"], p.get("w2.bias"))
    return run


class ExpertKernel:
    """Layout of one expert's parameters in a flat vector, and how to run the expert from that vector."""

    def __init__(self, expert: nn.Module) -> None:
        named = [(n, p) for n, p in expert.named_parameters()]
        if not named:
            raise ValueError("an expert must have parameters")
        self.names: List[str] = [n for n, _ in named]
        self.shapes: List[torch.Size] = [p.shape for _, p in named]
        self.numels: List[int] = [p.numel() for _, p in named]
        self.numel: int = sum(self.numels)
        self.fast_path: Optional[Callable] = _linear_act_linear(expert) or _swiglu(expert)
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
        return "ffn" if self.fast_path is not None else "generic"

    def flatten(self, expert: nn.Module) -> torch.Tensor:
        """The expert's parameters as one fp32 vector, in layout order."""
        params = dict(expert.named_parameters())
        return torch.cat([params[n].detach().reshape(-1).to(torch.float32) for n in self.names])

    def flatten_grad(self, expert: nn.Module) -> torch.Tensor:
        """The expert's parameter gradients as one fp32 vector (zeros where a gradient is missing)."""
        params = dict(expert.named_parameters())
        return torch.cat([(params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]))
                          .detach().reshape(-1).to(torch.float32) for n in self.names])

    def views(self, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Named views into a flat vector (differentiable: gradients land in the flat vector)."""
        out, offset = {}, 0
        for name, shape, numel in zip(self.names, self.shapes, self.numels):
            out[name] = flat.narrow(0, offset, numel).view(shape)
            offset += numel
        return out

    def unflatten_into(self, flat: torch.Tensor, expert: nn.Module) -> None:
        """Copy a flat vector into a real expert module's parameters (used for export and tests)."""
        params = dict(expert.named_parameters())
        for name, view in self.views(flat).items():
            params[name].data.copy_(view.to(params[name].dtype))

    def __call__(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        params = self.views(flat)
        if self.fast_path is not None:
            return self.fast_path(params, x)
        out = torch.func.functional_call(self._template, params, (x,))
        return out[0] if isinstance(out, tuple) else out  # DeepSpeed's Experts ignore a returned bias too
