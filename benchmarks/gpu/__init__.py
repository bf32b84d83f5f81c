"""``make gpu-check``: :mod:`.runner` (each stage in its own process), the measuring stages :mod:`.device`,
:mod:`.micro`, :mod:`.layer`, and :mod:`.suite` (pytest on files of tests/gpu, and ``memcheck``)."""
