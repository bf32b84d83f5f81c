"""User tools: the ds-hecate CLI, reports, the memory plan, routing traces (presets: ds_hecate.sim.presets)."""
