"""``make gpu-check`` and ``make gpu-wheels``, one module per stage.

- :mod:`.runner`: the stages, each in its own process with its own timeout; the JSON and the Markdown table.
- :mod:`.stage`: runs one stage in a process; :mod:`.common`: the run's context, timing, the machine's ceilings.
- Stages: :mod:`.device`, :mod:`.suite` (pytest), :mod:`.training`, :mod:`.nccl` (round trips, two processes),
  :mod:`.streams`, :mod:`.memcheck`, :mod:`.micro`, :mod:`.layer` (the layer-call benchmark).
- The dry run's stand-ins live with the tests that use them (tests/fake_cupy.py, tests/gpu_fakes.py,
  tests/device_shim.py): :meth:`.common.Context.stand_in`.
- :mod:`.wheelhouse`: ``make gpu-wheels``, the wheels an offline GPU machine lacks.
"""
