"""Per-layer execution and the per-step expert update (internal)."""
