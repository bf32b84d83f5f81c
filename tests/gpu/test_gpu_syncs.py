"""Every host sync of the layer call on CUDA, found by the device itself (``make gpu-check``'s stage ``syncs``).

Three models of two ``ds_hecate.MoE`` layers (top-2; the second layer's weights prefetched while the first computes):
SwiGLU experts in fp32 and in bf16, and Linear-GELU-Linear experts with biases in bf16; each with the one-rank
shortcuts on, and off over a one-rank process group (NCCL on a GPU: the per-rank path of N ranks). One warm-up step,
then a few training steps. On CUDA ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing call warn,
those inside an op's own host code too (a grouped GEMM's fallback copying its offsets, ``segment_reduce`` checking
its lengths), each recorded with the line of ds_hecate that made it. Allowed: one per layer call in forward (the
count exchange: only the counts may cross), none elsewhere in forward, none in backward; the optimizer steps' are
not judged. Under the GPU stand-in: the host reads torch's dispatcher sees, with the line that made each.
"""
from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections import Counter
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist

from gpu_training import blocks_loss, build_blocks, hecate_runtime, step

#: syncs a layer call may make in forward: the count exchange's read of the counts
ALLOWED_PER_CALL = 1
_PACKAGE = os.sep + "ds_hecate" + os.sep


def _site(stack: List[traceback.FrameSummary]) -> str:
    """The innermost frame of the package on ``stack`` (else the innermost outside torch and warnings)."""
    for frame in reversed(stack):
        if _PACKAGE in frame.filename:
            return f"ds_hecate/{frame.filename.split(_PACKAGE, 1)[1]}:{frame.lineno}"
    for frame in reversed(stack):
        if os.sep + "torch" + os.sep not in frame.filename and "warnings" not in frame.filename:
            return f"{os.path.relpath(frame.filename)}:{frame.lineno}"
    return "unknown"


class SyncLog:
    """The host syncs seen so far, (kind, site) each: the sync debug mode's on CUDA, the stand-in's host reads."""

    def __init__(self, shim=None) -> None:
        self.events: List[Tuple[str, str]] = []
        self.shim = shim

    def __len__(self) -> int:
        return len(self.shim.host_reads) if self.shim is not None else len(self.events)

    def since(self, start: int) -> List[Tuple[str, str]]:
        if self.shim is not None:
            return list(zip(self.shim.host_reads[start:], self.shim.read_sites[start:]))
        return self.events[start:]


@contextlib.contextmanager
def recording(gpu) -> Iterator[SyncLog]:
    if not gpu.real:
        yield SyncLog(gpu.stand_in.shim)
        return
    log = SyncLog()

    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing CUDA operation" in str(message):
            log.events.append(("sync", _site(traceback.extract_stack()[:-1])))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield log
        finally:
            torch.cuda.set_sync_debug_mode(0)


def _communicator(path: str, dev):
    from ds_hecate.comm.backend import build_communicator
    if path == "shortcuts":
        return build_communicator("torch", None, 0, 1, dev, timeout_s=60)
    return build_communicator("torch", dist.group.WORLD, 0, 1, dev, timeout_s=60, weight_group=dist.new_group([0]),
                              one_rank_shortcuts=False)


def syncs(gpu, kind: str, dtype: torch.dtype, path: str) -> dict:
    """One model on one path: the syncs of each judged layer call, elsewhere in forward, in backward, in the steps."""
    hidden, ffn, experts, tokens, steps = (1024, 2048, 32, 4096, 3) if gpu.real else (32, 64, 8, 64, 2)
    model: Any = build_blocks(kind, hidden, ffn, experts)   # blocks: ModuleDicts
    dev = torch.device("cuda", 0)
    rt, dense = hecate_runtime(model, _communicator(path, dev), dev, 1, dtype)
    calls: List[List[Tuple[str, str]]] = []
    windows: List[Tuple[int, int]] = []   # the log's [start, end) of every layer call
    marks: List[int] = []
    out: Dict[str, list] = {"forward_other": [], "backward": [], "step": []}
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(tokens, hidden, generator=gen) for _ in range(steps + 1)]
    with recording(gpu) as log:
        hooks = [h for block in model.values() for h in (
            block["moe"].register_forward_pre_hook(lambda module, args: marks.append(len(log))),
            block["moe"].register_forward_hook(lambda module, args, output: windows.append((marks.pop(), len(log)))))]
        for number in range(steps + 1):   # step 0 warms up (first collectives, allocator, costs): not judged
            x = inputs[number].to(dtype).to(dev)   # before the forward's window: a host-to-device copy
            windows.clear()
            start = len(log)
            rt.on_model_forward()
            loss = blocks_loss(model, x)
            inside = {i for a, b in windows for i in range(a, b)}
            forward_other = [s for i, s in enumerate(log.since(start), start) if i not in inside]
            step_calls = [log.since(a)[:b - a] for a, b in windows]
            start = len(log)
            loss.backward()
            rt.flush_reductions()
            backward = log.since(start)
            start = len(log)
            step(rt, dense, 1, number + 1)
            if number:
                calls += step_calls
                out["forward_other"] += forward_other
                out["backward"] += backward
                out["step"] += log.since(start)
        for h in hooks:
            h.remove()
    per_call = [len(c) for c in calls]
    wrong = [s for c in calls for s in c[ALLOWED_PER_CALL:]] + out["forward_other"] + out["backward"]
    return {"calls": len(calls), "per_call": per_call, "forward_other": len(out["forward_other"]),
            "backward": len(out["backward"]), "step": len(out["step"]),
            "unexpected_sites": dict(Counter(site for _, site in wrong)),
            "ok": bool(calls) and max(per_call) <= ALLOWED_PER_CALL and not wrong}


@pytest.mark.parametrize("path", ["shortcuts", "n-rank"])
@pytest.mark.parametrize("kind, dtype", [("swiglu", torch.float32), ("swiglu", torch.bfloat16),
                                         ("biased", torch.bfloat16)])
def test_a_layer_call_syncs_once_in_forward_and_never_in_backward(gpu, one_rank_group, kind, dtype, path):
    result = syncs(gpu, kind, dtype, path)
    assert result["ok"], result


def test_a_host_read_beyond_the_counts_is_named(gpu, one_rank_group, monkeypatch):
    """A host read inside a layer call beyond the counts', and one in backward, each fail the check, which names the
    lines that made them."""
    built = build_blocks

    def reading(where):
        def build(*args):
            model: Any = built(*args)   # blocks: ModuleDicts
            if where == "forward":
                model["block0"]["moe"].register_forward_hook(lambda m, a, out: (out[0].sum().item(), None)[1],
                                                             prepend=True)
            else:   # in backward: a hook on the gradient of a layer's output
                model["block1"]["inp"].register_forward_hook(
                    lambda m, a, out: (out.register_hook(lambda grad: (grad.sum().item(), None)[1]), None)[1])
            return model
        return build
    clean = syncs(gpu, "biased", torch.bfloat16, "shortcuts")
    assert clean["ok"] and clean["backward"] == 0, clean
    here = f"tests/gpu/{os.path.basename(__file__)}"
    for where in ("forward", "backward"):
        monkeypatch.setitem(globals(), "build_blocks", reading(where))
        dirty = syncs(gpu, "biased", torch.bfloat16, "shortcuts")
        assert not dirty["ok"], (where, dirty)
        assert (dirty["per_call"][0], dirty["backward"] > 0) == ((2, False) if where == "forward" else (1, True))
        assert {site.split(":")[0] for site in dirty["unexpected_sites"]} == {here}, dirty["unexpected_sites"]
