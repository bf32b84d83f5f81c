"""The phases each MoE layer call is timed in, and their names in reports (no torch: the report tools read it).

``engine.hecate.stats()["layers"][i]["time_s"]``, the monitor's ``Hecate/layerL/time_ms_<phase>`` events, the
benchmark's phase table and ``ds-hecate report``'s stacked bars all use these keys. Every part of a call is in one:
the forward's phases, then its backward's (``*_bwd``, timed between boundaries autograd reaches,
:class:`~ds_hecate.runtime.timing.BackwardPhases`) and the SparseReduceScatter's issue and wait, so they add up
to the call.
"""

PHASE_LABELS = {"counts": "count exchange", "plan": "planning", "gather": "gather wait", "dispatch": "dispatch",
                "compute": "expert compute (fwd)", "combine": "combine", "bookkeeping": "bookkeeping (fwd)",
                "combine_bwd": "combine (bwd)", "compute_bwd": "expert compute (bwd)",
                "dispatch_bwd": "dispatch (bwd)", "reduce_scatter": "reduce-scatter issue",
                "reduce_wait": "reduce-scatter wait", "regather": "re-gather (backward)"}
PHASES = tuple(PHASE_LABELS)
