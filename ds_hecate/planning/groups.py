"""Hecate domains (``hecate.ep_size``): groups of consecutive ranks that shard every expert once, replicated across
groups by expert data parallelism (EDP).

Why: with one owner per expert in the whole world, every rank plans, gathers and dispatches over every rank, and at
1,024 ranks with 8 or 256 experts most ranks own nothing and must materialize replicas each step just to have work
(docs/benchmarks.md, "1,024 GPUs"). Groups of ``ep_size`` ranks each hold one whole copy of every expert, sharded whole over
the group's ranks (heterogeneous sharding inside the group), and the ``world / ep_size`` groups are data-parallel replicas
of each other, as DeepSpeed's ``ep_size`` with its expert-data-parallel groups (``deepspeed/utils/groups.py``):
rank ``r`` and ``r + ep_size`` hold the same experts and reduce their gradients together at the accumulation boundary.

Pure (standard library only): the runtime resolves the group size with :func:`resolve_ep_size` at initialize, and
the simulator and ``ds-hecate plan`` with the same call, so all three use one rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from ..errors import HecateConfigError

#: the config key this module resolves, as error and warning messages name it
EP_SIZE_KEY = "hecate.ep_size"


def _splits_nodes(ep_size: int, ranks_per_node: int) -> bool:
    """A group splits a node unless it is a whole number of nodes or a whole fraction of one."""
    return ep_size % ranks_per_node != 0 and ranks_per_node % ep_size != 0


def _check_divides(value: int, source: str, world_size: int, num_experts: Optional[int]) -> None:
    """Raise :class:`HecateConfigError` naming ``source`` when ``value`` is not a positive divisor of the world."""
    if value >= 1 and world_size % value == 0:
        return
    cap = world_size if num_experts is None else max(1, num_experts)
    usable = ", ".join(str(d) for d in range(1, cap + 1) if world_size % d == 0)
    within = "" if num_experts is None else f" up to the {num_experts} experts"
    raise HecateConfigError(
        f"{source} = {value} must be a positive divisor of the world size {world_size} (groups of consecutive ranks, "
        f"each holding every expert once); divisors{within}: {usable}")


def _split_warning(value: int, source: str, ranks_per_node: int, world_size: int, num_experts: int) -> str:
    aligned = [d for d in range(1, world_size + 1)
               if world_size % d == 0 and d <= max(1, num_experts) and not _splits_nodes(d, ranks_per_node)]
    return (f"{source} = {value} splits nodes of {ranks_per_node} ranks (neither a multiple nor a divisor of it): "
            f"some groups span a node boundary, so their token all-to-all, SparseAllGather and SparseReduceScatter "
            f"cross the inter-node network where a node-aligned group would stay on the node's own links, and the "
            f"expert-data-parallel gradient reduction shares the nodes' NICs unevenly; node-aligned choices: "
            f"{', '.join(str(d) for d in aligned)}")


def resolve_ep_size(explicit: Optional[int], layer_ep_sizes: Sequence[int], world_size: int,
                    num_experts: Union[int, Sequence[int]], ranks_per_node: int) -> Tuple[int, Optional[str]]:
    """The group size ``ep_size`` (``hecate.ep_size``) and a warning to log, or None.

    In order:

    1. ``explicit`` (the config's ``hecate.ep_size``): taken as given. It must divide ``world_size`` (else
       :class:`HecateConfigError` naming the key and the value); one that splits a node is accepted, with a warning
       saying what it costs.
    2. ``layer_ep_sizes``: the ``ep_size`` of the converted ``deepspeed.moe`` / ``ds_hecate.MoE`` layers; values of
       1 (or below) say nothing and are ignored. The one value above 1 is taken (checked like an explicit value);
       layers that disagree are an error naming their values, since one Hecate domain serves every layer.
    3. ``world_size`` when it is at most the number of experts: one group, today's whole-world FSSDP.
    4. Otherwise the largest divisor of ``world_size`` that is at most the number of experts and does not split a
       node (a multiple or a divisor of ``ranks_per_node``); 1 always qualifies.

    ``num_experts``: one count, or one per MoE layer; with layers of different sizes the smallest counts, so that
    every layer has at least one expert per rank of a group. ``ranks_per_node`` above ``world_size`` means one node.
    """
    counts = [num_experts] if isinstance(num_experts, int) else list(num_experts)
    if not counts or min(counts) < 1 or world_size < 1 or ranks_per_node < 1:
        raise ValueError(f"resolve_ep_size needs world_size, ranks_per_node and num_experts >= 1, got {world_size}, "
                         f"{ranks_per_node}, {counts}")
    experts = min(counts)
    rpn = min(ranks_per_node, world_size)
    if explicit is not None:
        return _checked(int(explicit), EP_SIZE_KEY, world_size, experts, rpn)
    declared = sorted({int(v) for v in layer_ep_sizes if int(v) > 1})
    if len(declared) > 1:
        raise HecateConfigError(
            f"the converted MoE layers declare different ep_size values {declared}; one Hecate domain serves every "
            f"layer: build them with one ep_size or set {EP_SIZE_KEY}")
    if declared:
        return _checked(declared[0], "the MoE layers' ep_size", world_size, experts, rpn)
    if world_size <= experts:
        return world_size, None
    return max(d for d in range(1, experts + 1) if world_size % d == 0 and not _splits_nodes(d, rpn)), None


def _checked(value: int, source: str, world_size: int, experts: int, rpn: int) -> Tuple[int, Optional[str]]:
    _check_divides(value, source, world_size, experts)
    warning = _split_warning(value, source, rpn, world_size, experts) if _splits_nodes(value, rpn) else None
    return value, warning


@dataclass(frozen=True)
class ExpertGroups:
    """``world_size / ep_size`` groups of ``ep_size`` consecutive ranks; group ``g`` is ranks ``[g*ep_size, (g+1)*ep_size)``.

    Inside a group a rank is known by its local rank (what the group's planner calls a rank); across groups the
    ranks with the same local rank are expert-data-parallel peers, holding the same experts.
    """

    world_size: int
    ep_size: int
    ranks_per_node: int = 1

    def __post_init__(self) -> None:
        _in_range("ranks_per_node", self.ranks_per_node, 1, 1 << 62)
        _check_divides(self.ep_size, EP_SIZE_KEY, self.world_size, None)

    @property
    def num_groups(self) -> int:
        return self.world_size // self.ep_size

    @property
    def edp_size(self) -> int:
        """R: the peers of every rank's experts (one per group), the data-parallel degree of expert state."""
        return self.num_groups

    @property
    def splits_nodes(self) -> bool:
        """Whether some group spans a node boundary without being whole nodes."""
        return _splits_nodes(self.ep_size, min(self.ranks_per_node, self.world_size))

    @property
    def spans_nodes(self) -> bool:
        """Whether a group's collectives reach other nodes (groups larger than a node)."""
        return self.ep_size > self.ranks_per_node

    def group_of(self, rank: int) -> int:
        _in_range("rank", rank, 0, self.world_size)
        return rank // self.ep_size

    def local_rank(self, rank: int) -> int:
        """The rank's index inside its group: the rank as the group's planner and communicator know it."""
        _in_range("rank", rank, 0, self.world_size)
        return rank % self.ep_size

    def global_rank(self, group: int, local_rank: int) -> int:
        _in_range("group", group, 0, self.num_groups)
        _in_range("local rank", local_rank, 0, self.ep_size)
        return group * self.ep_size + local_rank

    def group_ranks(self, group: int) -> Tuple[int, ...]:
        _in_range("group", group, 0, self.num_groups)
        return tuple(range(group * self.ep_size, (group + 1) * self.ep_size))

    def edp_peers(self, rank: int) -> Tuple[int, ...]:
        """The ranks holding the same experts as ``rank`` (itself included), ascending: ``rank mod ep_size`` + k*ep_size."""
        return tuple(range(self.local_rank(rank), self.world_size, self.ep_size))

    def all_groups(self) -> List[Tuple[int, ...]]:
        return [self.group_ranks(g) for g in range(self.num_groups)]

    def describe(self, rank: int, order: Optional[Sequence[int]] = None) -> str:
        """How messages name the rank at position ``rank``: its global rank (``order[rank]`` where the positions
        are not the global ranks, as with a model-parallel unit), and with several groups its group and index in it
        (``global rank 2 (group 1, index 0)``)."""
        name = f"global rank {order[rank] if order is not None else rank}"
        if self.num_groups == 1:
            return name
        return f"{name} (group {self.group_of(rank)}, index {self.local_rank(rank)})"


def data_parallel_ranks_per_node(ranks_per_node: int, tp_size: int) -> int:
    """Data-parallel ranks of one tensor-parallel rank on one node (what a Hecate group's planner sees as a node):
    the node's ranks over the TP size when TP groups lie inside nodes (Megatron's layout), else 1 (TP groups spanning
    nodes: one such rank per node)."""
    return ranks_per_node // tp_size if ranks_per_node % tp_size == 0 else 1


def _in_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value < high:
        raise ValueError(f"ExpertGroups: {name} {value} out of range [{low}, {high})")
