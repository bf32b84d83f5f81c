"""Model shapes and cluster descriptions shared by ``ds-hecate simulate`` and ``ds-hecate plan``.

They live with the simulator, whose inputs they are (the user tools build on the simulator, not the reverse); the
memory plan in ``tools/`` reads them from here. Pure Python (no torch). A model preset gives the sizes the memory
plan and the simulator need; a cluster preset describes devices, links and throughput. Both can also come from a
JSON file (``--model sizes.json``, ``--cluster cluster.json``) with the same field names; unknown fields are errors.

Where the figures come from: the paper's Table 1 and §5.1 for GPT-MoE-S/L, BERT-MoE(-Deep) and the two AWS testbeds
(arXiv 2502.02581); the public model configurations for Mixtral-8x7B and DeepSeek-V3.
Effective device throughput (a fraction of the vendor peak) is an assumption, stated per preset: calibrate it with
measured values (``Cluster.from_measured``) before trusting absolute times.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Type, TypeVar, Union

from ..errors import HecateError
from .overhead import CallOverheads, describe_fit, fit_overheads, load_fit

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass(frozen=True)
class ModelShape:
    """Sizes of an MoE transformer, all that memory planning and simulation need.

    ``moe_layers`` MoE blocks (attention + MoE FFN) plus ``dense_layers`` blocks with a dense FFN of
    ``dense_ffn_size``. ``attention_params`` are per block (QKV/O projections, norms, router); ``shared_params``
    per MoE block are always-active parameters beside the routed experts (DeepSeek's shared expert), replicated
    like dense ones. One routed expert has ``expert_matrices * hidden * ffn`` weights (2: Linear-act-Linear,
    3: SwiGLU) plus ``expert_bias`` biases.
    """

    name: str
    moe_layers: int
    hidden_size: int
    ffn_size: int
    num_experts: int
    top_k: int
    vocab_size: int
    seq_len: int
    micro_batch: int = 1                  # sequences per rank per micro-step
    expert_matrices: int = 2
    expert_bias: bool = False
    attention_params: int = 0             # per block; 0: 4 * hidden^2 + 4 * hidden (MHA with biases)
    shared_params: int = 0                # per MoE block, dense (shared experts)
    dense_layers: int = 0
    dense_ffn_size: int = 0
    tied_embeddings: bool = True
    description: str = ""

    @property
    def expert_params(self) -> int:
        bias = (self.ffn_size * (self.expert_matrices - 1) + self.hidden_size) if self.expert_bias else 0
        return self.expert_matrices * self.hidden_size * self.ffn_size + bias

    @property
    def attention_params_per_layer(self) -> int:
        return self.attention_params or (4 * self.hidden_size * self.hidden_size + 4 * self.hidden_size)

    @property
    def dense_params_per_moe_layer(self) -> int:
        """Non-expert parameters of one MoE block (attention, norms, router, shared experts)."""
        router = self.num_experts * self.hidden_size
        return self.attention_params_per_layer + self.shared_params + router + 4 * self.hidden_size

    @property
    def dense_params(self) -> int:
        """Every parameter that is not a routed expert (handled by DeepSpeed's ZeRO, not by Hecate)."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        dense_block = self.attention_params_per_layer + 3 * self.hidden_size * self.dense_ffn_size
        return embed + self.moe_layers * self.dense_params_per_moe_layer + self.dense_layers * dense_block

    @property
    def expert_params_total(self) -> int:
        return self.moe_layers * self.num_experts * self.expert_params

    @property
    def total_params(self) -> int:
        return self.dense_params + self.expert_params_total

    @property
    def tokens_per_rank(self) -> int:
        return self.seq_len * self.micro_batch

    def non_moe_flops_per_layer(self, tokens: int) -> float:
        """Forward + backward FLOPs of one block's non-expert part: 6 * params * tokens plus attention scores
        (QK^T and AV: 4 * seq * hidden per token forward, 3x for forward + backward)."""
        return 6.0 * (self.dense_params_per_moe_layer) * tokens + 12.0 * self.seq_len * self.hidden_size * tokens


@dataclass(frozen=True)
class Cluster:
    """A modelled cluster: ``nodes`` x ``devices_per_node`` devices.

    Bandwidths are GB/s per direction: ``intra_node_gbps`` per device (NVLink/NVSwitch share of one GPU),
    ``inter_node_gbps`` per node (all NICs of a node together; its devices share it). Latencies are per message
    round (one all-to-all or sparse collective phase). ``device_tflops`` is the *effective* expert/dense compute
    rate in TFLOP/s. ``overlaps_compute``: whether communication can run beside compute (GPU streams); on a CPU
    the same cores do both, and ds_hecate hides nothing there.
    """

    name: str
    nodes: int
    devices_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    device_tflops: float
    device_memory_gb: float
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 2e-5
    overlaps_compute: bool = True
    compute_s_per_pair: Optional[float] = None    # measured override: seconds per token-expert pair, fwd+bwd
    non_moe_time_s: Optional[float] = None        # measured override: forward non-MoE time per block (s)
    fixed_step_s: float = 0.0                     # per-step time outside the blocks (optimizer step, data), s
    layer_overhead_s: float = 0.0                 # per MoE layer call, fwd+bwd: count exchange, planning, launch
    replica_overhead_s: float = 0.0               # measured: what the runtime's planner charges per replica held
    #: each system's per-call runtime overhead over the plain layer (sim/overhead.py; a JSON object
    #: ``{"hecate": {...}, "baselines": {...}}`` in a cluster file); None: none charged
    call_overhead: Optional[CallOverheads] = None
    #: the device's memory bandwidth (GB/s), to which a fit's byte terms are scaled (:meth:`charged_by`)
    memory_gbps: Optional[float] = None
    #: the committed fit that charges this cluster when ``call_overhead`` is not given (:meth:`charged_by`); None:
    #: the cluster's own coefficients, or none
    call_overhead_fit: Optional[str] = None
    description: str = ""

    def __post_init__(self) -> None:
        raw = self.call_overhead
        if raw is None and self.call_overhead_fit is not None:   # charged by a committed fit (:meth:`charged_by`)
            if self.memory_gbps is None:
                raise HecateError(f"cluster {self.name!r} has no memory_gbps to scale the call overhead fit "
                                  f"{self.call_overhead_fit!r} to; give it in the cluster file")
            try:
                fitted = fit_overheads(CALL_OVERHEAD_FIT, self.call_overhead_fit, float(self.memory_gbps))
            except ValueError as exc:
                raise HecateError(f"cluster {self.name!r}: {exc}") from None
            object.__setattr__(self, "call_overhead", fitted)
        elif raw is not None and not isinstance(raw, CallOverheads):
            try:
                object.__setattr__(self, "call_overhead", CallOverheads.of(raw))
            except (TypeError, ValueError, AttributeError) as exc:
                raise HecateError(f"cluster {self.name!r}: call_overhead: {exc}") from None

    def call_overheads(self) -> CallOverheads:
        """The per-call overhead model of this cluster's devices (none charged when not given)."""
        return self.call_overhead if self.call_overhead is not None else CallOverheads()

    def charged_by(self, fit_name: str) -> "Cluster":
        """This cluster charged the committed fit ``fit_name`` (``ds-hecate simulate --call-overhead-fit``), its byte
        terms scaled to :attr:`memory_gbps`; an unknown fit, or a cluster without a memory bandwidth, is an error."""
        return dataclasses.replace(self, call_overhead=None, call_overhead_fit=fit_name)

    def call_overhead_note(self, run_date: datetime.date) -> str:
        """What charges this cluster's layer calls, for the simulator's tables: the committed fit (its source, commit,
        date and age on ``run_date``, :func:`~.overhead.describe_fit`), the cluster's own coefficients, or none."""
        if self.call_overhead is None:
            return f"{self.name}: no per-call overhead (the cluster gives none)"
        name = self.call_overhead_fit
        if name is not None and name in CALL_OVERHEAD_FIT["fits"] and self.call_overhead == fit_overheads(
                CALL_OVERHEAD_FIT, name, self.memory_gbps):
            return f"{self.name}: {describe_fit(CALL_OVERHEAD_FIT, name, self.memory_gbps, run_date)}"
        return f"{self.name}: the cluster's own call_overhead coefficients"

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def with_world_size(self, world_size: int) -> "Cluster":
        """The same kind of cluster with ``world_size`` devices (whole nodes, or a part of one node)."""
        if world_size < 1:
            raise HecateError(f"--world-size must be >= 1, got {world_size}")
        if world_size <= self.devices_per_node:
            return dataclasses.replace(self, nodes=1, devices_per_node=world_size)
        if world_size % self.devices_per_node:
            raise HecateError(f"--world-size {world_size} is not a multiple of the cluster's "
                              f"{self.devices_per_node} devices per node")
        return dataclasses.replace(self, nodes=world_size // self.devices_per_node)

    @property
    def inter_node_gbps_per_device(self) -> float:
        return self.inter_node_gbps / self.devices_per_node

    @classmethod
    def from_measured(cls, measured: Mapping[str, float], world_size: int = 2, name: str = "cpu-measured",
                      device_memory_gb: float = 24.0) -> "Cluster":
        """One node of ``world_size`` ranks with the throughput ds_hecate measured at the first step
        (``engine.hecate.stats()["measured_costs"]``: ``compute_s_per_pair``, ``link_gbps``, ``non_moe_time_s``).

        Optional measured unit costs (absent: 0, i.e. not modelled), for measurements beyond the runtime's own:
        ``fixed_step_s`` (per-step time outside the blocks: optimizer step, framework), ``layer_overhead_s`` (per
        MoE layer call, forward + backward: count exchange, planning, launch) and ``collective_latency_s`` (the
        fixed cost of one collective round, added to every all-to-all pass and sparse collective phase).
        ``replica_overhead_s`` (the runtime measures it too) goes to the planner, which then decides as the runtime
        that measured it did; the simulated step does not charge it (modelled on a GPU: one grouped kernel a call).
        """
        missing = [k for k in ("compute_s_per_pair", "link_gbps", "non_moe_time_s") if k not in measured]
        if missing:
            raise HecateError(f"measured costs lack {missing}; expected the 'measured_costs' dict of "
                              "engine.hecate.stats() (compute_s_per_pair, link_gbps, non_moe_time_s)")
        latency = float(measured.get("collective_latency_s", 0.0))
        return cls(name=name, nodes=1, devices_per_node=world_size, intra_node_gbps=float(measured["link_gbps"]),
                   inter_node_gbps=float(measured["link_gbps"]), device_tflops=1.0,
                   device_memory_gb=device_memory_gb, intra_latency_s=latency, inter_latency_s=latency,
                   overlaps_compute=False, compute_s_per_pair=float(measured["compute_s_per_pair"]),
                   non_moe_time_s=float(measured["non_moe_time_s"]),
                   fixed_step_s=float(measured.get("fixed_step_s", 0.0)),
                   layer_overhead_s=float(measured.get("layer_overhead_s", 0.0)),
                   replica_overhead_s=float(measured.get("replica_overhead_s", 0.0)),
                   description="calibrated from ds_hecate's measured costs")


# --------------------------------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------------------------------
def _gpt(name: str, hidden: int, layers: int, desc: str) -> ModelShape:
    return ModelShape(name=name, moe_layers=layers, hidden_size=hidden, ffn_size=2 * hidden, num_experts=64, top_k=2,
                      vocab_size=50257, seq_len=2048, micro_batch=4, expert_bias=True, description=desc)


def _bert(name: str, layers: int, desc: str) -> ModelShape:
    return ModelShape(name=name, moe_layers=layers, hidden_size=1024, ffn_size=2048, num_experts=64, top_k=2,
                      vocab_size=30522, seq_len=512, micro_batch=16, expert_bias=True, description=desc)


MODELS: Dict[str, ModelShape] = {m.name: m for m in (
    _gpt("gpt-moe-s", 768, 12, "paper Table 1: d768, seq 2048, 12 layers, 64 experts, top-2 (1.84B)"),
    _gpt("gpt-moe-l", 1536, 12, "paper Table 1: d1536, seq 2048, 12 layers, 64 experts, top-2 (7.36B)"),
    _bert("bert-moe", 12, "paper Table 1: d1024, seq 512, 12 layers, 64 experts, top-2 (3.27B)"),
    _bert("bert-moe-deep", 24, "paper Table 1: d1024, seq 512, 24 layers, 64 experts, top-2 (6.54B)"),
    ModelShape(name="mixtral-8x7b", moe_layers=32, hidden_size=4096, ffn_size=14336, num_experts=8, top_k=2,
               vocab_size=32000, seq_len=4096, micro_batch=1, expert_matrices=3,
               attention_params=2 * 4096 * 4096 + 2 * 4096 * 1024, tied_embeddings=False,
               description="Mixtral-8x7B shape: 32 layers, d4096, SwiGLU ffn 14336, 8 experts top-2, GQA 32/8 heads "
                           "(46.7B)"),
    ModelShape(name="deepseek-v3", moe_layers=58, hidden_size=7168, ffn_size=2048, num_experts=256, top_k=8,
               vocab_size=129280, seq_len=4096, micro_batch=1, expert_matrices=3,
               # MLA: q_a 7168x1536, q_b 1536x(128*192), kv_a 7168x576, kv_b 512x(128*256), o (128*128)x7168
               attention_params=7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168,
               shared_params=3 * 7168 * 2048, dense_layers=3, dense_ffn_size=18432, tied_embeddings=False,
               description="DeepSeek-V3 shape: 61 layers (3 dense), d7168, 256 routed SwiGLU experts (ffn 2048) "
                           "top-8 + 1 shared, MLA (671B)"),
)}

#: the committed fit of the per-call overhead model (ds_hecate/sim/call_overhead_fit.json, written by
#: ``python -m ds_hecate.sim.overhead_fit``): every preset is charged its default fit (``cpu``), so a refit changes
#: them without an edit here
CALL_OVERHEAD_FIT = load_fit()
DEFAULT_CALL_OVERHEAD_FIT: str = CALL_OVERHEAD_FIT["default"]
#: each preset's device memory bandwidth (GB/s) to which the fit's byte terms are scaled, the fixed term kept
#: (``sim/overhead.scaled_to``; docs/simulator.md, "Call overhead"): vendor figures for V100-32GB HBM2, A100-40GB
#: HBM2, H100-80GB SXM HBM3; ``cpu-2`` the bandwidth measured beside the CPU fit (the host it ran on)
MEMORY_GBPS = {"v100-4x8": 900.0, "a100-4x8": 1555.0, "h100-128x8": 3350.0,
               "cpu-2": float(CALL_OVERHEAD_FIT["fits"]["cpu"]["device_memory_gbps"])}


def _charged(name: str) -> Dict[str, Any]:
    """A preset's memory bandwidth and its charge: the default fit."""
    gbps = MEMORY_GBPS[name]
    return dict(memory_gbps=gbps, call_overhead_fit=DEFAULT_CALL_OVERHEAD_FIT)


CLUSTERS: Dict[str, Cluster] = {c.name: c for c in (
    Cluster("v100-4x8", nodes=4, devices_per_node=8, intra_node_gbps=150.0, inter_node_gbps=12.5,
            device_tflops=50.0, device_memory_gb=32.0, intra_latency_s=5e-6, inter_latency_s=3e-5,
            **_charged("v100-4x8"),
            description="paper cluster A: 4x AWS p3dn.24xlarge, 8x V100-32GB, NVLink 300 GB/s (150 per direction), "
                        "100 Gb/s per node; effective 50 TFLOP/s (40% of fp16 peak, assumed)"),
    Cluster("a100-4x8", nodes=4, devices_per_node=8, intra_node_gbps=300.0, inter_node_gbps=50.0,
            device_tflops=125.0, device_memory_gb=40.0, intra_latency_s=5e-6, inter_latency_s=2e-5,
            **_charged("a100-4x8"),
            description="paper cluster B: 4x AWS p4d.24xlarge, 8x A100-40GB, NVSwitch 600 GB/s (300 per "
                        "direction), 400 Gb/s per node; effective 125 TFLOP/s (40% of bf16 peak, assumed)"),
    Cluster("h100-128x8", nodes=128, devices_per_node=8, intra_node_gbps=450.0, inter_node_gbps=400.0,
            device_tflops=600.0, device_memory_gb=80.0, intra_latency_s=3e-6, inter_latency_s=1e-5,
            **_charged("h100-128x8"),
            description="128 nodes x 8 H100-80GB, NVLink4 450 GB/s per direction, 8x 400 Gb/s NICs per node; "
                        "effective 600 TFLOP/s (about 60% of bf16 peak, assumed)"),
    Cluster("cpu-2", nodes=1, devices_per_node=2, intra_node_gbps=0.9, inter_node_gbps=0.9, device_tflops=0.01,
            device_memory_gb=24.0, intra_latency_s=0.0, inter_latency_s=0.0, overlaps_compute=False,
            **_charged("cpu-2"),
            description="two CPU ranks over gloo on one host; nominal figures: pass the "
                        "measured costs of the run to compare with (--measured or Cluster.from_measured)"),
)}


T = TypeVar("T", bound="DataclassInstance")   # a dataclass (ModelShape, Cluster)


def _from_mapping(kind: Type[T], raw: Any, where: str) -> T:
    if not isinstance(raw, Mapping):
        raise HecateError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise HecateError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    try:
        return kind(**{"name": os.path.basename(where), **dict(raw)})
    except TypeError as exc:
        raise HecateError(f"{where}: {exc}") from None


def _load_json(path: str) -> Any:
    try:
        with open(path, "r", encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise HecateError(f"cannot read {path!r}: {exc}") from None


def _resolve(spec, kind, presets: dict, what: str, hint: str):
    """A preset of ``presets`` by name, or a JSON file of ``kind``'s fields; ``spec`` itself if already one."""
    if isinstance(spec, kind):
        return spec
    if spec in presets:
        return presets[spec]
    if spec.endswith(".json") or os.path.exists(spec):
        return _from_mapping(kind, _load_json(spec), spec)
    raise HecateError(f"unknown {what} {spec!r}; choose a preset ({', '.join(presets)}) or {hint}")


def resolve_model(spec: Union[str, ModelShape]) -> ModelShape:
    """A model preset name or a JSON file of :class:`ModelShape` fields."""
    return _resolve(spec, ModelShape, MODELS, "model", "a JSON file of sizes")


def resolve_cluster(spec: Union[str, Cluster]) -> Cluster:
    """A cluster preset name or a JSON file of :class:`Cluster` fields."""
    return _resolve(spec, Cluster, CLUSTERS, "cluster", "a JSON file")
