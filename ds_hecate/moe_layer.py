"""``ds_hecate.MoE``: a drop-in for ``deepspeed.moe.layer.MoE`` whose experts Hecate can take over.

Same constructor arguments and the same return value ``(output, l_aux, exp_counts)``; the gate *is* DeepSpeed's
``TopKGate``, so routing (including its random sampling) is bit-for-bit DeepSpeed's (for ``k >= 2`` its forward is
computed by :mod:`ds_hecate.ops.topk_gate`: the same values and gradients without the capacity slots Hecate does not
read). Before Hecate takes it over (or without Hecate) the layer runs its experts locally, which is exactly
data-parallel MoE. After :func:`ds_hecate.initialize` it runs through the Hecate runtime: experts sharded,
materialized per plan, tokens dispatched to replicas.

It deliberately does not subclass DeepSpeed's ``MoE``: that class flips DeepSpeed into its own expert-parallel
paths (``has_moe_layers``), which must stay off once Hecate owns the experts.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from deepspeed.moe.sharded_moe import TopKGate

from .errors import HecateModelError
from .ops.topk_gate import gate_routes

if TYPE_CHECKING:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from .experts import ExpertKernel


class _BoundShard(Protocol):
    """The part of the runtime's ``LayerShard`` the layer reads (:func:`num_parameters`)."""

    @property
    def num_experts(self) -> int: ...

    @property
    def kernel(self) -> ExpertKernel: ...


class _GatePhases(Protocol):
    """The part of the layer's phases (``ds_hecate.runtime.call_monitor.LayerPhases``) its gate runs in: the
    ``route`` phase and the boundaries of ``route_bwd``."""

    def route_starts(self) -> None: ...

    def __call__(self, name: str) -> Any: ...

    def boundary(self, tensor: torch.Tensor, ends: Optional[str], starts: Optional[str]) -> torch.Tensor: ...


class ExpertsBinding(Protocol):
    """What the Hecate runtime attaches to a layer it takes over (``ds_hecate.runtime.layer.LayerBinding``): the
    layer sits below the runtime and names only what it calls."""

    @property
    def shard(self) -> _BoundShard: ...

    @property
    def phases(self) -> _GatePhases: ...

    def run(self, x: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor,
            arithmetic: str = "deepspeed") -> torch.Tensor: ...


def _expert_copies(expert: nn.Module, count: int):
    """``count`` independent copies of ``expert``.

    Under ``deepspeed.zero.Init`` the expert's parameters are already partitioned, and a deep copy would clone the
    partition bookkeeping (shared ids, empty data). There the full weights are gathered and each copy gets plain
    parameters, which zero.Init then partitions as members of this layer.
    """
    params = list(expert.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return [copy.deepcopy(expert) for _ in range(count)]
    import deepspeed
    copies = []
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        full = {name: p.detach().clone() for name, p in expert.named_parameters()}
    for _ in range(count):
        clone = copy.deepcopy(expert)
        for name, module in list(clone.named_modules()):
            for pname, param in list(module._parameters.items()):
                if param is not None:
                    key = f"{name}.{pname}" if name else pname
                    module._parameters[pname] = nn.Parameter(full[key].clone(), requires_grad=param.requires_grad)
        copies.append(clone)
    return copies


def combine_routes(y_slots: torch.Tensor, gates: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Weighted top-k combine, with DeepSpeed's arithmetic (``_sparse_decode``): fp32 gates, sum over k."""
    k, num_tokens = gates.shape
    routed = y_slots.view(k, num_tokens, y_slots.shape[-1])
    return (routed * gates.unsqueeze(-1)).sum(0).to(out_dtype)


class MoE(nn.Module):
    """Mixture-of-Experts layer with DeepSpeed's ``MoE`` interface, for Hecate.

    ``ep_size`` is DeepSpeed's: without ``hecate.ep_size`` it is Hecate's group size (each group of ``ep_size``
    consecutive ranks holds every expert once, the groups replicate each other); placement inside a group is
    Hecate's. ``num_local_experts`` is DeepSpeed's ``num_experts // ep_size`` (what the layer was built to hold per
    rank); what a rank owns under Hecate changes with re-sharding and is in ``engine.hecate.stats()``.
    ``enable_expert_tensor_parallelism`` is kept as DeepSpeed keeps it; initialize refuses it with a model-parallel
    unit of tensor-parallel size above 1 (``ds_hecate.deepspeed_glue.model_parallel``). ``use_tutel`` is not supported.
    """

    #: set when Hecate takes the layer over and its experts leave the module (ds_hecate.deepspeed_glue.convert)
    expert_kernel: ExpertKernel

    def __init__(self,
                 hidden_size: int,
                 expert: nn.Module,
                 num_experts: int = 1,
                 ep_size: int = 1,
                 k: int = 1,
                 capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4,
                 use_residual: bool = False,
                 noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True,
                 use_rts: bool = True,
                 use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if use_tutel:
            raise HecateModelError("ds_hecate.MoE: use_tutel is not supported (Hecate has its own dispatch)")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise HecateModelError(f"ds_hecate.MoE: unsupported noisy_gate_policy {noisy_gate_policy!r}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.k = k
        self.use_residual = use_residual
        self.gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                             noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.experts = nn.ModuleList(_expert_copies(expert, num_experts))
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)
        # set by Hecate when it takes the layer over (ds_hecate.runtime.layer.LayerBinding)
        self.binding: Optional[ExpertsBinding] = None
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    @classmethod
    def from_deepspeed(cls, ds_moe: DeepSpeedMoE) -> "MoE":
        """Wrap an existing ``deepspeed.moe.layer.MoE`` in place: same gate module, same expert modules.

        With ``ep_size > 1`` the module holds only this rank's ``num_local_experts``; the Hecate runtime gathers
        the rest from their expert-parallel ranks when it shards them.
        """
        inner = ds_moe.deepspeed_moe
        if getattr(inner, "use_tutel", False):
            raise HecateModelError("deepspeed MoE with use_tutel=True is not supported by Hecate")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.hidden_size = inner.gate.wg.in_features
        layer.num_experts = ds_moe.num_experts
        layer.ep_size = ds_moe.ep_size
        layer.num_local_experts = ds_moe.num_local_experts
        layer.enable_expert_tensor_parallelism = bool(getattr(ds_moe, "enable_expert_tensor_parallelism", False))
        layer.k = inner.gate.k
        layer.use_residual = ds_moe.use_residual
        layer.gate = inner.gate
        layer.experts = inner.experts.deepspeed_experts
        for param in layer.experts.parameters():  # DeepSpeed's expert tags; Hecate owns these now
            for tag in ("allreduce", "group_name"):
                if hasattr(param, tag):
                    delattr(param, tag)
        if ds_moe.use_residual:
            layer.mlp = ds_moe.mlp
            layer.coefficient = ds_moe.coefficient
        layer.binding = None
        layer.l_aux = None
        layer.exp_counts = None
        return layer

    @property
    def local_expert_ids(self) -> range:
        """Global ids of the experts this module holds before Hecate takes over (DeepSpeed's EP layout)."""
        num_local = len(self.experts)
        if num_local == self.num_experts:
            return range(self.num_experts)
        import torch.distributed as dist
        ep_rank = dist.get_rank() % self.ep_size
        return range(ep_rank * num_local, (ep_rank + 1) * num_local)

    def forward(self, hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d_model = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, d_model)
        # DeepSpeed's gate with sparse routes (computed as DeepSpeed does, without the slots Hecate does not read:
        # ds_hecate.ops.topk_gate): indices/gates are [k, S]; dropped routes have index -1.
        binding = self.binding
        if binding is not None:
            # Hecate: the gate is the layer's "route" phase (timed while profiling, its backward between the two
            # boundaries); the combine is DeepSpeed's arithmetic, fused with the un-permute
            phases = binding.phases
            phases.route_starts()
            x = phases.boundary(x, "route_bwd", None)
            with phases("route"):
                l_aux, indices, gates, exp_counts = gate_routes(self.gate, x, used_token)
                # (kept as DeepSpeed's MoE keeps them; replacing the last call's frees what its graph still holds)
                self.l_aux, self.exp_counts = l_aux, exp_counts
            gates = phases.boundary(gates, None, "route_bwd")
            output = binding.run(x, indices, gates, "deepspeed").reshape(hidden_states.shape)
        else:
            l_aux, indices, gates, exp_counts = gate_routes(self.gate, x, used_token)
            self.l_aux, self.exp_counts = l_aux, exp_counts
            y_slots = self._run_local(x, indices)
            output = combine_routes(y_slots, gates, y_slots.dtype).reshape(hidden_states.shape)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, l_aux, exp_counts

    def _run_local(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Every expert on this rank (data-parallel MoE): one output row per (route, token) slot."""
        if len(self.experts) != self.num_experts:
            raise HecateModelError("this MoE layer holds only its expert-parallel share of experts; it can run "
                                   "only after Hecate takes it over (ds_hecate.initialize)")
        num_tokens = x.shape[0]
        flat = indices.reshape(-1).long()
        pieces, slots = [], []
        for e, expert in enumerate(self.experts):
            sel = torch.nonzero(flat == e).squeeze(1)
            out = expert(x.index_select(0, sel % num_tokens))
            pieces.append(out[0] if isinstance(out, tuple) else out)
            slots.append(sel)
        y = torch.cat(pieces)
        return y.new_zeros(flat.numel(), y.shape[-1]).index_copy(0, torch.cat(slots), y)


def num_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Parameter count of ``model`` (or of a DeepSpeed engine's module) including the experts Hecate took over:
    they are no longer module parameters, so ``sum(p.numel() for p in model.parameters())`` misses them. ZeRO-3
    partitioned parameters count fully; Hugging Face models converted by :mod:`ds_hecate.hf` count their experts."""
    inner = getattr(model, "module", model)
    dense = sum(getattr(p, "ds_numel", p.numel()) for p in inner.parameters()
                if p.requires_grad or not trainable_only)
    experts = sum(m.binding.shard.num_experts * m.binding.shard.kernel.numel
                  for m in inner.modules() if isinstance(m, MoE) and m.binding is not None)
    takeover = inner.__dict__.get("_hecate_hf")  # set by ds_hecate.hf on a converted transformers model
    return dense + experts + (takeover.expert_parameter_count() if takeover is not None else 0)
