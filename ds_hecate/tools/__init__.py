"""User tools: the ds-hecate CLI, reports, the memory plan, routing traces, model presets."""
