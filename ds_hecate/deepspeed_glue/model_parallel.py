"""DeepSpeed's model-parallel unit (``mpu``) as Hecate reads it.

Megatron-DeepSpeed passes its ``mpu`` to ``deepspeed.initialize`` on every run without pipeline parallelism.
DeepSpeed then takes the data-parallel group (ZeRO, dense gradient reduction) and the tensor-parallel group from it,
and its MoE layers treat the tokens as replicated over the tensor-parallel ranks of a slice (the non-expert layers
are tensor-parallel, so every TP rank holds the same activations): each TP rank dispatches only its share of them
(``deepspeed.moe.mappings.drop_tokens``) and the expert outputs are all-gathered back (``gather_tokens``).

Hecate does the same with its own groups: they lie inside the data-parallel ranks of each tensor-parallel rank
(as DeepSpeed forms its expert groups with an mpu, ``deepspeed.utils.groups._get_expert_parallel_ranks``), every
TP rank runs its share of the slice's tokens through its Hecate group, and the groups of all TP ranks are
expert-data-parallel replicas of one another (:mod:`ds_hecate.runtime.tensor_parallel` moves the tokens).

Expert tensor parallelism (``enable_expert_tensor_parallelism``) is refused: every TP rank would have to hold and
place the same experts' slices, and each expert's internal tensor-parallel reduction pairs the TP ranks' rows, so
the groups of the TP ranks would have to plan identically (same placement, same rows in the same order), which
Hecate's groups, each planning from its own measured costs and loads, do not promise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import torch.distributed as dist
from torch import nn

from ..errors import HecateConfigError, HecateUnsupportedError

EXPERT_TP_FLAG = "enable_expert_tensor_parallelism"


@dataclass(frozen=True)
class ModelParallelLayout:
    """The world as a tensor-parallel x data-parallel grid (global ranks).

    ``tp_groups``: per data-parallel rank (slice), the global ranks of its tensor-parallel peers, ascending (the
    ranks whose tokens are the same). ``dp_members``: per tensor-parallel rank, the global ranks holding it,
    ascending (the ranks Hecate's groups of that TP rank are formed from)."""

    tp_size: int
    tp_rank: int
    tp_groups: Tuple[Tuple[int, ...], ...]
    dp_members: Tuple[Tuple[int, ...], ...]

    @property
    def dp_size(self) -> int:
        return len(self.dp_members[0])

    @staticmethod
    def data_parallel_only(world_size: int) -> "ModelParallelLayout":
        """No mpu (or one of tensor-parallel size 1): every rank a data-parallel rank of one slice."""
        return ModelParallelLayout(1, 0, tuple((r,) for r in range(world_size)), (tuple(range(world_size)),))


def tensor_parallel_size(mpu: Any) -> int:
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

    return 1 if mpu is None else int(bwc_tensor_model_parallel_world_size(mpu))


def refuse_unsupported_mpu(mpu: Any, layers: Sequence[Tuple[str, nn.Module]]) -> None:
    """Fail at initialize, before any group is built, on an mpu Hecate cannot follow: pipeline or sequence
    parallelism, and expert tensor parallelism on any MoE layer (``layers``: name, module) when the tensor-parallel
    size is above 1 (DeepSpeed itself ignores the flag without tensor parallelism)."""
    if mpu is None:
        return
    from deepspeed.utils.bwc import bwc_pipeline_parallel_world_size

    _check_interface(mpu)
    problems = []
    if bwc_pipeline_parallel_world_size(mpu) > 1:
        problems.append(f"pipeline parallelism (the mpu's pipeline-parallel size is "
                        f"{bwc_pipeline_parallel_world_size(mpu)})")
    sequence = getattr(mpu, "get_sequence_parallel_world_size", None)
    if hasattr(mpu, "initialize_sequence_parallel") or (callable(sequence) and sequence() > 1):
        problems.append("a sequence-parallel mpu (DeepSpeed-Ulysses)")
    if problems:
        raise HecateUnsupportedError("hecate does not support " + "; ".join(problems) + " yet")
    tp = tensor_parallel_size(mpu)
    flagged = [name or "<the model>" for name, m in layers if getattr(m, EXPERT_TP_FLAG, False)]
    if tp > 1 and flagged:
        raise HecateUnsupportedError(
            f"hecate does not support expert tensor parallelism: MoE layer(s) {', '.join(flagged)} set "
            f"{EXPERT_TP_FLAG}=True with a tensor-parallel size of {tp}. Hecate places whole experts per rank; with "
            "tensor-parallel experts each tensor-parallel rank's groups would have to plan identically so that every "
            "expert's internal tensor-parallel reduction pairs the same rows, which they do not. Build the layers with "
            f"{EXPERT_TP_FLAG}=False (the experts are then data-parallel over the tensor-parallel ranks, as in "
            "DeepSpeed, and Hecate shards them inside each tensor-parallel rank's data-parallel ranks), or remove the "
            "hecate section")


_INTERFACE = (("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"),
              ("get_tensor_model_parallel_rank", "get_model_parallel_rank"),
              ("get_data_parallel_world_size",), ("get_data_parallel_rank",), ("get_data_parallel_group",))


def _check_interface(mpu: Any) -> None:
    """The methods DeepSpeed and Hecate ask an mpu (either of the tensor-parallel spellings ``deepspeed.utils.bwc``
    accepts); raises naming the missing ones."""
    missing = [" or ".join(names) for names in _INTERFACE if not any(callable(getattr(mpu, n, None)) for n in names)]
    if missing:
        raise HecateConfigError(
            f"the model-parallel unit (mpu) passed to deepspeed.initialize ({type(mpu).__name__}) lacks "
            f"{', '.join(missing)}; DeepSpeed and Hecate read the tensor- and data-parallel layout from these "
            "(Megatron's mpu has them)")


def read_mpu(mpu: Any, world_size: int) -> ModelParallelLayout:
    """The grid from every rank's (tensor-parallel rank, data-parallel rank), exchanged once over the default process
    group (collective). Raises if the mpu's ranks do not form a tensor-parallel x data-parallel grid of the world."""
    if mpu is None or tensor_parallel_size(mpu) == 1:
        return ModelParallelLayout.data_parallel_only(world_size)
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

    tp = tensor_parallel_size(mpu)
    dp = int(mpu.get_data_parallel_world_size())
    mine = (int(bwc_tensor_model_parallel_rank(mpu)), int(mpu.get_data_parallel_rank()))
    gathered: List[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    pairs: List[Tuple[int, int]] = [(t, d) for t, d in gathered]
    expected = {(t, d) for t in range(tp) for d in range(dp)}
    if tp * dp != world_size or set(pairs) != expected or len(set(pairs)) != world_size:
        raise HecateUnsupportedError(
            f"the model-parallel unit's ranks do not form a grid of the {world_size} ranks: tensor-parallel size {tp} "
            f"x data-parallel size {dp}, (tensor-parallel rank, data-parallel rank) per global rank {pairs}; Hecate "
            "needs every rank to be one tensor-parallel rank of one data-parallel slice")
    tp_groups = tuple(tuple(r for r, (_, d) in enumerate(pairs) if d == slice_) for slice_ in range(dp))
    dp_members = tuple(tuple(r for r, (t, _) in enumerate(pairs) if t == t_rank) for t_rank in range(tp))
    return ModelParallelLayout(tp, mine[0], tp_groups, dp_members)


def hecate_rank_order(layout: ModelParallelLayout, ep_size: int) -> Tuple[int, ...]:
    """Global rank of each position of Hecate's groups (position ``g * G + l``: local rank ``l`` of group ``g``).

    Groups are ``G`` consecutive data-parallel ranks (ascending global rank) of one tensor-parallel rank, ordered by
    their first rank: without tensor parallelism the identity, groups of consecutive ranks. Every group and every
    expert-data-parallel peer set (local rank ``l`` of each group) is then ascending in global rank, so a rank's
    position in a process group built from either is its local rank or its group index, as Hecate numbers them;
    raises for an mpu layout where that does not hold."""
    groups = sorted((members[i:i + ep_size] for members in layout.dp_members
                     for i in range(0, len(members), ep_size)), key=lambda g: g[0])
    for local in range(ep_size):
        peers = [g[local] for g in groups]
        if peers != sorted(peers):
            raise HecateUnsupportedError(
                f"Hecate cannot lay its groups of {ep_size} over this model-parallel unit's ranks (data-parallel "
                f"ranks per tensor-parallel rank: {[list(m) for m in layout.dp_members]}): the ranks holding the "
                "same experts would not be in the same order in every group; use an mpu whose data-parallel ranks of "
                "each tensor-parallel rank are ordered alike (Megatron's layout), or set hecate.ep_size")
    return tuple(r for g in groups for r in g)


def register_with_deepspeed(ep_size: int, token_group: Any, token_ranks: Sequence[int], edp_group: Any,
                            edp_ranks: Sequence[int]) -> str:
    """Enter Hecate's groups in DeepSpeed's expert-group registry as ``ep_size_<G>`` (unless DeepSpeed already has
    groups of that name), so what DeepSpeed users read stays meaningful: ``groups._get_expert_parallel_world_size``
    (G) and ``_get_expert_data_parallel_world_size`` (the replicas), the engine's ``expert_parallel_group`` and
    ``expert_data_parallel_group``. Returns the name."""
    from deepspeed.utils import groups

    name = f"ep_size_{ep_size}"
    if name not in groups._EXPERT_PARALLEL_GROUP and name not in groups._EXPERT_DATA_PARALLEL_GROUP:
        groups._EXPERT_PARALLEL_GROUP[name] = token_group
        groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(token_ranks)
        groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(edp_ranks)
    return name
