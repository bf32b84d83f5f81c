"""The plan of one MoE layer call: sharded placement P, materialized placement P', and token routes.

Pure data: no torch, no torch.distributed (numpy only). Every rank computes the same plan from the same all-gathered counts,
so every quantity the collectives need (who sends which expert to whom, how many tokens go where) is derived here,
identically on every rank.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Sequence, Set, Tuple, Union

import numpy as np

#: routes[src][expert] = ((dst, n_tokens), ...): where src's token-expert pairs for that expert are processed.
Routes = Tuple[Tuple[Tuple[Tuple[int, int], ...], ...], ...]
#: materialized[rank] = experts that rank holds for the call (owned or replicated): a :class:`Placement`'s P'.
Materialized = Tuple[Tuple[int, ...], ...]
#: A ``[rank][expert]`` table as the planner takes it: nested sequences, or the 2-D numpy array it computes with.
#: ``IntMatrix``: counts of token-expert pairs, or a placement as per-rank expert lists or a bool holders matrix;
#: ``FloatMatrix``: loads (predicted counts).
IntMatrix = Union[Sequence[Sequence[int]], np.ndarray]
FloatMatrix = Union[Sequence[Sequence[float]], np.ndarray]
#: ``owners[expert]`` = the rank owning it: a sequence, or the 1-D numpy array the simulator keeps.
IntVector = Union[Sequence[int], np.ndarray]


def holders_matrix(placement, world: int, num_experts: int) -> np.ndarray:
    """A placement as a ``[ranks, experts]`` bool matrix (given as one, or as per-rank expert lists)."""
    if isinstance(placement, np.ndarray) and placement.dtype == bool:
        return placement
    holders = np.zeros((world, num_experts), dtype=bool)
    # one scatter for every rank (a Python loop of per-rank scatters cost ~0.1 ms at 32 ranks on the critical path)
    lengths = [len(experts) for experts in placement]
    if sum(lengths):
        rows = np.repeat(np.arange(len(lengths)), lengths)
        cols = np.fromiter(itertools.chain.from_iterable(placement), dtype=np.int64, count=sum(lengths))
        holders[rows, cols] = True
    return holders


def materialized_of(holders: np.ndarray) -> Materialized:
    """A ``[ranks, experts]`` bool matrix as per-rank expert lists (the inverse of :func:`holders_matrix`), from
    one ``nonzero`` over the whole matrix (a ``flatnonzero`` per rank cost ~0.3 ms at 32 ranks, three times per
    calibrated call)."""
    rows, cols = np.nonzero(holders)
    cut = np.searchsorted(rows, np.arange(holders.shape[0] + 1)).tolist()
    experts = cols.tolist()
    return tuple(tuple(experts[cut[r]:cut[r + 1]]) for r in range(holders.shape[0]))


def owned_experts(owners: IntVector, world: int) -> Materialized:
    """The sharded placement P as per-rank expert lists: each expert on its owner only (plain expert parallelism)."""
    owned: List[List[int]] = [[] for _ in range(world)]
    for e, o in enumerate(owners):
        owned[int(o)].append(e)
    return tuple(tuple(x) for x in owned)


@dataclass(frozen=True)
class Placement:
    """Sharded placement P (``owners``) and materialized placement P' (``materialized``) of one layer call.

    This is all SparseAllGather and SparseReduceScatter need, so it exists before the tokens are routed (the
    gather can be prefetched from a predicted placement).
    """

    owners: Tuple[int, ...]
    materialized: Tuple[Tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.materialized)

    @cached_property
    def holders(self) -> "np.ndarray":
        """``[ranks, experts]`` bool matrix of ``materialized``: the vectorised planner's view of P'."""
        return holders_matrix(self.materialized, len(self.materialized), len(self.owners))

    @cached_property
    def gather_pairs(self) -> Tuple[Tuple[int, int], ...]:
        """(expert, dst) pairs in P' \\ P, sorted: the owner of each expert sends it to dst (and dst sends back
        its gradient in SparseReduceScatter)."""
        pairs = []
        for dst, experts in enumerate(self.materialized):
            for e in experts:
                if self.owners[e] != dst:
                    pairs.append((e, dst))
        return tuple(sorted(pairs))

    @property
    def num_moved(self) -> int:
        """Number of (expert, rank) replicas that cross the wire: lambda * E in the paper's notation."""
        return len(self.gather_pairs)

    def gather_sends(self, rank: int) -> Dict[int, List[int]]:
        """dst -> experts (ascending) that ``rank`` (as owner) sends in SparseAllGather."""
        out: Dict[int, List[int]] = {}
        for e, dst in self.gather_pairs:
            if self.owners[e] == rank:
                out.setdefault(dst, []).append(e)
        return out

    def gather_recvs(self, rank: int) -> Dict[int, List[int]]:
        """src (owner) -> experts (ascending) that ``rank`` receives in SparseAllGather."""
        out: Dict[int, List[int]] = {}
        for e, dst in self.gather_pairs:
            if dst == rank:
                out.setdefault(self.owners[e], []).append(e)
        return out


@dataclass(frozen=True)
class LayerPlan:
    """Placement + dispatch for one layer call.

    ``owners[e]`` is the rank holding expert e's master weights and optimizer state (P, surjective).
    ``materialized[r]`` is the sorted tuple of experts present on rank r during this call (P' ⊇ P).
    ``routes`` says, for each source rank and expert, which ranks process its tokens and how many.
    """

    world_size: int
    num_experts: int
    owners: Tuple[int, ...]
    materialized: Tuple[Tuple[int, ...], ...]
    routes: Routes

    def __post_init__(self) -> None:
        validate_plan(self)

    @cached_property
    def placement(self) -> Placement:
        return Placement(self.owners, self.materialized)

    @property
    def gather_pairs(self) -> Tuple[Tuple[int, int], ...]:
        return self.placement.gather_pairs

    @property
    def num_moved(self) -> int:
        return self.placement.num_moved

    def gather_sends(self, rank: int) -> Dict[int, List[int]]:
        return self.placement.gather_sends(rank)

    def gather_recvs(self, rank: int) -> Dict[int, List[int]]:
        return self.placement.gather_recvs(rank)

    # ----- token dispatch ---------------------------------------------------------------------------------------
    @cached_property
    def token_matrix(self) -> Tuple[Tuple[Tuple[int, ...], ...], ...]:
        """token_matrix[src][dst][e]: number of src's token-expert pairs for expert e processed on dst."""
        n, num_e = self.world_size, self.num_experts
        m = [[[0] * num_e for _ in range(n)] for _ in range(n)]
        for src in range(n):
            for e in range(num_e):
                for dst, cnt in self.routes[src][e]:
                    m[src][dst][e] += cnt
        return tuple(tuple(tuple(row) for row in per_src) for per_src in m)

    def send_splits(self, rank: int) -> List[int]:
        """Tokens ``rank`` sends to each dst (its own entry is the part that stays local)."""
        return [sum(self.token_matrix[rank][dst]) for dst in range(self.world_size)]

    def recv_splits(self, rank: int) -> List[int]:
        """Tokens ``rank`` receives from each src."""
        return [sum(self.token_matrix[src][rank]) for src in range(self.world_size)]

    def loads(self) -> List[int]:
        """Token-expert pairs each rank computes under the routes (its compute load), all ranks in one pass."""
        loads = [0] * self.world_size
        for per_src in self.routes:
            for per_expert in per_src:
                for dst, n in per_expert:
                    loads[dst] += n
        return loads

    def tokens_processed(self, rank: int) -> int:
        """Token-expert pairs whose expert compute runs on ``rank``: its compute load."""
        return sum(self.recv_splits(rank))

    def node_traffic(self, ranks_per_node: int) -> Tuple[int, int]:
        """(token rows crossing nodes, of which avoidable: a rank on the source's node had the expert)."""
        nodes_holding: List[Set[int]] = [set() for _ in range(self.num_experts)]
        for r, experts in enumerate(self.materialized):
            for e in experts:
                nodes_holding[e].add(r // ranks_per_node)
        crossing = avoidable = 0
        for src in range(self.world_size):
            node = src // ranks_per_node
            for e in range(self.num_experts):
                local_holder = node in nodes_holding[e]
                for dst, cnt in self.routes[src][e]:
                    if dst // ranks_per_node != node:
                        crossing += cnt
                        avoidable += cnt if local_holder else 0
        return crossing, avoidable

    def expert_load_on(self, rank: int) -> List[int]:
        """Per expert, token-expert pairs processed on ``rank``."""
        return [sum(self.token_matrix[src][rank][e] for src in range(self.world_size))
                for e in range(self.num_experts)]


def validate_plan(plan: LayerPlan) -> None:
    """Check the invariants every collective relies on; a violated one would hang or corrupt, so fail here."""
    n, num_e = plan.world_size, plan.num_experts
    if len(plan.owners) != num_e or any(not 0 <= o < n for o in plan.owners):
        raise ValueError(f"plan: owners must give a rank in [0, {n}) for each of {num_e} experts: {plan.owners}")
    if len(plan.materialized) != n:
        raise ValueError(f"plan: materialized must list {n} ranks, got {len(plan.materialized)}")
    for r, experts in enumerate(plan.materialized):
        if list(experts) != sorted(set(experts)) or any(not 0 <= e < num_e for e in experts):
            raise ValueError(f"plan: materialized[{r}] must be sorted unique expert ids, got {experts}")
    for e, o in enumerate(plan.owners):
        if e not in plan.materialized[o]:
            raise ValueError(f"plan: owner {o} of expert {e} must materialize it (P ⊆ P')")
    if len(plan.routes) != n or any(len(per_src) != num_e for per_src in plan.routes):
        raise ValueError("plan: routes must be [world_size][num_experts]")
    present = [set(m) for m in plan.materialized]
    for src in range(n):
        for e in range(num_e):
            for dst, cnt in plan.routes[src][e]:
                if cnt < 0 or not 0 <= dst < n:
                    raise ValueError(f"plan: bad route {(dst, cnt)} for src {src} expert {e}")
                if cnt > 0 and e not in present[dst]:
                    raise ValueError(f"plan: tokens of expert {e} routed to rank {dst}, which lacks it")


def route_counts(routes: Routes, src: int, expert: int) -> int:
    """Total token-expert pairs of (src, expert) covered by the routes."""
    return sum(cnt for _, cnt in routes[src][expert])


def check_routes_cover(plan: LayerPlan, counts: IntMatrix) -> None:
    """Every counted token-expert pair must be routed exactly once."""
    for src in range(plan.world_size):
        for e in range(plan.num_experts):
            got = route_counts(plan.routes, src, e)
            if got != counts[src][e]:
                raise ValueError(f"plan: routes of src {src} expert {e} cover {got} pairs, counts say {counts[src][e]}")
