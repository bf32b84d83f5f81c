"""Model-state bytes per rank: DeepSpeed's ZeRO accounting and Hecate's expert shards, with expert data parallelism.

One accounting for the simulator's memory column and ``ds-hecate plan`` (``sim/memory_plan.py``), so the two cannot
disagree. Pure Python.

- DeepSpeed (dense parameters, and the experts of expert parallelism over their expert-data-parallel group): with
  bf16/fp16, 2-byte params and grads plus an fp32 master and the optimizer state; with fp32, 4-byte params and grads
  and the optimizer state only. ZeRO stage 1 partitions the optimizer state (and master) over the data-parallel
  ranks, stage 2 also the gradients, stage 3 also the parameters (``dense_state_bytes``).
- Hecate's owned experts (the shard store: fp32 master, fp32 gradient accumulator kept across steps, the expert
  optimizer's state, and the resident weights in the compute dtype the layer calls compute from and SparseAllGather
  sends, refreshed once per optimizer step). With fp32 compute and whole masters the masters are those weights (no
  second copy); with bf16/fp16 compute the resident copy adds 2 bytes per parameter. With one group (``edp_size`` 1)
  that is all, one copy in the job. With ``R = edp_size`` expert-data-parallel peers and ZeRO stage 1 or above, each
  peer steps ``1/R`` of the master and optimizer state after a reduce-scatter of the gradient, and the updated
  weights are all-gathered into the resident full copy in the compute dtype (fp32 compute included: the master is
  then this peer's slice apart from it). The gradient is kept as this peer's fp32 slice: in the backward that ends
  an accumulation window each layer's whole fp32 rows are reduce-scattered as soon as its SparseReduceScatter is
  done and released, so at most two layers' whole rows exist at once (:func:`transient_grad_bytes`; with gradient
  accumulation the rows of the earlier micro-batches stay whole until then). ZeRO stage 0 all-reduces the gradient
  and every peer steps the full expert.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

#: fp32 master weights and gradient accumulators of owned experts (shard_store.LayerShard).
MASTER_BYTES_PER_PARAM = 4
GRAD_BYTES_PER_PARAM = 4
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class OptimizerStateLayout:
    """Optimizer state of one parameter tensor: ``vectors`` per-element states (bytes per element each) and
    ``scalar_bytes`` per tensor (e.g. Adam's 0-d ``step``)."""

    name: str
    vector_bytes: Tuple[int, ...]
    scalar_bytes: int

    def bytes_for(self, numel: int) -> int:
        return sum(b * numel for b in self.vector_bytes) + self.scalar_bytes

    @property
    def bytes_per_param(self) -> int:
        return sum(self.vector_bytes)


#: torch AdamW on fp32 masters: exp_avg, exp_avg_sq, 0-d step (what the simulator assumes unless told otherwise)
ADAM = OptimizerStateLayout("AdamW", (4, 4), 4)


def dense_state_bytes(dense_params: int, world_size: int, zero_stage: int, precision: str,
                      optimizer_bytes_per_param: int) -> Tuple[int, int, int]:
    """(params, grads, optimizer state) bytes per rank for parameters DeepSpeed keeps, partitioned under ZeRO over
    ``world_size`` data-parallel ranks (for expert parallelism's experts: the expert-data-parallel group)."""
    half = precision in ("bf16", "fp16")
    param_b, grad_b = (2, 2) if half else (4, 4)
    opt_b = optimizer_bytes_per_param + (4 if half else 0)   # fp32 master copy with mixed precision
    shard = lambda n, on: int(math.ceil(n / world_size)) if on else n   # noqa: E731
    return (shard(dense_params * param_b, zero_stage >= 3), shard(dense_params * grad_b, zero_stage >= 2),
            shard(dense_params * opt_b, zero_stage >= 1))


@dataclass(frozen=True)
class ExpertState:
    """Bytes one rank holds for one expert it owns, under the names of ``engine.hecate.memory_bytes()``."""

    expert_weights: int            # resident full copy in the compute dtype (none where the fp32 masters are it)
    expert_master: int             # fp32 master (or this rank's 1/R partition of it)
    expert_grad: int               # fp32 gradient accumulator (whole, or partitioned this rank's slice)
    expert_optimizer_state: int    # the expert optimizer's state (or its 1/R partition)

    @property
    def total(self) -> int:
        return self.expert_weights + self.expert_master + self.expert_grad + self.expert_optimizer_state


def compute_bytes(precision: str) -> int:
    """Bytes per parameter in the compute dtype (``bf16``, ``fp16`` or ``fp32``)."""
    if precision not in DTYPE_BYTES:
        raise ValueError(f"precision must be one of {sorted(DTYPE_BYTES)}, got {precision!r}")
    return DTYPE_BYTES[precision]


def partitions_over_edp(edp_size: int, zero_stage: int) -> bool:
    """Whether expert master and optimizer state are split over the expert-data-parallel peers (ZeRO >= 1)."""
    return edp_size > 1 and zero_stage >= 1


def owned_expert_state(numel: int, edp_size: int, zero_stage: int, precision: str,
                       optimizer: OptimizerStateLayout) -> ExpertState:
    """What Hecate holds per owned expert of ``numel`` parameters with ``edp_size`` peers (see the module doc)."""
    compute_b = compute_bytes(precision)
    grad = numel * GRAD_BYTES_PER_PARAM
    if not partitions_over_edp(edp_size, zero_stage):
        weights = 0 if compute_b == MASTER_BYTES_PER_PARAM else numel * compute_b   # fp32: the masters are it
        return ExpertState(weights, numel * MASTER_BYTES_PER_PARAM, grad, optimizer.bytes_for(numel))
    part = int(math.ceil(numel / edp_size))
    return ExpertState(numel * compute_b, part * MASTER_BYTES_PER_PARAM, part * GRAD_BYTES_PER_PARAM,
                       optimizer.bytes_for(part))


def transient_grad_bytes(numel: int, owned_per_layer: int, edp_size: int, zero_stage: int) -> int:
    """Partitioned: the whole fp32 gradient rows alive at once in the window's last backward (two layers': the one
    being reduce-scattered and the next one arriving); otherwise none beyond :func:`owned_expert_state`."""
    if not partitions_over_edp(edp_size, zero_stage):
        return 0
    return 2 * owned_per_layer * numel * GRAD_BYTES_PER_PARAM


def ep_expert_state_bytes(numel: int, edp_size: int, zero_stage: int, precision: str,
                          optimizer: OptimizerStateLayout) -> int:
    """Bytes per rank for ``numel`` expert parameters under DeepSpeed's expert parallelism: its ZeRO partitioning
    over the expert-data-parallel group of ``edp_size`` ranks."""
    return sum(dense_state_bytes(numel, edp_size, zero_stage, precision, optimizer.bytes_per_param))
