"""User tools above the library: the ds-hecate CLI, the PNG report, the export of an HF checkpoint (presets and the
memory plan: ds_hecate.sim; the routing-trace format: ds_hecate.trace)."""
