"""What a rank measures besides step time (bytes it sends, resident and transient memory, its share of a core),
apart from the step loop that uses these probes."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict

from benchmarks.systems import System


class ByteCounter:
    """Bytes this rank sends in torch.distributed collectives while a system steps (ring/pairwise algorithms):
    all-to-all: the input minus the rank's own part; all-reduce: 2(W-1)/W of the tensor; reduce-scatter: (W-1)/W of
    the input; all-gather: (W-1) times the input; broadcast: (W-1) times the tensor on the source."""

    NAMES = ("all_to_all_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
             "all_gather_single", "all_gather", "broadcast", "reduce_scatter", "all_to_all")

    def __init__(self) -> None:
        import torch.distributed as dist
        self.dist = dist
        self.active = False
        self.bytes = 0
        self.originals: Dict[str, Callable] = {}
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            if name == "all_gather_into_tensor" and hasattr(dist, "all_gather_single"):
                continue   # torch 2.13+: the old name forwards to all_gather_single, counted there
            self.originals[name] = original
            wrapper = self._wrap(name, original)
            setattr(dist, name, wrapper)
            if getattr(dist.distributed_c10d, name, None) is original:
                setattr(dist.distributed_c10d, name, wrapper)

    def restore(self) -> None:
        for name, original in self.originals.items():
            setattr(self.dist, name, original)
            setattr(self.dist.distributed_c10d, name, original)

    @staticmethod
    def _nbytes(t) -> int:
        return t.numel() * t.element_size()

    def _sent(self, name: str, args, kwargs) -> float:
        dist = self.dist
        group = kwargs.get("group")
        if name == "broadcast":
            group = group if group is not None else (args[2] if len(args) > 2 else None)
        w = dist.get_world_size(group)
        if w <= 1:
            return 0.0
        if name == "all_to_all_single":
            inp = kwargs.get("input", args[1] if len(args) > 1 else None)
            splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
            row = self._nbytes(inp) / max(1, inp.shape[0]) if inp.dim() else 0
            me = dist.get_rank(group)
            own = splits[me] * row if splits else self._nbytes(inp) / w
            return self._nbytes(inp) - own
        if name == "all_reduce":
            return 2.0 * (w - 1) / w * self._nbytes(kwargs.get("tensor", args[0] if args else None))
        if name == "reduce_scatter_tensor":
            return (w - 1) / w * self._nbytes(kwargs.get("input", args[1] if len(args) > 1 else None))
        if name in ("all_gather_into_tensor", "all_gather_single"):
            return (w - 1) * self._nbytes(kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
        if name == "all_gather":
            return (w - 1) * self._nbytes(kwargs.get("tensor", args[1] if len(args) > 1 else None))
        if name == "broadcast":
            src = kwargs.get("src", args[1] if len(args) > 1 else 0)
            t = kwargs.get("tensor", args[0] if args else None)
            return (w - 1) * self._nbytes(t) if dist.get_rank() == src else 0.0
        if name == "reduce_scatter":
            inputs = kwargs.get("input_list", args[1] if len(args) > 1 else [])
            return (w - 1) / w * sum(self._nbytes(t) for t in inputs)
        if name == "all_to_all":
            inputs = kwargs.get("input_tensor_list", args[1] if len(args) > 1 else [])
            me = dist.get_rank(group)
            return sum(self._nbytes(t) for i, t in enumerate(inputs) if i != me)
        return 0.0

    def _wrap(self, name: str, original: Callable) -> Callable:
        def counted(*args, **kwargs):
            if self.active:
                try:
                    self.bytes += self._sent(name, args, kwargs)
                except Exception:  # counting must never break the collective; an unknown form counts 0
                    pass
            return original(*args, **kwargs)
        counted.__wrapped__ = original
        return counted


def resident_bytes(system: System) -> int:
    """Bytes of the tensors a system keeps between steps (parameters, gradients, optimizer states, fp32 masters,
    Hecate's shards), deduplicated by storage."""
    import torch
    from torch import nn
    seen_storage: set = set()
    seen_obj: set = set()
    total = 0

    def visit(obj, depth: int) -> None:
        nonlocal total
        if id(obj) in seen_obj or depth > 6:
            return
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
            except (RuntimeError, NotImplementedError):
                return
            if key[0] and key not in seen_storage:
                seen_storage.add(key)
                total += key[1]
            if obj.grad is not None:
                visit(obj.grad, depth + 1)
            return
        if isinstance(obj, nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                visit(t, depth + 1)
            return
        if isinstance(obj, dict):
            for v in list(obj.values()):
                visit(v, depth + 1)
            return
        if isinstance(obj, (list, tuple, set)):
            for v in list(obj):
                visit(v, depth + 1)
            return
        module = type(obj).__module__ or ""
        if module.startswith(("deepspeed", "torch.optim", "ds_hecate")) and hasattr(obj, "__dict__"):
            for v in list(vars(obj).values()):
                visit(v, depth + 1)

    if system.engine is not None:
        visit(system.engine.module, 0)
        visit(system.engine.optimizer, 0)
        if system.hecate is not None:
            visit(system.hecate, 0)
    else:
        visit(system.local_model, 0)
        visit(system.optimizer, 0)
    return total


def transient_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of the bytes allocated (and not yet freed) while ``fn`` runs, from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def parallel_efficiency(rank: int, world: int, seconds: float = 0.3) -> float:
    """How much of a core each rank gets when all compute at once: the mean time of a fixed matmul loop run by one
    rank alone over its time when every rank runs it together (1.0: a core each; 1/world: all share one).

    Why: this machine's 2 vCPUs are shared with whatever else runs; with less than a core per rank, balancing
    expert compute between ranks gains little and the step times say more about the neighbours than the systems.
    """
    import deepspeed.comm as dist
    import torch
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    start, reps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds / 3:   # size the loop on this rank alone-ish (warm-up too)
        a @ b
        reps += 1
    counts = [None] * world
    dist.all_gather_object(counts, reps)
    reps = max(1, min(counts))

    def loop() -> float:
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        return time.perf_counter() - t
    alone = 0.0
    for r in range(world):
        dist.barrier()
        if r == rank:
            alone = loop()
        dist.barrier()
    together = loop()
    dist.barrier()
    pairs = [None] * world
    dist.all_gather_object(pairs, (alone, together))
    return sum(x for x, _ in pairs) / sum(y for _, y in pairs)
