"""A CPU stand-in for a CUDA device, for tests: tensors that say ``cuda:0`` but compute on the CPU.

Inside :func:`cuda_shim`, factories with ``device="cuda"`` and ``.to("cuda")`` give :class:`ShimTensor` (real CPU
values; ``.device`` is ``cuda:0``), every op that mixes a shim tensor with a CPU tensor raises (as CUDA would, with
no CPU-scalar exception), every host-to-device copy is recorded (``shim.copies``: non_blocking, pinned), and every
host read of a device tensor, which on CUDA blocks the host until the device has caught up, is recorded
(``shim.host_reads``): ``.item()``/``bool()``/``int()``, ``.tolist()``, ``.numpy()``, a device-to-host copy
(``.cpu()``, ``.to("cpu")``), and the ops whose output shape depends on the data (``nonzero``, boolean-mask
indexing, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``), with the
line of the project's code that made it (``shim.read_sites``). The device's API answers as one device would
(``torch.cuda.synchronize``, ``device_count``, ``current_device``, ``set_device``, ``get_device_properties``), and
streams are stand-ins (``torch.cuda.Stream``, ``torch.cuda.stream``, ``current_stream``, ``Tensor.record_stream``)
whose work is done when issued, as every event's is: code written for CUDA streams runs as it is.
"""
from __future__ import annotations

import contextlib
import os
import sys
from types import FrameType, SimpleNamespace
from typing import Any, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
#: Ops CUDA runs only on tensors of one device, CPU scalars included (not TensorIterator ops).
_STRICT = {"cat", "stack", "index_select", "index_copy", "index_copy_", "index_put_", "index_add_", "index",
           "gather", "scatter", "scatter_", "mm", "bmm", "addmm", "repeat_interleave", "bincount", "argsort", "sort"}


class ShimTensor(torch.Tensor):
    """A CPU tensor that reports ``cuda:0`` (autograd sees a meta tensor)."""

    inner: Any   # the CPU tensor held (shadows Tensor.inner, the inner product)

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),
                                                storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                device=torch.device("meta"), requires_grad=inner.requires_grad)
        r.inner = inner
        return r

    # Tensor declares device, is_cuda and __repr__'s keyword, __torch_dispatch__'s signature otherwise: a stand-in
    @property
    def device(self):  # type: ignore[override]
        return CUDA

    @property
    def is_cuda(self):  # type: ignore[override]
        return True

    def __repr__(self):  # type: ignore[override]
        return f"ShimTensor(cuda:0, {self.inner!r})"

    def data_ptr(self):
        return self.inner.data_ptr()

    __torch_function__ = torch._C._disabled_torch_function_impl   # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        return _dispatch(func, args, kwargs)


def _device(x):
    return CUDA if isinstance(x, ShimTensor) else x.device


def _unwrap(x):
    return x.inner if isinstance(x, ShimTensor) else x


def _wrap(x):
    return ShimTensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, ShimTensor) else x


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)


_aten = torch.ops.aten
#: Ops that read a device tensor on the host (CUDA synchronises): a value, or an output shape that depends on data.
_HOST_READS = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
               _aten.bincount.default, _aten.equal.default, _aten.is_nonzero.default, _aten._unique2.default,
               _aten.unique_consecutive.default, _aten.unique_dim.default, _aten.allclose.default}
_INDEXING = (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default)
#: the stand-in's compute capability (``torch.cuda.get_device_capability``): an H100's unless a test sets another
CAPABILITY = [(9, 0)]
#: where host reads are recorded (the active shim's list), None outside a shim
_READS: List[List[str]] = []
#: the line of code outside torch and this file that made each read (the active shim's list)
_SITES: List[List[str]] = []
_TORCH_DIR = os.path.dirname(torch.__file__)


def _site() -> str:
    """``file:line`` of the innermost caller outside torch and this file (what made a host read)."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and name != __file__ and "<" not in name:
            return f"{os.path.relpath(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "unknown"


def _record_read(kind: str) -> None:
    _READS[-1].append(kind)
    _SITES[-1].append(_site())


def _host_read(func, args, kwargs) -> str:
    """The kind of host read ``func`` on these arguments makes, or '' (only shim tensors are on the "device")."""
    flat = tree_flatten((args, kwargs))[0]
    if not any(isinstance(t, ShimTensor) for t in flat):
        return ""
    if func in _HOST_READS:
        return func.__name__.split(".")[0]
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None and len(args) < 3:
        return "repeat_interleave without output_size"
    if func is _aten._grouped_mm.default and (args[0].dtype != torch.bfloat16 or CAPABILITY[-1][0] not in (9, 10)):
        # grouped GEMM has a device-side kernel for bf16 on sm90 / sm100 only; elsewhere its fallback copies the
        # offsets to the host and loops
        return "grouped_mm fallback (offsets read on the host)"
    if func is _aten.segment_reduce.default and not kwargs.get("unsafe", False):
        return "segment_reduce length check"
    if func in _INDEXING and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in flat[1:]):
        return "boolean-mask indexing"
    if func is _aten._to_copy.default and kwargs.get("device") is not None \
            and torch.device(kwargs["device"]).type == "cpu":
        return "device-to-host copy"
    if func is _aten.copy_.default and not isinstance(args[0], ShimTensor) and isinstance(args[1], ShimTensor):
        return "device-to-host copy"
    return ""


def _dispatch(func, args, kwargs):
    kwargs = dict(kwargs or {})
    # pinning at the dispatch level: autograd runs backward without the torch-function mode, but with this one
    if func is _aten._pin_memory.default:
        out = args[0].clone()
        out._shim_pinned = True
        return out
    if func is _aten.is_pinned.default:
        return getattr(args[0], "_shim_pinned", False)
    if func is _aten.record_stream.default:   # the stand-in's streams: work is done when issued
        return None
    if _READS:
        read = _host_read(func, args, kwargs)
        if read:
            _record_read(read)
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    devices = {_device(t) for t in tensors}
    if len(devices) > 1 and func.__name__.split(".")[0] not in _STRICT:  # CUDA's CPU-scalar exception
        devices = {_device(t) for t in tensors if isinstance(t, ShimTensor) or t.dim() > 0}
    if len(devices) > 1 and func not in _COPIES:
        raise RuntimeError(f"device shim: {func} mixes tensors on {sorted(map(str, devices))} "
                           "(CUDA would refuse this)")
    target = kwargs.get("device")
    if target is not None:
        wrap = torch.device(target).type in ("cuda", "meta")   # meta: C++ code using a shim tensor's options
        if wrap:
            kwargs["device"] = torch.device("cpu")
    else:
        wrap = CUDA in devices
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if func._schema.name.endswith("_") and args and isinstance(args[0], ShimTensor):
        return args[0]  # in place
    if "out" in kwargs and isinstance(kwargs["out"], ShimTensor):
        return kwargs["out"]
    return tree_map(_wrap, out) if wrap else out


class _Function(TorchFunctionMode):
    def __init__(self, copies: List[Tuple[bool, bool]]):
        super().__init__()
        self.copies = copies

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to or func is torch.Tensor.cuda:
            self_t = args[0]
            if func is torch.Tensor.cuda:
                device, dtype, non_blocking = CUDA, None, kwargs.get("non_blocking", False)
            else:
                device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type == "cuda":
                if not isinstance(self_t, ShimTensor):
                    self.copies.append((bool(non_blocking), getattr(self_t, "_shim_pinned", False)))
                with torch._C.DisableTorchFunctionSubclass():
                    inner = _unwrap(self_t)
                    moved = inner.to(dtype) if dtype is not None else inner
                    if moved is inner and not isinstance(self_t, ShimTensor):
                        moved = inner.clone()
                return self_t if moved is inner and isinstance(self_t, ShimTensor) else ShimTensor(moved)
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cuda":
            with torch._C.DisableTorchFunctionSubclass():
                host = func(*args, **{**kwargs, "device": "cpu"})
            return ShimTensor(host)
        if func is torch.Tensor.tolist and isinstance(args[0], ShimTensor):
            _record_read("tolist")
            return args[0].inner.tolist()
        if func is torch.Tensor.numpy and isinstance(args[0], ShimTensor):
            _record_read("numpy")
            return args[0].inner.numpy()
        return func(*args, **kwargs)   # pinning is handled at the dispatch level (_dispatch)


class FakeEvent:
    """torch.cuda.Event stand-in: records the host time (the shim runs every kernel synchronously)."""

    created = 0

    def __init__(self, enable_timing: bool = False, **kwargs) -> None:
        FakeEvent.created += 1
        self.enable_timing = enable_timing
        self.t: Optional[float] = None

    def record(self, stream=None) -> None:
        import time
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.enable_timing and end.enable_timing, "elapsed_time needs enable_timing=True on both events"
        assert self.t is not None and end.t is not None, "elapsed_time of an event that was never recorded"
        return (end.t - self.t) * 1e3


class FakeStream(torch.Stream):
    """torch.cuda.Stream stand-in: work queued on it is done (the shim runs every kernel when issued). A
    ``torch.Stream`` (of the CPU) so that ``Tensor.record_stream`` takes it; the shim's dispatch ignores that call."""

    cuda_stream = 0

    def __new__(cls, device=None, priority: int = 0, **kwargs) -> "FakeStream":
        return super().__new__(cls, device="cpu")

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> Any:   # a FakeEvent
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


#: what ``torch.cuda.get_device_properties`` answers for the stand-in device (an H100 SXM's figures)
DEVICE_PROPERTIES = SimpleNamespace(name="CUDA stand-in (CPU)", multi_processor_count=132,
                                    total_memory=80 * 2 ** 30, major=9, minor=0, memory_clock_rate=None,
                                    memory_bus_width=None)


def _set_device(device) -> None:
    index = device.index if isinstance(device, torch.device) else device
    if index not in (None, 0):
        raise RuntimeError(f"device shim: the stand-in has one device, cuda:0, not {device}")


class Shim:
    """Handle of an active shim: ``copies`` lists (non_blocking, pinned) of every host-to-device copy,
    ``collectives`` the name of every torch.distributed call that moved tensors, ``host_reads`` the kind of every
    host read of a device tensor and ``read_sites`` the line of code that made it."""

    def __init__(self) -> None:
        self.copies: List[Tuple[bool, bool]] = []
        self.collectives: List[str] = []
        self.host_reads: List[str] = []
        self.read_sites: List[str] = []


_COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_reduce", "broadcast",
                "reduce_scatter_tensor", "all_gather")


def _checked_collective(shim: Shim, name: str, original):
    def call(*args, **kwargs):
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        wrong = sorted({str(t.device) for t in tensors if not isinstance(t, ShimTensor)})
        if wrong:
            raise AssertionError(f"device shim: torch.distributed.{name} got tensors on {wrong}, not on the "
                                 "working device cuda:0 (NCCL would reject them)")
        shim.collectives.append(name)
        return original(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    return call


@contextlib.contextmanager
def cuda_shim():
    """Run the block with ``cuda`` tensors computed on the CPU (see the module docstring); torch.distributed's
    tensor collectives accept only tensors on the working device (and run them over gloo on the CPU values)."""
    import torch.distributed as dist

    shim = Shim()
    stream = FakeStream()
    stand_ins = {"_lazy_init": lambda: None, "Event": FakeEvent, "Stream": FakeStream,
                 "current_stream": lambda device=None: stream, "stream": lambda s=None: contextlib.nullcontext(),
                 "synchronize": lambda device=None: None, "device_count": lambda: 1, "current_device": lambda: 0,
                 "set_device": _set_device, "get_device_properties": lambda device=None: DEVICE_PROPERTIES,
                 "get_device_capability": lambda device=None: CAPABILITY[-1]}
    saved = {name: getattr(torch.cuda, name) for name in stand_ins}
    for name, value in stand_ins.items():
        setattr(torch.cuda, name, value)
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, _checked_collective(shim, name, fn))
    # the CUDA kernels cannot take the stand-in's tensors (their memory is the CPU's): on a machine with a real GPU
    # the runtime's probe would find them usable, so under the stand-in they are not (a test that wants kernel
    # device ops hands in their torch contracts)
    from ds_hecate.comm.gpu import backend
    saved_status = backend.kernels_status
    setattr(backend, "kernels_status", lambda device_index: (False, "the CUDA stand-in's tensors are on the CPU"))
    _READS.append(shim.host_reads)
    _SITES.append(shim.read_sites)
    try:
        with _Function(shim.copies), _Dispatch():
            yield shim
    finally:
        _READS.pop()
        _SITES.pop()
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        for name, fn in originals.items():
            setattr(dist, name, fn)
        backend.kernels_status = saved_status
