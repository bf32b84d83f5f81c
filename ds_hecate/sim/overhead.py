"""What a system's MoE layer call costs beyond the plain grouped-GEMM layer: the simulator's runtime overhead model.

The time model (:mod:`.machine`) charges expert compute, token all-to-alls and expert collectives. A real layer call
also spends time around them: routing bookkeeping, permutations, planning, launches, and work proportional to the
experts a rank owns (before issue 41 ds_hecate cast and packed every owned expert and zero-filled its gradient
accumulator on every call). Before this model the simulator charged every system the same (nothing but a fixed
``Cluster.layer_overhead_s``), which flattered whichever system had the heavier runtime: ds_hecate's ratios over
expert parallelism assumed a runtime as lean as a plain layer's.

Every system's call is charged, per rank ``r``, one formula of the same form:

    overhead_r = fixed_s + per_row_byte_s * routed_rows_r * row_bytes + per_owned_byte_s * owned_bytes_r

(``routed_rows_r``: token-expert pairs the rank computes; ``row_bytes``: one token row in the compute dtype;
``owned_bytes_r``: the rank's owned experts in the compute dtype), and a layer waits for its slowest rank. The
coefficients are fitted from side-by-side measurements against the plain layer (:mod:`.overhead_fit`, which writes
``ds_hecate/sim/call_overhead_fit.json``, package data): its default fit ``cpu``, from one run of the layer benchmark
(``python -m benchmarks.layer``) with ds_hecate and DeepSpeed's layers on their N-rank paths, charges every preset,
its byte terms scaled to the preset's memory bandwidth (:func:`scaled_to`). ``docs/simulator.md`` says what was
fitted where, and from which runtime.
"""
from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

import numpy as np

from ..errors import HecateError

#: the systems whose calls are charged :attr:`CallOverheads.hecate` (every other system but the ideal takes the
#: baselines' coefficients)
HECATE_SYSTEMS = ("hecate", "hecate-rm")
#: the formula's terms (seconds; seconds per byte)
TERMS = ("fixed_s", "per_row_byte_s", "per_owned_byte_s")
#: the committed fit (``python -m ds_hecate.sim.overhead_fit``), next to this module: package data (setup.py's
#: ``package_data``), so a checkout and an installed copy read the same file
FIT_NAME = "call_overhead_fit.json"


@dataclass(frozen=True)
class CallOverhead:
    """One system family's per-call overhead over the plain layer (seconds; see the module docstring)."""

    fixed_s: float = 0.0
    per_row_byte_s: float = 0.0
    per_owned_byte_s: float = 0.0

    def seconds(self, rows: np.ndarray, row_bytes: int, owned_bytes: Union[int, np.ndarray]) -> np.ndarray:
        """Per rank: the overhead of one call (forward and backward)."""
        return self.fixed_s + self.per_row_byte_s * rows * row_bytes + self.per_owned_byte_s * owned_bytes

    @staticmethod
    def of(raw: Mapping[str, float]) -> "CallOverhead":
        """From ``{"fixed_s": ..., "per_row_byte_s": ..., "per_owned_byte_s": ...}`` (absent terms: 0); an unknown,
        non-numeric, negative or non-finite term is an error naming it."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"call overhead: expected an object of terms {list(TERMS)}, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(TERMS))
        if unknown:
            raise ValueError(f"call overhead: unknown term(s) {unknown}; known: {', '.join(TERMS)}")
        values = {}
        for key, value in raw.items():
            try:
                values[key] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"call overhead term {key!r} must be a number, got {value!r}") from None
            if not math.isfinite(values[key]) or values[key] < 0:
                raise ValueError(f"call overhead term {key!r} must be finite and not negative, got {value!r}")
        return CallOverhead(**values)


@dataclass(frozen=True)
class CallOverheads:
    """The coefficients of one fit: ds_hecate's and the baselines' (EP, FasterMoE, SmartMoE, FlexMoE:
    expert-parallel layers, charged the lower-overhead of DeepSpeed's two layers)."""

    hecate: CallOverhead = CallOverhead()
    baselines: CallOverhead = CallOverhead()

    def for_system(self, system: str) -> CallOverhead:
        if system == "ideal":
            return CallOverhead()
        return self.hecate if system in HECATE_SYSTEMS else self.baselines

    @staticmethod
    def of(raw: Mapping[str, Mapping[str, float]]) -> "CallOverheads":
        if not isinstance(raw, Mapping):
            raise ValueError(f"call overheads: expected an object with hecate and/or baselines, got "
                             f"{type(raw).__name__}")
        unknown = set(raw) - {"hecate", "baselines"}
        if unknown:
            raise ValueError(f"call overheads: unknown family {sorted(unknown)}; known: hecate, baselines")
        families = {}
        for family, terms in raw.items():
            try:
                families[family] = CallOverhead.of(terms)
            except ValueError as exc:
                raise ValueError(f"{family}: {exc}") from None
        return CallOverheads(**families)

    def as_dict(self) -> Dict[str, Dict[str, float]]:
        return {name: dict(fixed_s=o.fixed_s, per_row_byte_s=o.per_row_byte_s, per_owned_byte_s=o.per_owned_byte_s)
                for name, o in (("hecate", self.hecate), ("baselines", self.baselines))}


def scaled_to(fit: Mapping[str, Mapping[str, float]], fitted_gbps: float, device_gbps: float) -> CallOverheads:
    """A fit's coefficients for another device: the byte terms (memory-bound passes)
    scaled by the ratio of their memory bandwidths, the fixed term (launches, host work) kept. The fit is checked
    first (:meth:`CallOverheads.of`: a bad term is an error naming it)."""
    ratio = float(fitted_gbps) / float(device_gbps)
    if not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"call overhead: memory bandwidths must be positive, got {fitted_gbps!r} fitted, "
                         f"{device_gbps!r} for the device")
    checked = CallOverheads.of(fit).as_dict()
    return CallOverheads.of({family: {"fixed_s": checked[family]["fixed_s"],
                                      "per_row_byte_s": checked[family]["per_row_byte_s"] * ratio,
                                      "per_owned_byte_s": checked[family]["per_owned_byte_s"] * ratio}
                             for family in fit})


def fit_path() -> Path:
    """Where the committed fit is: next to this module, in a checkout and in an installed copy alike."""
    path = Path(__file__).resolve().parent / FIT_NAME
    if not path.is_file():
        raise HecateError(f"the simulator's call overhead fit {FIT_NAME} is missing from {path.parent}; reinstall "
                          "ds_hecate or refit it with python -m ds_hecate.sim.overhead_fit (docs/simulator.md, "
                          "\"Call overhead\")")
    return path


def load_fit(path: Optional[Path] = None) -> Dict[str, Any]:
    """The fit file (``{"default": name, "fits": {name: {...}}}``), the committed one unless ``path`` is given."""
    path = path or fit_path()
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HecateError(f"cannot read the call overhead fit {str(path)!r}: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("fits"), dict) or raw.get("default") not in raw["fits"]:
        raise HecateError(f"the call overhead fit {str(path)!r} has no fits or no default among them; refit it with "
                          "python -m ds_hecate.sim.overhead_fit")
    return raw


def fit_entry(fit: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """The fit called ``name`` of a fit file; an unknown name is an error naming it and the file's fits."""
    fits = fit["fits"]
    if name not in fits:
        raise HecateError(f"unknown call overhead fit {name!r}; the fit file has {', '.join(sorted(fits))}")
    return fits[name]


def fit_overheads(fit: Mapping[str, Any], name: str, device_gbps: Optional[float] = None) -> CallOverheads:
    """The coefficients of the fit ``name`` of ``fit`` as fitted, or for a device of memory bandwidth
    ``device_gbps`` (:func:`scaled_to` from the fit's ``device_memory_gbps``)."""
    entry = fit_entry(fit, name)
    families = {family: entry[family] for family in ("hecate", "baselines") if family in entry}
    if device_gbps is None:
        return CallOverheads.of(families)
    return scaled_to(families, float(entry["device_memory_gbps"]), device_gbps)


def fit_date(entry: Mapping[str, Any]) -> Optional[datetime.date]:
    """The day a fit's input was measured (its record's ``date``, else ``started``), None if it does not say."""
    source = entry.get("source", {})
    stamp = source.get("date") or source.get("started")
    try:
        return datetime.date.fromisoformat(str(stamp)[:10])
    except ValueError:
        return None


def describe_fit(fit: Mapping[str, Any], name: str, device_gbps: Optional[float], run_date: datetime.date) -> str:
    """Which fit charges a cluster, from what and how old: ``fit 'cpu' (CPU layer benchmark, N-rank paths, run on
    2026-12-07 at commit 41acf1f; 0 days before this run), byte terms scaled from 7.9 to 900 GB/s, baselines
    charged autoep's coefficients``."""
    entry = fit_entry(fit, name)
    source, measured = entry.get("source", {}), fit_date(entry)
    age = f"{(run_date - measured).days} days before this run" if measured else "age unknown"
    scale = (f"byte terms scaled from {entry['device_memory_gbps']:g} to {device_gbps:g} GB/s memory bandwidth"
             if device_gbps is not None and device_gbps != entry["device_memory_gbps"] else "byte terms as fitted")
    baselines = entry.get("baselines_from")
    return (f"fit {name!r} ({entry.get('description', 'no description')}, run on "
            f"{measured.isoformat() if measured else 'an unrecorded date'} at commit "
            f"{source.get('commit', 'unrecorded')}; {age}), {scale}, baselines charged "
            + (f"{baselines}'s coefficients" if baselines else "nothing (none measured)"))
