"""Routing traces: per-step, per-layer gate counts (and optionally the executed plan), one JSON object a line.

A trace records what the gates did in a real run so the simulator (``ds-hecate simulate --workload trace.jsonl``)
and the report plots can replay it. The format is plain JSON Lines so it survives being copied between teams and
can never execute code when read.

Line 1 is the header::

    {"format": "ds_hecate-trace", "version": 1, "world_size": 2, "top_k": 2,
     "layers": [{"name": "blocks.0.moe", "num_experts": 8, "hidden_size": 64, "expert_params": 8256}],
     "meta": {...free-form...}}

Every further line is one forward call of one layer::

    {"step": 3, "layer": 0, "counts": [[c_r0_e0, c_r0_e1, ...], [c_r1_e0, ...]],
     "materialized": [[experts on rank 0], [experts on rank 1]]}      # "materialized" is optional

``counts[r][e]`` is the number of token-expert pairs rank ``r``'s tokens routed to expert ``e``.
Pure Python: no torch, no torch.distributed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import IO, Any, Dict, Iterator, List, Optional, Sequence

from .errors import HecateError

TRACE_FORMAT = "ds_hecate-trace"
TRACE_VERSION = 1

Counts = List[List[int]]


class TraceError(HecateError):
    """A trace file that is not a ds_hecate trace, or whose records contradict its header."""


@dataclass(frozen=True)
class TraceLayer:
    name: str
    num_experts: int
    hidden_size: int = 0
    expert_params: int = 0


@dataclass(frozen=True)
class TraceRecord:
    step: int
    layer: int
    counts: Counts
    materialized: Optional[List[List[int]]] = None


@dataclass
class Trace:
    world_size: int
    top_k: int
    layers: List[TraceLayer]
    records: List[TraceRecord] = field(default_factory=list)
    meta: Dict[str, Any] = field(default_factory=dict)

    def steps(self) -> List[int]:
        """Distinct steps in the order they first appear."""
        seen: Dict[int, None] = {}
        for record in self.records:
            seen.setdefault(record.step, None)
        return list(seen)

    def layer_counts(self, layer: int) -> List[Counts]:
        """The counts of one layer, one entry per recorded call, in file order."""
        return [r.counts for r in self.records if r.layer == layer]

    def by_step(self) -> Iterator[List[TraceRecord]]:
        """Records grouped per step, layers in file order."""
        groups: Dict[int, List[TraceRecord]] = {}
        for record in self.records:
            groups.setdefault(record.step, []).append(record)
        yield from groups.values()


def _header(world_size: int, top_k: int, layers: Sequence[TraceLayer], meta: Optional[dict]) -> dict:
    return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "world_size": int(world_size), "top_k": int(top_k),
            "layers": [vars(layer).copy() for layer in layers], "meta": dict(meta or {})}


class TraceWriter:
    """Appends records to a trace file; the header is written on open. Flushes every record so a crashed run
    still leaves a readable trace."""

    def __init__(self, path: str, world_size: int, top_k: int, layers: Sequence[TraceLayer],
                 meta: Optional[dict] = None) -> None:
        self.path = path
        self.layers = list(layers)
        self.world_size = int(world_size)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file: Optional[IO[str]] = open(path, "w", encoding="utf-8")
        self._write(_header(world_size, top_k, self.layers, meta))

    def _write(self, obj: dict) -> None:
        assert self._file is not None, "trace writer already closed"
        self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._file.flush()

    def write(self, step: int, layer: int, counts: Counts,
              materialized: Optional[Sequence[Sequence[int]]] = None) -> None:
        record = TraceRecord(int(step), int(layer), [[int(c) for c in row] for row in counts],
                             None if materialized is None else [sorted(int(e) for e in m) for m in materialized])
        _check_record(record, self.world_size, self.layers, where=self.path)
        obj: Dict[str, Any] = {"step": record.step, "layer": record.layer, "counts": record.counts}
        if record.materialized is not None:
            obj["materialized"] = record.materialized
        self._write(obj)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_record(record: TraceRecord, world_size: int, layers: Sequence[TraceLayer], where: str) -> None:
    if not 0 <= record.layer < len(layers):
        raise TraceError(f"{where}: record for layer {record.layer}, but the header lists {len(layers)} layer(s)")
    experts = layers[record.layer].num_experts
    if len(record.counts) != world_size or any(len(row) != experts for row in record.counts):
        raise TraceError(f"{where}: step {record.step} layer {record.layer}: counts must be {world_size} rows of "
                         f"{experts} expert counts")
    if any(c < 0 for row in record.counts for c in row):
        raise TraceError(f"{where}: step {record.step} layer {record.layer}: negative token count")
    if record.materialized is not None:
        if len(record.materialized) != world_size or any(not 0 <= e < experts for m in record.materialized
                                                         for e in m):
            raise TraceError(f"{where}: step {record.step} layer {record.layer}: 'materialized' must list, for "
                             f"each of {world_size} ranks, expert ids in [0, {experts})")


def read_trace(path: str) -> Trace:
    """Read and validate a trace file written by :class:`TraceWriter` (or by hand in the same format)."""
    try:
        with open(path, "r", encoding="utf-8") as handle:
            lines = [line for line in handle if line.strip()]
    except OSError as exc:
        raise TraceError(f"cannot read trace {path!r}: {exc}") from exc
    if not lines:
        raise TraceError(f"{path}: empty file, not a ds_hecate trace")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: line 1 is not JSON ({exc}); not a ds_hecate trace") from exc
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        raise TraceError(f"{path}: line 1 lacks \"format\": \"{TRACE_FORMAT}\"; not a ds_hecate trace")
    if header.get("version") != TRACE_VERSION:
        raise TraceError(f"{path}: trace version {header.get('version')!r}, this ds_hecate reads {TRACE_VERSION}")
    try:
        layers = [TraceLayer(str(l["name"]), int(l["num_experts"]), int(l.get("hidden_size", 0)),
                             int(l.get("expert_params", 0))) for l in header["layers"]]
        trace = Trace(int(header["world_size"]), int(header.get("top_k", 1)), layers, meta=header.get("meta", {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{path}: malformed header ({exc!r})") from exc
    for number, line in enumerate(lines[1:], start=2):
        try:
            obj = json.loads(line)
            record = TraceRecord(int(obj["step"]), int(obj["layer"]), [[int(c) for c in row] for row in obj["counts"]],
                                 None if obj.get("materialized") is None
                                 else [[int(e) for e in m] for m in obj["materialized"]])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{path}: line {number} is not a trace record ({exc!r})") from exc
        _check_record(record, trace.world_size, layers, where=f"{path}:{number}")
        trace.records.append(record)
    return trace
