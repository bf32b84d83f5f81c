"""``make gpu-check`` and ``make gpu-wheels``, one module per stage.

- :mod:`.runner`: the stages, each in its own process with its own timeout; the JSON and the Markdown table.
- :mod:`.stage`: runs one stage in a process; :mod:`.common`: the run's context, timing, the machine's ceilings.
- Stages: :mod:`.device`, :mod:`.suite` (pytest), :mod:`.training`, :mod:`.nccl` (round trips, two processes),
  :mod:`.streams`, :mod:`.memcheck`, :mod:`.micro`, :mod:`.layer` (the layer-call benchmark).
- :mod:`.fakes`: NCCL, CUDA streams and the kernels on the CPU, for the dry run and the CPU tests.
- :mod:`.wheelhouse`: ``make gpu-wheels``, the wheels an offline GPU machine lacks.
"""
