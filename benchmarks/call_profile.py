"""What one call dispatches and allocates, from the torch profiler: the op count and allocation figures the layer
benchmarks report (``benchmarks/layer_call.py``, ``benchmarks/layer_versus.py``), defined once here.

- **Top-level ops** (``top``): dispatcher ops (``aten::``, ``c10d::`` and ds_hecate's registered ``ds_hecate::``
  ops) with no dispatcher op above them in the
  profiler's event tree: what the code itself dispatches, forward and backward (autograd's engine runs each
  backward node's ops under an ``autograd::`` event, so they count as top-level). On a GPU about one kernel launch
  each; views (``t``, ``view``, ``expand``) count too, they cost host time without a kernel. ``nested`` counts every
  dispatcher op (on the CPU a grouped GEMM loops over groups inside). Work outside the dispatcher (numpy, Python)
  is not an op.
- **Allocations** (``allocations``, ``allocated_bytes``): the profiler's memory events (``profile_memory=True``)
  with a positive size: every block the CPU allocator (and, on CUDA, the caching allocator) handed out during the
  call, freed or not; their count and total bytes. The caching allocator's blocks come from its cache, so on a GPU
  this counts allocator requests, not ``cudaMalloc`` calls.
- **Collectives** (``collectives``): the ``c10d::`` ops the call issued, by name (``c10d::alltoall_base_`` is
  ``all_to_all_single``): which path a layer took (its one-rank shortcuts, or the collectives of N ranks).
- **Top ops by self time** (``top_self``): the profiler's per-op summary of the same call, the ops that took most
  of its host time (on CUDA the kernels' time is not in it): where the time goes, for whoever works on the call.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

#: the dispatcher's op namespaces: torch's, its collectives', and ds_hecate's own registered ops
#: (``torch.library.custom_op``: ``ds_hecate::expert_weight_grads`` is one op at the dispatcher as a grouped GEMM
#: is, whatever it runs inside)
DISPATCHER_PREFIXES = ("aten::", "c10d::", "ds_hecate::")


def _dispatched(name: str) -> bool:
    return name.startswith(DISPATCHER_PREFIXES)


def top_level_ops(events) -> List[Any]:
    """The profiler events of dispatcher ops with no dispatcher op above them (see the module docstring)."""
    return [e for e in events if _dispatched(e.name) and (e.cpu_parent is None or not _dispatched(e.cpu_parent.name))]


def profile_call(fn: Callable[[], Any], top_self: int = 12) -> Dict[str, Any]:
    """Run ``fn`` once under the profiler; its op counts, allocations and the ``top_self`` ops by self host time
    (name, calls, self ms)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.events()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    table = sorted((a for a in prof.key_averages() if _dispatched(a.key)), key=lambda a: -a.self_cpu_time_total)
    collectives: Dict[str, int] = {}
    for e in events:
        if e.name.startswith("c10d::"):
            collectives[e.name] = collectives.get(e.name, 0) + 1
    return {"top": len(top_level_ops(events)), "nested": sum(1 for e in events if _dispatched(e.name)),
            "collectives": collectives,
            "allocations": sum(1 for n in sizes if n > 0), "allocated_bytes": sum(n for n in sizes if n > 0),
            "top_self": [[a.key, a.count, round(a.self_cpu_time_total / 1e3, 4)] for a in table[:top_self]]}
