"""Named routing workloads W0-W7: how tokens of each rank spread over the experts, step by step.

One definition serves the real benchmarks (which bias or force real gates with these distributions) and the
simulator (which turns them into token counts), so both measure the same thing. Pure Python, reproducible from
``(workload, step, world_size, num_experts, seed)``.

Experts are assumed evenly sharded in contiguous blocks (rank r owns experts ``r*E/W .. (r+1)*E/W - 1``, as
:func:`ds_hecate.planning.even_sharding` does), so "hot rank" means "the experts of one owner".

| name | what it models |
|---|---|
| W0 balanced | every rank spreads its tokens uniformly over all experts |
| W1 hot expert set | an eighth of the experts (at least one), all owned by rank 0, draw ``hot_share`` of every rank's tokens |
| W2 hot rank | every rank sends ``hot_share`` of its tokens to the experts owned by rank 0 |
| W3 spread hot | a quarter of the experts, spread over all owners, draw ``hot_share`` |
| W4 ragged sources | ranks hold different numbers of tokens (1.75x .. 0.25x) and each prefers different experts |
| W5 zero-load ranks | the experts of half of the ranks receive no tokens at all |
| W6 rotating hotspot | W1's hot set moves to the next owner every ``period`` steps |
| W7 bursts | balanced, except every ``period``-th step one expert draws ``burst_share`` of all tokens |
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Dict, List, Sequence

from ..errors import HecateError

Distribution = List[List[float]]   # [source rank][expert] -> probability that a token-expert pair picks the expert
Counts = List[List[int]]           # [source rank][expert] -> token-expert pairs


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    description: str


WORKLOADS: Dict[str, Workload] = {w.name: w for w in (
    Workload("W0", "balanced", "uniform routing from every rank"),
    Workload("W1", "hot expert set", "an eighth of the experts, owned by rank 0, draw most tokens"),
    Workload("W2", "hot rank", "the experts of rank 0 draw most tokens"),
    Workload("W3", "spread hot", "a quarter of the experts, spread over all owners, draw most tokens"),
    Workload("W4", "ragged sources", "ranks hold 1.75x..0.25x tokens and prefer different experts"),
    Workload("W5", "zero-load ranks", "the experts of half of the ranks receive no tokens"),
    Workload("W6", "rotating hotspot", "the hot expert set moves to the next owner every period steps"),
    Workload("W7", "bursts", "balanced, with a one-expert burst every period steps"),
)}

HOT_SHARE = 0.6
BURST_SHARE = 0.5
PERIOD = 10


def check_workload(name: str) -> Workload:
    """The workload called ``name`` (``W0``..``W7``), or an error listing the valid names."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise HecateError(f"unknown routing workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None


def _owned(rank: int, world_size: int, num_experts: int) -> List[int]:
    per = num_experts // world_size
    extra = num_experts % world_size
    start = rank * per + min(rank, extra)
    return list(range(start, start + per + (1 if rank < extra else 0)))


def _mix(num_experts: int, hot: Sequence[int], share: float) -> List[float]:
    """``share`` of the mass spread evenly over ``hot``, the rest evenly over all experts."""
    if not hot:
        return [1.0 / num_experts] * num_experts
    base = (1.0 - share) / num_experts
    probs = [base] * num_experts
    for e in hot:
        probs[e] += share / len(hot)
    return probs


def _quarter(num_experts: int) -> int:
    return max(1, num_experts // 4)


def expert_distribution(name: str, step: int, world_size: int, num_experts: int, seed: int = 0,
                        hot_share: float = HOT_SHARE, period: int = PERIOD) -> Distribution:
    """Per source rank, the probability of each expert being picked by a token-expert pair at ``step``."""
    check_workload(name)
    if world_size < 1 or num_experts < 1:
        raise HecateError(f"workload {name}: need world_size >= 1 and num_experts >= 1, got {world_size}, "
                          f"{num_experts}")
    rng = random.Random(f"{name}:{seed}")
    experts = list(range(num_experts))
    if name == "W0":
        return [[1.0 / num_experts] * num_experts for _ in range(world_size)]
    if name in ("W1", "W6"):
        owner = 0 if name == "W1" else (step // period) % world_size
        owned = _owned(owner, world_size, num_experts) or experts
        hot = owned[:max(1, num_experts // 8)]
        return [_mix(num_experts, hot, hot_share) for _ in range(world_size)]
    if name == "W2":
        hot = _owned(0, world_size, num_experts) or experts[:1]
        return [_mix(num_experts, hot, hot_share) for _ in range(world_size)]
    if name == "W3":
        count = _quarter(num_experts)
        # round-robin over owners so the hot experts have different owners wherever possible
        by_owner = [_owned(r, world_size, num_experts) for r in range(world_size)]
        hot = []
        depth = 0
        while len(hot) < count:
            for owned in by_owner:
                if depth < len(owned) and len(hot) < count:
                    hot.append(owned[depth])
            depth += 1
        return [_mix(num_experts, hot, hot_share) for _ in range(world_size)]
    if name == "W4":
        dist = []
        for r in range(world_size):
            preferred = rng.sample(experts, _quarter(num_experts))
            dist.append(_mix(num_experts, preferred, hot_share))
        return dist
    if name == "W5":
        idle = [e for r in range(world_size) if r % 2 == 1 for e in _owned(r, world_size, num_experts)]
        live = [e for e in experts if e not in set(idle)] or experts
        return [[(1.0 / len(live) if e in live else 0.0) for e in experts] for _ in range(world_size)]
    # W7
    if step % period == period - 1:
        burst = random.Random(f"{name}:{seed}:{step}").randrange(num_experts)
        return [_mix(num_experts, [burst], BURST_SHARE) for _ in range(world_size)]
    return [[1.0 / num_experts] * num_experts for _ in range(world_size)]


def token_shares(name: str, world_size: int) -> List[float]:
    """Relative micro-batch size per rank (mean 1.0): ragged for W4, equal otherwise."""
    check_workload(name)
    if name != "W4" or world_size == 1:
        return [1.0] * world_size
    # linear from 1.75x down to 0.25x
    return [1.75 - 1.5 * r / (world_size - 1) for r in range(world_size)]


def expected_counts(probs: Sequence[float], tokens: int, top_k: int) -> List[int]:
    """Token-expert pairs per expert for ``tokens`` tokens choosing ``top_k`` distinct experts each, with the
    pair distribution ``probs``: an integer split of ``tokens * top_k`` proportional to ``probs`` in which no
    expert gets more than ``tokens`` pairs (a token picks an expert at most once). Deterministic."""
    num_experts = len(probs)
    k = min(top_k, sum(1 for p in probs if p > 0), num_experts)
    total = tokens * k
    if total == 0:
        return [0] * num_experts
    share = [0.0] * num_experts
    capped: set = set()
    remaining = float(total)
    while True:   # water-filling: experts over the cap are pinned to it, the rest re-split
        free = [e for e in range(num_experts) if e not in capped and probs[e] > 0]
        mass = sum(probs[e] for e in free)
        over = [e for e in free if remaining * probs[e] / mass > tokens]
        if not over:
            for e in free:
                share[e] = remaining * probs[e] / mass
            break
        for e in over:
            share[e] = float(tokens)
            capped.add(e)
            remaining -= tokens
    counts = [min(tokens, int(math.floor(s))) for s in share]
    order = sorted(range(num_experts), key=lambda e: (share[e] - counts[e], -e), reverse=True)
    deficit = total - sum(counts)
    for e in order:
        if deficit <= 0:
            break
        if counts[e] < tokens and probs[e] > 0:
            counts[e] += 1
            deficit -= 1
    return counts


def routing_counts(name: str, step: int, world_size: int, num_experts: int, tokens_per_rank: int, top_k: int,
                   seed: int = 0, hot_share: float = HOT_SHARE, period: int = PERIOD) -> Counts:
    """counts[rank][expert] at ``step``: :func:`expected_counts` of each rank's distribution, with each rank's
    tokens scaled by :func:`token_shares`."""
    dist = expert_distribution(name, step, world_size, num_experts, seed, hot_share, period)
    shares = token_shares(name, world_size)
    return [expected_counts(dist[r], int(round(tokens_per_rank * shares[r])), top_k) for r in range(world_size)]
