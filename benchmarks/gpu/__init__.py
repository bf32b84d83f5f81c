"""``make gpu-check``: :mod:`.runner` (each stage in its own process) and its stages."""
