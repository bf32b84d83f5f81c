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
coefficients are fitted per device class from side-by-side measurements against the plain layer
(``python -m benchmarks.overhead_fit``, which writes ``docs/call_overhead_fit.json``): the CPU's from
``benchmarks/layer_versus.py`` on this kind of machine, the GPU presets' from the GPU check's layer-call figures.
``docs/simulator.md`` says what was fitted where, and from which runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping

import numpy as np

#: the systems whose calls are charged :attr:`CallOverheads.hecate` (every other system but the ideal takes the
#: baselines' coefficients)
HECATE_SYSTEMS = ("hecate", "hecate-rm")


@dataclass(frozen=True)
class CallOverhead:
    """One system family's per-call overhead over the plain layer (seconds; see the module docstring)."""

    fixed_s: float = 0.0
    per_row_byte_s: float = 0.0
    per_owned_byte_s: float = 0.0

    def seconds(self, rows: np.ndarray, row_bytes: int, owned_bytes: np.ndarray) -> np.ndarray:
        """Per rank: the overhead of one call (forward and backward)."""
        return self.fixed_s + self.per_row_byte_s * rows * row_bytes + self.per_owned_byte_s * owned_bytes

    @staticmethod
    def of(raw: Mapping[str, float]) -> "CallOverhead":
        unknown = set(raw) - {"fixed_s", "per_row_byte_s", "per_owned_byte_s"}
        if unknown:
            raise ValueError(f"call overhead: unknown term(s) {sorted(unknown)}")
        values = {k: float(v) for k, v in raw.items()}
        if any(v < 0 for v in values.values()):
            raise ValueError(f"call overhead terms must not be negative, got {values}")
        return CallOverhead(**values)


@dataclass(frozen=True)
class CallOverheads:
    """The coefficients of one device class: ds_hecate's and the baselines' (EP, FasterMoE, SmartMoE, FlexMoE:
    expert-parallel layers, fitted from DeepSpeed's)."""

    hecate: CallOverhead = CallOverhead()
    baselines: CallOverhead = CallOverhead()

    def for_system(self, system: str) -> CallOverhead:
        if system == "ideal":
            return CallOverhead()
        return self.hecate if system in HECATE_SYSTEMS else self.baselines

    @staticmethod
    def of(raw: Mapping[str, Mapping[str, float]]) -> "CallOverheads":
        unknown = set(raw) - {"hecate", "baselines"}
        if unknown:
            raise ValueError(f"call overheads: unknown family {sorted(unknown)}; known: hecate, baselines")
        return CallOverheads(**{k: CallOverhead.of(v) for k, v in raw.items()})

    def as_dict(self) -> Dict[str, Dict[str, float]]:
        return {name: dict(fixed_s=o.fixed_s, per_row_byte_s=o.per_row_byte_s, per_owned_byte_s=o.per_owned_byte_s)
                for name, o in (("hecate", self.hecate), ("baselines", self.baselines))}


def scaled_to(fit: Mapping[str, Mapping[str, float]], fitted_gbps: float, device_gbps: float) -> CallOverheads:
    """A device class's fitted coefficients for another device of the class: the byte terms (memory-bound passes)
    scaled by the ratio of their memory bandwidths, the fixed term (launches, host work) kept."""
    ratio = fitted_gbps / device_gbps
    return CallOverheads.of({family: {"fixed_s": terms.get("fixed_s", 0.0),
                                      "per_row_byte_s": terms.get("per_row_byte_s", 0.0) * ratio,
                                      "per_owned_byte_s": terms.get("per_owned_byte_s", 0.0) * ratio}
                             for family, terms in fit.items()})
