"""Controlled routing for tests and benchmarks: DeepSpeed's TopKGate with a fixed bias on its logits, and gates
whose choice of experts is forced to follow the named workloads W0-W7 or a recorded routing trace.

A bias on the gate logits skews which experts tokens pick (hot experts, starved experts, all tokens to one expert)
while keeping DeepSpeed's gating arithmetic, so a data-parallel run and a Hecate run of the same model route alike.
"""
from __future__ import annotations

import os
import zlib
from typing import List, Optional, Sequence

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
    inner: nn.Module = getattr(moe, "deepspeed_moe", moe)
    inner.gate = BiasedTopKGate(inner.gate, bias)


# -- Forced routing from the named workloads W0-W7 and from recorded traces ------------------------------------------
#
# The benchmarks need every system to route the *same* token-expert pairs, exactly as the workload (or a trace
# recorded from a real run) says, while the gate keeps its trainable weights. A route source turns
# (step, layer, rank) into an exact [tokens, k] choice of experts; the gate adds a large constant to the logits of
# the chosen experts. Softmax over (logits + bias) restricted to a token's k chosen experts and renormalised (what
# top-2 gating and AutoEP's route_norm compute) equals the softmax of the real logits over those experts, so the
# combine weights and their gradients are the gate's own; only the choice is forced.

#: Logit bias of the forced experts: large against real logits (|logit| << 1 here), small enough for fp32 softmax.
FORCE_BIAS = 30.0


def assign_routes(counts: Sequence[int], num_tokens: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """A [num_tokens, top_k] expert choice in which expert e appears exactly ``counts[e]`` times and no token picks
    an expert twice. Needs ``sum(counts) == num_tokens * top_k`` and every count <= ``num_tokens``.

    Pairs are laid out expert-major and dealt to tokens round-robin (pair i -> token i mod T, slot i // T), so an
    expert's run of at most T pairs lands on distinct tokens; a seeded permutation then shuffles the tokens.
    """
    total = int(sum(counts))
    if total != num_tokens * top_k or any(c > num_tokens or c < 0 for c in counts):
        raise ValueError(f"assign_routes: counts {list(counts)} do not fill {num_tokens} tokens x top-{top_k} with "
                         f"at most one pick of an expert per token")
    if num_tokens == 0:
        return torch.empty(0, top_k, dtype=torch.long)
    experts = torch.repeat_interleave(torch.arange(len(counts)), torch.as_tensor(list(counts), dtype=torch.long))
    choice = experts.view(top_k, num_tokens).t().contiguous()
    return choice.index_select(0, torch.randperm(num_tokens, generator=generator))


class RouteSource:
    """Where forced routes come from: the token count of each rank and the exact expert counts of each call."""

    world_size: int
    num_experts: int
    top_k: int
    name: str

    def tokens(self, step: int, rank: int) -> int:
        raise NotImplementedError

    def counts(self, step: int, layer: int) -> List[List[int]]:
        """counts[rank][expert]: token-expert pairs of each rank for one layer call (rows sum to tokens * k)."""
        raise NotImplementedError

    def choices(self, step: int, layer: int, rank: int, seed: int = 0) -> torch.Tensor:
        """This rank's [tokens, top_k] forced choice for (step, layer); identical for every system."""
        gen = torch.Generator().manual_seed(zlib.crc32(repr((self.name, seed, step, layer, rank)).encode()))
        return assign_routes(self.counts(step, layer)[rank], self.tokens(step, rank), self.top_k, gen)


class WorkloadRoutes(RouteSource):
    """Routes of a named workload W0-W7 (:mod:`ds_hecate.sim.workloads`): the same deterministic counts the
    simulator replays (:func:`routing_counts`), one set per step, shared by all layers."""

    def __init__(self, name: str, world_size: int, num_experts: int, top_k: int, tokens_per_rank: int,
                 seed: int = 0) -> None:
        from ..sim.workloads import check_workload, token_shares
        check_workload(name)
        self.name, self.world_size, self.num_experts, self.top_k = name, world_size, num_experts, top_k
        self.tokens_per_rank, self.seed = tokens_per_rank, seed
        self._shares = token_shares(name, world_size)
        self._cache: dict = {}

    def tokens(self, step: int, rank: int) -> int:
        return int(round(self.tokens_per_rank * self._shares[rank]))

    def counts(self, step: int, layer: int) -> List[List[int]]:
        from ..sim.workloads import routing_counts
        if step not in self._cache:
            counts = routing_counts(self.name, step, self.world_size, self.num_experts, self.tokens_per_rank,
                                    self.top_k, self.seed)
            for r, row in enumerate(counts):
                if sum(row) != self.tokens(step, r) * self.top_k:
                    raise ValueError(f"workload {self.name}: rank {r} has fewer than {self.top_k} experts with "
                                     "load; use a smaller top_k or more experts")
            self._cache = {step: counts}
        return self._cache[step]


class TraceRoutes(RouteSource):
    """Replay of a routing trace (:mod:`ds_hecate.trace`) at the benchmark's scale.

    Each recorded call's per-rank expert distribution is kept and rescaled to ``tokens_per_rank`` tokens on
    average; ranks keep their recorded relative token counts (ragged sources stay ragged). Steps cycle through the
    trace; benchmark layer ``l`` replays trace layer ``l mod layers``. The trace's world size and expert count must
    match the benchmark's.
    """

    def __init__(self, path: str, world_size: int, num_experts: int, top_k: int, tokens_per_rank: int) -> None:
        from ..trace import read_trace
        trace = read_trace(path)
        if trace.world_size != world_size:
            raise ValueError(f"trace {path}: recorded on {trace.world_size} ranks, the benchmark runs {world_size}")
        bad = [layer.num_experts for layer in trace.layers if layer.num_experts != num_experts]
        if bad:
            raise ValueError(f"trace {path}: layers with {bad[0]} experts, the benchmark model has {num_experts} "
                             "(pass --experts to match the trace)")
        self.name = "trace:" + os.path.splitext(os.path.basename(path))[0]
        self.path, self.world_size, self.num_experts, self.top_k = path, world_size, num_experts, top_k
        self.tokens_per_rank = tokens_per_rank
        self.num_layers = len(trace.layers)
        self._steps = [{r.layer: r.counts for r in group} for group in trace.by_step()]
        self._steps = [s for s in self._steps if len(s) == self.num_layers]
        if not self._steps:
            raise ValueError(f"trace {path}: no step records every one of its {self.num_layers} layer(s)")

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def _recorded(self, step: int, layer: int) -> List[List[int]]:
        return self._steps[step % len(self._steps)][layer % self.num_layers]

    def tokens(self, step: int, rank: int) -> int:
        # a rank's recorded share of the pairs of trace layer 0, scaled to the benchmark's tokens per rank
        recorded = self._recorded(step, 0)
        totals = [sum(row) for row in recorded]
        mean = sum(totals) / len(totals)
        share = totals[rank] / mean if mean > 0 else 1.0
        return int(round(self.tokens_per_rank * share))

    def counts(self, step: int, layer: int) -> List[List[int]]:
        from ..sim.workloads import expected_counts
        recorded = self._recorded(step, layer)
        out = []
        for r, row in enumerate(recorded):
            tokens, total = self.tokens(step, r), sum(row)
            probs = [c / total for c in row] if total else [1.0 / self.num_experts] * self.num_experts
            counts = expected_counts(probs, tokens, self.top_k)
            if sum(counts) != tokens * self.top_k:   # fewer than top_k experts recorded: spread the rest evenly
                counts = expected_counts([p + 1e-3 for p in probs], tokens, self.top_k)
            out.append(counts)
        return out


def force_bias(choices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[tokens, experts] logit bias: :data:`FORCE_BIAS` on each token's chosen experts, 0 elsewhere."""
    bias = torch.zeros(choices.shape[0], num_experts)
    return bias.scatter_(1, choices, FORCE_BIAS)


class RoutedTopKGate(TopKGate):
    """``TopKGate`` (top-1/top-2, as DeepSpeed's legacy layer and ``ds_hecate.MoE`` use it) whose choice of experts
    is forced by ``choices`` ([tokens, k], set before each forward); combine weights stay the gate's own softmax."""

    def __init__(self, gate: TopKGate) -> None:
        super().__init__(gate.wg.in_features, gate.wg.out_features, gate.k, gate.capacity_factor,
                         gate.eval_capacity_factor, gate.min_capacity, None, False, gate.use_rts, gate.ep_group,
                         False)
        if gate.k not in (1, 2):
            raise ValueError("RoutedTopKGate supports k=1 and k=2")
        self.wg = gate.wg   # the same trainable parameter
        self.choices: Optional[torch.Tensor] = None

    def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
        logits = F.linear(input.float(), self.wg.weight.float())
        if self.choices is not None:
            if self.choices.shape[0] != logits.shape[0]:
                raise ValueError(f"RoutedTopKGate: {self.choices.shape[0]} forced routes for {logits.shape[0]} "
                                 "tokens")
            logits = logits + force_bias(self.choices, logits.shape[1]).to(logits.device)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, cf, self.min_capacity, used_token, None, False, self.use_rts,
                              self.ep_group, sparse_routes, use_tutel)
        return top2gating(logits, cf, self.min_capacity, False, self.ep_group, False, sparse_routes)


def route_gate(moe: nn.Module) -> RoutedTopKGate:
    """Give a ``deepspeed.moe.layer.MoE`` or ``ds_hecate.MoE`` a :class:`RoutedTopKGate` (same weights), in place."""
    inner: nn.Module = getattr(moe, "deepspeed_moe", moe)
    gate = RoutedTopKGate(inner.gate)
    inner.gate = gate
    return gate


class LinearRouteForcer:
    """Forces the choice of a router whose logits come from an ``nn.Linear`` (AutoEP's ``router.gate``): a forward
    hook adds :func:`force_bias` to the linear's output. Set ``choices`` before each forward."""

    def __init__(self, linear: nn.Linear) -> None:
        self.choices: Optional[torch.Tensor] = None
        self.handle = linear.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if self.choices is None:
            return output
        if self.choices.shape[0] != output.shape[0]:
            raise ValueError(f"forced routes for {self.choices.shape[0]} tokens, router saw {output.shape[0]}")
        return output + force_bias(self.choices, output.shape[1]).to(output.device, output.dtype)
