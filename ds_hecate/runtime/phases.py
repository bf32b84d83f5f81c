"""The phases each MoE layer call is timed in, and their names in reports (no torch: the report tools read it).

``engine.hecate.stats()["layers"][i]["time_s"]``, the monitor's ``Hecate/layerL/time_ms_<phase>`` events, the
benchmark's phase table and ``ds-hecate report``'s stacked bars all use these keys.
"""

PHASE_LABELS = {"counts": "count exchange", "plan": "planning", "gather": "gather wait", "dispatch": "dispatch",
                "compute": "expert compute (fwd)", "combine": "combine", "reduce_scatter": "reduce-scatter issue",
                "reduce_wait": "reduce-scatter wait", "regather": "re-gather (backward)"}
PHASES = tuple(PHASE_LABELS)
