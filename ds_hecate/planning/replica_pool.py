"""The replica pool: ``hecate.materialize_budget_mb`` as one pool of replica slots shared by every MoE layer.

Why a pool rather than an even split: each layer's replicas live from its (prefetched) SparseAllGather until its
backward has used them, so in one step every resident layer holds its replicas at once, and a budget split evenly
over ``L`` layers in whole experts wastes the remainder of every layer's share (DeepSeek-V3 at 1,024 H100s: 8 GiB
over 58 layers of 84 MiB experts is 1.67 experts a layer, 1 granted, 40% of the budget never used; MoonEP and
UltraEP keep one pool). Here each layer call takes its slots with the prefetch and returns them when its backward is
done, and the pool lends the whole budget:

- **Resident layers** (replicas kept from forward to backward) take slots in call order, each a rolling share of
  what the layers before it left: ``floor(left / (layers left x expert bytes))``. The remainders roll forward, so
  the layers together use the budget to the last whole expert, and no layer gets less than the even split.
- **Re-materializing layers** (replicas freed after forward and gathered again in backward) hold theirs only while
  they run, one layer at a time: they share one reserve, each taking all of it while it runs. With every layer
  re-materializing the reserve is the whole budget (Hecate-RM); with some, their share of it
  (``budget x layers re-materializing / layers``), the resident layers rolling over the rest; a layer that share
  would give no more than residency stays resident.
- **Which layers re-materialize** (``hecate.rematerialize`` null): a layer whose even share of the pool, resident,
  is below a quarter of the experts a rank owns, while the pool alone would hold more
  (:func:`rematerializes_by_default`). ``rematerialize`` true or false forces every layer.

The grant is uniform over ranks and a function of the configuration only, so every rank plans every layer with the
same budget, the schedule's re-use check sees the same budget at every call, and the simulator plans each class of
identical layers once. The bound it keeps: at any moment at most every resident layer's slots and one
re-materializing layer's are allocated, ``resident_bytes + max(reserve) <= budget`` (:attr:`ReplicaPool.peak_bytes`;
``tests/test_replica_pool.py`` checks it, ``tests/test_memory_budget.py`` measures it with the allocator). Slots are
counted in the compute dtype, calibration's reserved rows included; gradients are not in the budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

#: a layer re-materializes by default when its even resident share is below this fraction of the experts a rank owns
REMATERIALIZE_BELOW_OWNED_FRACTION = 0.25


@dataclass(frozen=True)
class LayerGrant:
    """One layer's slots: ``replicas`` experts of other ranks per rank (prefetched, calibration's extras and their
    reserved rows together), held until backward or, ``rematerialize``, only while the layer runs."""

    replicas: int
    rematerialize: bool
    expert_bytes: int

    @property
    def bytes(self) -> int:
        return self.replicas * self.expert_bytes


def even_share(budget_bytes: int, expert_bytes: int, resident_layers: int) -> int:
    """Replicas one layer gets from ``budget_bytes`` split evenly over ``resident_layers`` (the pre-pool split)."""
    return int(budget_bytes // (max(1, resident_layers) * expert_bytes)) if expert_bytes > 0 else 0


def rematerializes_by_default(budget_bytes: int, expert_bytes: int, layers: int, owned_per_rank: int) -> bool:
    """``rematerialize: null`` for one layer: its even resident share is below a quarter of the experts a rank owns
    (a hot rank's load is spread over the experts it owns; fewer slots than a quarter of them cannot take enough of
    it for the planner's ``min_gain``), while holding one layer at a time leaves it more.

    Simulated at 1,024 H100s with the default 8 GiB budget (``ds-hecate simulate --config`` with ``rematerialize``
    false against ``hecate-rm``): DeepSeek-V3 at ``ep_size`` 8 (1 slot for 32 experts) W3 1.00x of EP resident,
    1.08x re-materialized, W1 1.11x both; at 64 (1 slot for 4) W3 1.46x against 1.44x; Mixtral-8x7B (no resident
    slot) 1.00x against 1.46x. The even share, not the rolling one, so identical layers decide alike."""
    resident = even_share(budget_bytes, expert_bytes, layers)
    alone = even_share(budget_bytes, expert_bytes, 1)
    return resident < REMATERIALIZE_BELOW_OWNED_FRACTION * owned_per_rank and alone > resident


@dataclass(frozen=True)
class ReplicaPool:
    """Every layer's grant from one pool of ``budget_bytes`` per rank (layers in call order)."""

    budget_bytes: int
    grants: Tuple[LayerGrant, ...]

    @classmethod
    def plan(cls, budget_mb: float, expert_bytes: Sequence[int], owned_per_rank: Sequence[int],
             rematerialize: Optional[bool]) -> "ReplicaPool":
        """The pool for layers of ``expert_bytes`` (one expert, compute dtype) whose ranks own up to
        ``owned_per_rank`` experts each, in call order; ``rematerialize`` is ``hecate.rematerialize``."""
        if len(expert_bytes) != len(owned_per_rank):
            raise ValueError(f"ReplicaPool.plan: {len(expert_bytes)} expert sizes for {len(owned_per_rank)} layers")
        if any(b <= 0 for b in expert_bytes):
            raise ValueError(f"ReplicaPool.plan: expert sizes must be positive, got {list(expert_bytes)}")
        budget = int(budget_mb * (1 << 20))
        layers = len(expert_bytes)
        if rematerialize is None:
            modes = [rematerializes_by_default(budget, b, layers, k) for b, k in zip(expert_bytes, owned_per_rank)]
        else:
            modes = [bool(rematerialize)] * layers
        while True:
            reserve = budget * sum(modes) // max(1, layers)
            # by default, a layer the reserve (shared by fewer layers than all) gives no more than residency stays
            # resident; that shrinks the reserve, so repeat until no layer changes
            kept = [rm and (rematerialize is not None or reserve // b > even_share(budget, b, layers))
                    for b, rm in zip(expert_bytes, modes)]
            if kept == modes:
                break
            modes = kept
        rematerializing = sum(modes)
        left, resident_left = budget - reserve, layers - rematerializing
        grants = []
        for b, rm in zip(expert_bytes, modes):
            if rm:
                grants.append(LayerGrant(reserve // b, True, b))
                continue
            share = left // (resident_left * b)
            grants.append(LayerGrant(share, False, b))
            left -= share * b
            resident_left -= 1
        return cls(budget, tuple(grants))

    @property
    def resident_bytes(self) -> int:
        """Slots held from forward to backward, every resident layer together."""
        return sum(g.bytes for g in self.grants if not g.rematerialize)

    @property
    def peak_bytes(self) -> int:
        """The most the pool lends at once: every resident layer's slots and the largest re-materializing grant."""
        return self.resident_bytes + max((g.bytes for g in self.grants if g.rematerialize), default=0)

    @property
    def rematerializes(self) -> bool:
        """Whether any layer re-materializes."""
        return any(g.rematerialize for g in self.grants)

    def describe(self) -> str:
        """One line for logs and ``ds-hecate plan``: grants by kind, and what the pool lends at its peak."""
        resident = [g.replicas for g in self.grants if not g.rematerialize]
        rm = [g.replicas for g in self.grants if g.rematerialize]
        parts = []
        if resident:
            parts.append(f"{len(resident)} resident layer(s) {min(resident)}-{max(resident)} replica(s) per rank "
                         f"({sum(resident)} in all)" if min(resident) != max(resident) else
                         f"{len(resident)} resident layer(s) {resident[0]} replica(s) per rank each")
        if rm:
            parts.append(f"{len(rm)} re-materializing layer(s) {max(rm)} replica(s) per rank while each runs")
        used = self.peak_bytes / self.budget_bytes if self.budget_bytes else 0.0
        return f"replica pool: {'; '.join(parts) or 'no layer'}; {used:.0%} of the budget lent at the peak"
