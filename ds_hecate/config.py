"""The ``hecate`` section of a DeepSpeed config: schema, validation and extraction.

The canonical place is ``zero_optimization.hecate``; a top-level ``hecate`` section is an alias. DeepSpeed never
sees the section: :func:`split_hecate_section` removes it before DeepSpeed parses the config, so DeepSpeed's own
``extra="forbid"`` models stay untouched, and every key is validated here instead, strictly, with errors that
name the key.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .comm.backend import COMM_BACKENDS, DEVICE_KERNELS
from .errors import HecateConfigError
from .planning.placement import PLACEMENT_POLICIES

if TYPE_CHECKING:   # a Literal built from a tuple at run time is beyond a static checker: plain strings there
    PlacementName = str
    CommBackendName = str
    DeviceKernelsName = str
else:
    #: Placement policies the planner knows, as it defines them
    #: (:data:`ds_hecate.planning.placement.PLACEMENT_POLICIES`).
    PlacementName = Literal[PLACEMENT_POLICIES]
    #: ``hecate.comm_backend`` and ``hecate.device_kernels`` values, as :mod:`ds_hecate.comm.backend` defines them
    CommBackendName = Literal[COMM_BACKENDS]
    DeviceKernelsName = Literal[DEVICE_KERNELS]


class HecateConfig(BaseModel):
    """Validated ``hecate`` section. Unknown keys and wrong types are errors, never ignored."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    enabled: bool = Field(False, description="Turn Hecate (FSSDP for the experts) on.")
    placement: PlacementName = Field(
        "hecate",
        description=("Which experts each rank materializes every iteration. 'hecate': load-aware scheduler "
                     "(predicted loads, overlap degree, memory budget, calibration); 'cost': owned "
                     "experts plus every expert whose local tokens would move more bytes than the expert; 'owner': "
                     "owned experts only (plain expert parallelism); 'local': every expert a local token routes "
                     "to (no token leaves its rank). Baselines for benchmarks: 'shadow' (FasterMoE-style: hottest "
                     "experts broadcast to every rank after the gate) and 'all' (every expert on every rank, "
                     "ZeRO-3 style)."))
    load_window: int = Field(5, ge=1, le=10000, description="Iterations in the load-prediction sliding window.")
    load_predictor: Literal["robust", "mean"] = Field(
        "robust", description="How the window predicts the next call: 'robust' averages the observations that agree "
                              "with the window's majority (a one-step burst is left out; a lasting move is followed "
                              "once most of the window has seen it) and prefetches nothing speculative while the "
                              "newest call is an outlier; 'mean' averages every observation (the paper's rule).")
    materialize_budget_mb: float = Field(
        1024.0, ge=0, le=1e9, description="Per-rank memory for materialized replicas of other ranks' experts (MiB).")
    overlap_degree: Optional[int] = Field(
        None, ge=0, le=1 << 20,
        description="t: experts a rank can move while the preceding non-MoE compute runs; null: from the cost model.")
    calibration: bool = Field(
        True, description="Re-plan after the gate when the actual counts left replan_tolerance of the prediction; "
                          "gather more only if estimated faster.")
    replan_tolerance: float = Field(
        0.05, ge=0.0, le=1.0,
        description="Re-run the scheduler only when the predicted loads moved by more than this fraction (L1 over all "
                    "token-expert pairs) since its last search; 0: on every change.")
    plan_budget_us: Optional[float] = Field(
        None, ge=0, le=1e9,
        description="Calibration's search budget on the critical path (after the gate), in estimated microseconds "
                    "counted identically on every rank; the best placement found within it is used (0: keep the "
                    "prefetched placement; null: 5% of the layer's estimated time, between 1000 and 20000).")
    search_budget_us: float = Field(
        200000.0, ge=0, le=1e9,
        description="Budget of the prediction-driven search (of each of its passes: a second runs where relay "
                    "trees are possible and the first leaves the compute imbalanced), which runs off the critical "
                    "path (after the previous layer, while its kernels run), in estimated microseconds counted "
                    "identically on every rank.")
    search_slice_us: Optional[float] = Field(
        None, ge=0, le=1e9,
        description="Work per layer call of the prediction-driven search, in the same estimated microseconds as "
                    "search_budget_us: a longer search goes on at the layer's next calls (while its prediction "
                    "holds), the calls meanwhile prefetching its best placement so far or the one calibration "
                    "made for the same routing, whichever is estimated faster; at least one step per call. "
                    "null: what the preceding non-MoE compute hides (the cost model's T_nonMoE), the whole "
                    "search in one call where that is 0 (a CPU); 0: the whole search in one call.")
    rematerialize: Optional[bool] = Field(
        None, description="Release materialized experts after forward and gather them again for backward (true), "
                          "keep them until backward (false); null: re-materialize only where keeping every layer's "
                          "replicas resident leaves each layer fewer replica slots per rank than a quarter of the "
                          "experts a rank owns, while one layer at a time leaves more.")
    fanout: int = Field(
        4, ge=0, le=1 << 20,
        description="Tree fan-out of the sparse collectives: an expert with more replicas than this is relayed through "
                    "its holders (one copy per node across the NICs, then inside each node), each rank forwarding at "
                    "most this many copies across nodes and this many inside its node, and its gradients are "
                    "summed back up the same tree in fp32; 0: the owner sends and receives every copy itself.")
    relay_chunks: int = Field(
        4, ge=1, le=1024,
        description="Pieces each relayed expert row is cut into past the trees' first stage, so the levels pipeline "
                    "(one exchange carries a chunk of one level beside the next chunk of the level above); 1: level by "
                    "level, each level waiting for the whole rows of the one above.")
    prefetch: bool = Field(True, description="Issue a layer's SparseAllGather before its gate (after the previous "
                                             "MoE layer) so it overlaps the non-MoE compute.")
    reshard_interval: int = Field(
        100, ge=0, le=1 << 30, description="Heterogeneous re-sharding every N optimizer steps (0: never).")
    compute_s_per_pair: Optional[float] = Field(
        None, gt=0, le=1.0, description="Expert compute per token-expert pair, fwd+bwd (s); null: measured.")
    replica_overhead_s: Optional[float] = Field(
        None, ge=0, le=1.0,
        description="What one replica costs the rank that holds it in a layer call (forward + backward) besides its "
                    "rows' compute and its transfer: one more expert kernel and weight gradient, its weights landed "
                    "and its gradient sent back (s); null: measured at the profiling step; 0: not priced.")
    link_gbps: Optional[float] = Field(
        None, gt=0, le=1e6, description="Bandwidth between ranks of one node (GB/s); null: measured.")
    inter_node_gbps: Optional[float] = Field(
        None, gt=0, le=1e6, description="Bandwidth between nodes (GB/s); null: same as link_gbps.")
    non_moe_time_s: Optional[float] = Field(
        None, ge=0, le=3600.0, description="T_nonMoE: compute before each MoE layer that hides its gather (s); "
                                           "null: measured.")
    ranks_per_node: Optional[int] = Field(
        None, ge=1, description="Ranks per node for topology-aware dispatch; default: LOCAL_WORLD_SIZE.")
    ep_size: Optional[int] = Field(
        None, ge=1, le=1 << 30,
        description="The Hecate domain (ep_size): groups of ep_size consecutive ranks each hold one whole copy of every expert, "
                    "sharded whole over the group (planning, gathers and token dispatch stay inside it), and the "
                    "world/ep_size groups are expert-data-parallel replicas (ranks r and r+ep_size hold the same experts). Must "
                    "divide the world size. null: the converted MoE layers' ep_size when above 1, else the world "
                    "when it is at most the number of experts, else the largest divisor of the world that is at "
                    "most the number of experts and does not split a node (ds_hecate.planning.groups).")
    reduce_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Dtype of expert gradients on the wire: SparseReduceScatter and, with groups, the "
                            "reduction over the expert-data-parallel peers. 'auto': SparseReduceScatter in fp32 "
                            "(replica gradients summed as data parallelism sums them), the expert-data-parallel "
                            "reduction in bf16 when the model trains in bf16 (as DeepSpeed reduces bf16 gradients), "
                            "else fp32. Accumulation is fp32.")
    collective_timeout_s: float = Field(
        600.0, gt=0, le=86400.0, description="Timeout of Hecate's own process group, in seconds.")
    log_conversion: bool = Field(True, description="Log one line (rank 0) saying what Hecate took over.")
    monitor: bool = Field(True, description="Write per-layer metrics each optimizer step to DeepSpeed's monitor "
                                            "(tensorboard / csv_monitor / wandb sections), when one is enabled.")
    monitor_interval: int = Field(
        1, ge=1, le=1 << 30, description="Write the metrics every N optimizer steps, as per-step means over them.")
    profile: bool = Field(
        False, description="Time every phase of every MoE layer call (stats()['layers'][i]['time_s'], the monitor's "
                           "time_ms events, torch.profiler ranges; CUDA events on CUDA). Off: phases are timed only "
                           "until the cost model has measured its steady-state figures (the first 4 optimizer steps).")
    trace_file: Optional[str] = Field(
        None, min_length=1, max_length=4096,
        description="Rank 0 records every layer's gate counts and executed plan here (JSON Lines, ds_hecate.trace); "
                    "null: no trace.")
    comm_backend: CommBackendName = Field(
        "auto", description="Transport of Hecate's collectives: 'cupy' (NCCL through CuPy on its own CUDA stream), "
                            "'torch' (torch.distributed), 'auto' (torch until the CuPy transport has passed the GPU "
                            "check on 2 or more GPUs, then cupy where every rank can use it; logs why not).")
    device_kernels: DeviceKernelsName = Field(
        "auto", description="Device work around the collectives and in the layer call (expert pack, the owners' "
                            "gradient sum, the weighted un-permute): 'cupy' (ds_hecate's CUDA kernels through CuPy; "
                            "every rank raises if one cannot run them), 'torch' (torch ops), 'auto' (the kernels "
                            "on CUDA where CuPy compiles them, else torch ops, logging why). Both give the same "
                            "bits, so ranks may differ.")


WIRE_STAGES = ("sparse_reduce_scatter", "expert_data_parallel")


def wire_dtype(reduce_dtype: str, compute: str, stage: str) -> str:
    """``"fp32"`` or ``"bf16"``: the dtype expert gradients travel in at ``stage`` (one of :data:`WIRE_STAGES`), for
    ``hecate.reduce_dtype`` and the model's compute dtype (``"fp32"``, ``"bf16"`` or ``"fp16"``).

    ``auto``: SparseReduceScatter in fp32, because it sums replica gradients that data parallelism would have summed
    in fp32 inside one expert's backward (and because bf16 there makes replicas look cheaper than the token traffic
    they save, to a planner that does not yet count that traffic); the reduction over expert-data-parallel peers in
    the compute dtype when it is bf16, as DeepSpeed's own bf16 gradient reduction for its EP x EDP groups."""
    if stage not in WIRE_STAGES:
        raise ValueError(f"stage must be one of {WIRE_STAGES}, got {stage!r}")
    if reduce_dtype == "auto":
        return "bf16" if compute == "bf16" and stage == "expert_data_parallel" else "fp32"
    return reduce_dtype


HECATE_KEY = "hecate"


def _short_repr(value: Any, limit: int = 80) -> str:
    """repr for error messages: bounded, and safe for values repr() refuses (huge ints, deep nesting)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _find_section(ds_config: Mapping[str, Any]) -> Tuple[Optional[Any], Optional[str]]:
    """Return (raw section, where it was found) from a DeepSpeed config dict; a null section counts as ``{}``."""
    zero: Any = ds_config.get("zero_optimization")   # the user's JSON, checked below
    has_nested = isinstance(zero, Mapping) and HECATE_KEY in zero
    has_top = HECATE_KEY in ds_config
    nested = (zero[HECATE_KEY] if zero[HECATE_KEY] is not None else {}) if has_nested else None
    top = (ds_config[HECATE_KEY] if ds_config[HECATE_KEY] is not None else {}) if has_top else None
    if has_nested and has_top:
        raise HecateConfigError(
            "hecate: the config holds both 'zero_optimization.hecate' and a top-level 'hecate' section; "
            "keep exactly one (the canonical place is 'zero_optimization.hecate')")
    if has_nested:
        return nested, "zero_optimization.hecate"
    if has_top:
        return top, "hecate"
    return None, None


def _did_you_mean(key: str) -> str:
    """`` (did you mean 'K'?)`` for the known key closest to a misspelled one (``materialise_budget_mb``), else
    empty: a typo is the usual cause of an unknown key, and the full list of known keys is long."""
    import difflib

    close = difflib.get_close_matches(key.lower(), list(HecateConfig.model_fields), n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_hecate_section(raw: Any, where: str = "zero_optimization.hecate") -> HecateConfig:
    """Validate one raw ``hecate`` section; raise :class:`HecateConfigError` naming the bad key."""
    if not isinstance(raw, Mapping):
        raise HecateConfigError(f"{where}: expected a JSON object, got {type(raw).__name__} ({_short_repr(raw)})")
    try:
        return HecateConfig(**dict(raw))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err.get("loc", ())) or "<section>"
            if err.get("type") == "extra_forbidden":
                problems.append(f"unknown key '{where}.{key}'{_did_you_mean(key)} (known keys: "
                                f"{', '.join(HecateConfig.model_fields)})")
            else:
                problems.append(f"'{where}.{key}': {err.get('msg')} (got {_short_repr(err.get('input'))})")
        raise HecateConfigError("invalid hecate config: " + "; ".join(problems)) from None
    except TypeError as exc:  # non-string keys
        raise HecateConfigError(f"invalid hecate config in '{where}': {exc}") from None


def split_hecate_section(ds_config: Mapping[str, Any]) -> Tuple[Optional[HecateConfig], dict]:
    """Split a DeepSpeed config dict into (validated hecate config or None, config without the section).

    The input is never mutated. ``None`` means the config has no hecate section at all.
    """
    raw, where = _find_section(ds_config)
    stripped = copy.deepcopy(dict(ds_config))
    if where is None:
        return None, stripped
    if where == "hecate":
        del stripped[HECATE_KEY]
    else:
        del stripped["zero_optimization"][HECATE_KEY]
    return parse_hecate_section(raw, where), stripped
