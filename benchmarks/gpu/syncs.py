"""Stage ``syncs``: every host sync of the layer call on CUDA, found by the device itself.

Three models of two ``ds_hecate.MoE`` layers each (top-2, the second layer's weights prefetched while the first
computes): SwiGLU experts in fp32, SwiGLU experts in bf16, and experts with biases (``Linear`` with bias, GELU,
``Linear`` with bias) in bf16; each on one rank twice: with the one-rank shortcuts on, and with them off over a
one-rank process group (NCCL on a GPU): the per-rank path of N ranks, every collective through the group. Each runs
one warm-up step and then a few training steps (forward, backward, the flush of the gradient reductions, the dense
and the expert optimizer step with the resident refresh).

On CUDA ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call warn: a device-to-host copy,
``.item()``, ``nonzero``, a stream or device synchronize, and the ones the host code of a CUDA op makes inside it
(a grouped GEMM's fallback copying its offsets to the host, ``segment_reduce`` checking its lengths), which no
CPU-side check sees. Each is recorded with the line of the project's code that made it (the innermost frame of
``ds_hecate`` on the stack when it warned). Allowed: one per layer call in forward (the count exchange: only the
counts may cross, the planner's input), none elsewhere in the forward, none in backward. The optimizer steps' syncs
are reported, not judged (a step boundary may read). The mode is set back to off after each run.

Dry run: the same runs under the GPU stand-in (tests/fake_cupy.py), which records the host reads torch's dispatcher
sees, with the line that made each (not those made inside an op's own host code: only a GPU shows those).

Internals reached: the runtime set up as the engine sets it up (:func:`benchmarks.gpu.training.hecate_runtime`), and
``build_communicator`` for the one-rank group with its shortcuts off.
"""
from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections import Counter
from typing import Dict, Iterator, List, Tuple

from .common import Context, result
from .nccl import _init_single
from .training import hecate_runtime

#: (name, expert kind, compute dtype)
MODELS = (("fp32", "swiglu", "fp32"), ("bf16", "swiglu", "bf16"), ("bf16-biased", "biased", "bf16"))
PATHS = ("shortcuts", "n-rank")
#: syncs a layer call may make in forward: the count exchange's read of the counts
ALLOWED_PER_CALL = 1
_SYNC_WARNING = "synchronizing CUDA operation"
_PACKAGE = os.sep + "ds_hecate" + os.sep


def sizes(ctx: Context) -> Tuple[int, int, int, int, int]:
    """(hidden, ffn, experts, tokens, steps): on a GPU a layer large enough for its kernels' real paths, small
    enough that the stage is seconds."""
    if ctx.dry_run:
        return 32, 64, 8, 64, 2
    return (1024, 1024, 16, 2048, 2) if ctx.quick else (1024, 2048, 32, 4096, 3)


def _site(stack: List[traceback.FrameSummary]) -> str:
    """The innermost frame of the package on ``stack`` (else the innermost outside torch and the warnings module)."""
    for frame in reversed(stack):
        if _PACKAGE in frame.filename:
            return f"ds_hecate/{frame.filename.split(_PACKAGE, 1)[1]}:{frame.lineno}"
    for frame in reversed(stack):
        if os.sep + "torch" + os.sep not in frame.filename and "warnings" not in frame.filename:
            return f"{os.path.relpath(frame.filename)}:{frame.lineno}"
    return "unknown"


class SyncLog:
    """The host syncs seen so far: (kind, site) each."""

    def __init__(self) -> None:
        self.events: List[Tuple[str, str]] = []
        self._shim = None

    def __len__(self) -> int:
        if self._shim is not None:   # the stand-in records its host reads itself
            return len(self._shim.host_reads)
        return len(self.events)

    def since(self, start: int) -> List[Tuple[str, str]]:
        if self._shim is not None:
            return list(zip(self._shim.host_reads[start:], self._shim.read_sites[start:]))
        return self.events[start:]


@contextlib.contextmanager
def recording(ctx: Context, stand_in) -> Iterator[SyncLog]:
    """Record every host sync in the block: the sync debug mode on CUDA, the stand-in's host reads in a dry run."""
    log = SyncLog()
    if ctx.dry_run:
        log._shim = stand_in.shim
        yield log
        return
    import torch

    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        if _SYNC_WARNING in str(message):
            log.events.append(("sync", _site(traceback.extract_stack()[:-1])))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield log
        finally:
            torch.cuda.set_sync_debug_mode(0)


def build_model(kind: str, hidden: int, ffn: int, experts: int):
    """Two blocks ``x + moe(tanh(linear(x)))``, each with a ``ds_hecate.MoE`` of ``experts`` experts, top-2, routing
    without random draws; built on the CPU from seed 0."""
    import torch
    from torch import nn

    import ds_hecate

    def expert():
        if kind == "swiglu":
            return ds_hecate.SwiGLUExpert(hidden, ffn)
        return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))

    torch.manual_seed(0)
    return nn.ModuleDict({f"block{i}": nn.ModuleDict({
        "inp": nn.Linear(hidden, hidden),
        "moe": ds_hecate.MoE(hidden, expert(), num_experts=experts, k=2, drop_tokens=False, use_rts=False,
                             noisy_gate_policy=None, top2_2nd_expert_sampling=False)}) for i in range(2)})


def forward(model, x):
    import torch
    aux = 0.0
    for block in model.values():
        y, l_aux, _ = block["moe"](torch.tanh(block["inp"](x)))
        x = x + y
        aux = aux + l_aux.float()
    return x.float().pow(2).mean() + 0.01 * aux


def _communicator(path: str, dev):
    import torch.distributed as dist

    from ds_hecate.comm.backend import build_communicator
    if path == "shortcuts":
        return build_communicator("torch", None, 0, 1, dev, timeout_s=60)
    weights = dist.new_group([0])
    return build_communicator("torch", dist.group.WORLD, 0, 1, dev, timeout_s=60, weight_group=weights,
                              one_rank_shortcuts=False)


def run_one(ctx: Context, stand_in, model_name: str, kind: str, dtype_name: str, path: str) -> dict:
    """One model on one path: the syncs per layer call, elsewhere in forward, in backward and in the steps."""
    import torch
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    hidden, ffn, experts, tokens, steps = sizes(ctx)
    model = build_model(kind, hidden, ffn, experts)
    dev = torch.device("cuda", 0)
    rt, dense = hecate_runtime(model, _communicator(path, dev), dev, 1, dtype)
    calls: List[List[Tuple[str, str]]] = []   # the syncs of each judged layer call
    windows: List[Tuple[int, int]] = []         # the log's [start, end) of every layer call
    marks: List[int] = []
    out: Dict[str, list] = {"forward_other": [], "backward": [], "step": []}
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(tokens, hidden, generator=gen) for _ in range(steps + 1)]
    with recording(ctx, stand_in) as log:
        def after(module, args, output) -> None:
            windows.append((marks.pop(), len(log)))
        hooks = []
        for block in model.values():
            hooks.append(block["moe"].register_forward_pre_hook(lambda module, args: marks.append(len(log))))
            hooks.append(block["moe"].register_forward_hook(after))
        for step in range(steps + 1):   # step 0: warm-up (first collectives, allocator, costs), not judged
            x = inputs[step].to(dtype).to(dev)   # before the forward's window: a host-to-device copy
            windows.clear()
            start = len(log)
            rt.on_model_forward()
            loss = forward(model, x)
            inside = {i for a, b in windows for i in range(a, b)}
            forward_other = [s for i, s in enumerate(log.since(start), start) if i not in inside]
            step_calls = [log.since(a)[:b - a] for a, b in windows]
            start = len(log)
            loss.backward()
            rt.flush_reductions()
            backward = log.since(start)
            start = len(log)
            dense.step()
            dense.zero_grad()
            rt.apply_step(True, 1, 1.0, 0.0, rt.optimizer.current_hyperparameters())
            rt.after_step(step + 1)
            if step == 0:
                continue
            calls += step_calls
            out["forward_other"] += forward_other
            out["backward"] += backward
            out["step"] += log.since(start)
        for h in hooks:
            h.remove()
    per_call = [len(c) for c in calls]
    extra = [s for c in calls for s in c[ALLOWED_PER_CALL:]] if any(n > ALLOWED_PER_CALL for n in per_call) else []
    wrong = extra + out["forward_other"] + out["backward"]
    return {"model": model_name, "path": path, "calls": len(calls), "per_call": per_call,
            "forward_other": len(out["forward_other"]), "backward": len(out["backward"]), "step": len(out["step"]),
            "step_sites": dict(Counter(site for _, site in out["step"])),
            "unexpected_sites": dict(Counter(site for _, site in wrong)),
            "ok": bool(calls) and max(per_call) <= ALLOWED_PER_CALL and not out["forward_other"]
            and not out["backward"]}


def _describe(r: dict) -> str:
    worst = max(r["per_call"], default=0)
    where = ", ".join(f"{site} x{n}" for site, n in sorted(r["unexpected_sites"].items(), key=lambda kv: -kv[1])[:3])
    parts = []
    if worst > ALLOWED_PER_CALL:
        parts.append(f"{worst} syncs in a layer call ({ALLOWED_PER_CALL} allowed)")
    if r["forward_other"]:
        parts.append(f"{r['forward_other']} in forward outside the layer calls")
    if r["backward"]:
        parts.append(f"{r['backward']} in backward")
    if not r["calls"]:
        parts.append("no layer call seen")
    return f"{r['model']}/{r['path']}: " + "; ".join(parts) + (f" at {where}" if where else "")


def run(ctx: Context) -> dict:
    import torch
    _init_single("gloo" if ctx.dry_run else "nccl")
    runs, errors = [], []
    with ctx.stand_in() as stand_in:
        if not ctx.dry_run:
            torch.cuda.set_device(0)
        for model_name, kind, dtype_name in MODELS:
            for path in PATHS:
                try:
                    runs.append(run_one(ctx, stand_in, model_name, kind, dtype_name, path))
                except Exception as exc:  # noqa: BLE001 - one run failing must not hide the others' syncs
                    errors.append(f"{model_name}/{path}: {type(exc).__name__}: {str(exc)[:160]}")
    bad = [_describe(r) for r in runs if not r["ok"]]
    ok = not bad and not errors and len(runs) == len(MODELS) * len(PATHS)
    steps = sizes(ctx)[-1]
    where = "host reads the stand-in sees" if ctx.dry_run else "syncs (torch.cuda.set_sync_debug_mode)"
    if ok:
        summary = (f"{len(runs)} runs ({', '.join(m for m, _, _ in MODELS)} x shortcuts on/off), {steps} steps: "
                   f"at most {ALLOWED_PER_CALL} of the {where} per layer call (the counts), none elsewhere in "
                   f"forward or in backward; {sum(r['step'] for r in runs)} in the optimizer steps")
    else:
        summary = "; ".join(errors + bad)
    return result(ok, summary, runs=runs, errors=errors, allowed_per_call=ALLOWED_PER_CALL,
                  recorded_by=where, sizes=dict(zip(("hidden", "ffn", "experts", "tokens", "steps"), sizes(ctx))))

