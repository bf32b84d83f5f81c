"""The phases each MoE layer call is timed in, and their names in reports (no torch: the report tools read it).

``engine.hecate.stats()["layers"][i]["time_s"]``, the monitor's ``Hecate/layerL/time_ms_<phase>`` events, the
benchmark's phase table and ``ds-hecate report``'s stacked bars all use these keys. Every part of a call is in one:
the forward's phases, then its backward's (``*_bwd``, timed between boundaries autograd reaches,
:class:`~ds_hecate.runtime.timing.BackwardPhases`) and the SparseReduceScatter's issue and wait, so they add up
to the call. ``route`` and ``route_bwd`` are the gate of a :class:`ds_hecate.MoE` layer, which the layer runs before
its call (DeepSpeed's gate, computed by ``ds_hecate.ops.topk_gate``); a model whose router is its own (a Hugging Face
model taken over) routes outside the layer, and they stay at zero.
"""

PHASE_LABELS = {"route": "routing (gate)", "counts": "count exchange", "plan": "planning", "gather": "gather wait",
                "dispatch": "dispatch", "compute": "expert compute (fwd)", "combine": "combine",
                "bookkeeping": "bookkeeping (fwd)", "combine_bwd": "combine (bwd)",
                "compute_bwd": "expert compute (bwd)", "dispatch_bwd": "dispatch (bwd)", "route_bwd": "routing (bwd)",
                "reduce_scatter": "reduce-scatter issue", "reduce_wait": "reduce-scatter wait",
                "regather": "re-gather (backward)"}
PHASES = tuple(PHASE_LABELS)
