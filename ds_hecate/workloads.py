"""Controlled routing for tests and benchmarks: DeepSpeed's TopKGate with a fixed bias on its logits.

A bias on the gate logits skews which experts tokens pick (hot experts, starved experts, all tokens to one expert)
while keeping DeepSpeed's gating arithmetic, so a data-parallel run and a Hecate run of the same model route alike.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from deepspeed.moe.sharded_moe import TopKGate, top1gating, top2gating


class BiasedTopKGate(TopKGate):
    """``TopKGate`` whose logits get ``logit_bias`` added (top-1 and top-2, as DeepSpeed's legacy layer)."""

    def __init__(self, gate: TopKGate, bias: Sequence[float]) -> None:
        super().__init__(gate.wg.in_features, gate.wg.out_features, gate.k, gate.capacity_factor,
                         gate.eval_capacity_factor, gate.min_capacity, gate.noisy_gate_policy, gate.drop_tokens,
                         gate.use_rts, gate.ep_group, gate.top2_2nd_expert_sampling)
        if gate.k not in (1, 2):
            raise ValueError("BiasedTopKGate supports k=1 and k=2")
        self.wg.weight.data.copy_(gate.wg.weight.data)
        self.register_buffer("logit_bias", torch.as_tensor(bias, dtype=torch.float32), persistent=False)

    def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
        logits = F.linear(input.float(), self.wg.weight.float()) + self.logit_bias
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, cf, self.min_capacity, used_token, None, self.drop_tokens, self.use_rts,
                              self.ep_group, sparse_routes, use_tutel)
        return top2gating(logits, cf, self.min_capacity, self.drop_tokens, self.ep_group,
                          self.top2_2nd_expert_sampling, sparse_routes)


def bias_gate(moe: nn.Module, bias: Sequence[float]) -> None:
    """Replace the gate of a ``deepspeed.moe.layer.MoE`` or ``ds_hecate.MoE`` by a biased copy, in place."""
    inner = moe.deepspeed_moe if hasattr(moe, "deepspeed_moe") else moe
    inner.gate = BiasedTopKGate(inner.gate, bias)
