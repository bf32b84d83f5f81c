"""``make gpu-check``: :mod:`.runner` (the stages, each in its own process), the measuring stages :mod:`.device`,
:mod:`.micro` and :mod:`.layer`, and :mod:`.suite` (pytest on files of tests/gpu, and ``memcheck``). The dry run's
stand-ins live with the tests (tests/fake_cupy.py, tests/gpu_fakes.py, tests/device_shim.py).
"""
