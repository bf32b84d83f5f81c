"""How fast is one MoE layer call, forward + backward, on one rank, against the layers a user would write or pick?

    python -m benchmarks.layer --dtype fp32 --dtype bf16 --n-rank --markdown docs/benchmarks.md
    python -m benchmarks.layer --shape host-bound --shape host-bound-8 --profile     # ds_hecate's phases too
    python -m benchmarks.layer --device cuda --dtype bf16 --systems plain,ds_hecate
    python -m benchmarks.layer --quick                                               # a tiny shape, 3 rounds
    python -m benchmarks.layer --shape compute-bound --hf mixtral,gpt_oss,nemotron_h,glm4_moe

One process per (shape, dtype), one rank (gloo on the CPU, NCCL on CUDA): the systems of
:mod:`benchmarks.layer_systems` (``--n-rank``: their N-rank twins too) from the same weights on the same input, routing
and output gradient. First each system's call is compared with the plain layer's, and each twin must compute its
one-rank layer's bits and issue all-to-alls where that layer issues none (else the cell stops). Then ``--reps``
rounds in a rotated order; per system the median call, the paired ratio to the plain layer (median and 95% bootstrap
interval) and, from one profiled call, the top-level dispatcher ops, allocations and collectives. ds_hecate runs as
after the cost model's first steps; ``--profile`` times its phases. ``--hf FAMILIES``: transformers' experts modules
of those families taken over by ds_hecate against transformers' own call (:func:`~benchmarks.layer_systems.build_hf`),
and a check that no call relayouts the experts' weights (:func:`relayout_ops`), in place of ``--systems``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.layer_systems import (BUILDERS, DESCRIPTIONS, FLOOR_DESCRIPTIONS, HF_FAMILIES,  # noqa: E402
                                      N_RANK_TWIN, NAMED_SYSTEMS, ONE_RANK_TWIN, PROFILED, SHAPES, SYSTEMS,
                                      hf_systems, routed_inputs)

SCHEMA = "ds_hecate-layer/1"
MODULE = "benchmarks.layer"
DEFAULT_SHAPES = {"cpu": ("weight-bound", "launch-bound", "compute-bound"), "cuda": ("qwen3-30b-a3b", "deepseek-v3")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: agreement with the plain layer above which a row is flagged (bf16 rounds each system differently)
AGREEMENT_TOL = {"fp32": 1e-4, "bf16": 5e-2}
#: on CUDA how far a twin's input gradient may be from its layer's (largest difference over the largest magnitude):
#: token gathers take their backward with ``index_add_``, whose CUDA adds run in no fixed order
GRAD_ORDER_TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
#: the dispatcher's namespaces: torch's, its collectives' and ds_hecate's registered ops
DISPATCHED = ("aten::", "c10d::", "ds_hecate::")
#: the phase table's column of the router, timed in its own calls (:func:`router_call`)
ROUTER = "router"
#: the column of a layer that routes among its phases (ds_hecate.MoE's gate is its ``route`` phase): the harness's
#: own leaf and backward entry, timed as a router is with one multiplication in the router's place
HARNESS = "harness"
#: ops that write a tensor anew (a per-call relayout of the experts' weights is one of them; a transpose is a view)
COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::cat", "aten::stack",
            "aten::index_select", "aten::gather", "aten::_unsafe_view")


def init_one_rank(device: torch.device) -> None:
    """A one-process world: gloo on the CPU, NCCL on CUDA (what an N-rank run's collectives use there)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(common.free_port()))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):   # what DeepSpeed's layers read
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def one_call(layer, x0, grad, device, profile: Optional[Callable] = None):
    """(seconds, output, input gradient) of one call, gradients cleared before it (untimed); with ``profile``
    (:func:`profile_call`) its profile in place of the seconds."""
    layer.reset()
    x = x0.detach().requires_grad_(True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def call():
        out = layer.forward(x)
        out.backward(grad)
        layer.after_backward()
        sync()
        return out.detach()
    sync()
    if profile is not None:
        return profile(call), None, x.grad
    start = time.perf_counter()
    out = call()
    return time.perf_counter() - start, out, x.grad


def router_call(router: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor, device: torch.device) -> float:
    """The seconds of one call of a layer's router alone, forward and backward (its gates' gradient all ones), as
    :func:`one_call` runs a layer: the part of a ds_hecate call outside the layer's phases (the router, and the
    harness's leaf and backward entry), so that the phases and it add up to the call. Timed in the same interleaved
    rounds as the calls, so that it sees the caches they see."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = x0.detach().requires_grad_(True)
    sync()
    start = time.perf_counter()
    gates = router(x)
    gates.backward(torch.ones_like(gates))
    sync()
    return time.perf_counter() - start


def _harness(x: torch.Tensor) -> torch.Tensor:
    """:data:`HARNESS`'s router: one node for the backward to run."""
    return x * 1.0


def profile_call(fn: Callable[[], Any]) -> Dict[str, Any]:
    """One run of ``fn`` under the profiler: dispatcher ops with no dispatcher op above them (``top``: what the code
    dispatches, autograd's backward nodes included) and all of them (``nested``), the collectives by name, and the
    allocator's blocks handed out (count and bytes, freed or not)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    mine = [e for e in prof.events() if e.name.startswith(DISPATCHED)]
    top = [e for e in mine if e.cpu_parent is None or not e.cpu_parent.name.startswith(DISPATCHED)]
    sizes = [n for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and (n := e.nbytes()) > 0]
    collectives: Dict[str, int] = {}
    for e in mine:
        if e.name.startswith("c10d::"):
            collectives[e.name] = collectives.get(e.name, 0) + 1
    return {"top": len(top), "nested": len(mine), "collectives": collectives, "allocations": len(sizes),
            "allocated_bytes": sum(sizes)}


def relayout_ops(layer, x, shape) -> List[str]:
    """Copy ops of one forward (the backward's writes into gradient accumulators are no relayout) whose input is an
    ``[E, ...]`` tensor of at least ``E * hidden * ffn`` elements: a per-call relayout of the experts' weights."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, torch.no_grad():
        layer.forward(x)
    return [f"{e.name}{e.input_shapes}" for e in prof.events() if e.name in COPY_OPS and any(
        len(s) >= 3 and s[0] == shape.experts and math.prod(s) >= shape.experts * shape.hidden * shape.ffn
        for s in e.input_shapes or ())]


def reference(system: str) -> str:
    """What a system's output is checked against: the plain layer; for ``--hf``'s the family's other side."""
    family, _, side = system.partition("/")
    return f"{family}/{'transformers' if side == 'ds_hecate' else 'ds_hecate'}" if side else "plain"


def _relative(a, b) -> float:
    a, b = a.float().reshape(b.shape), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def same_input_grad(a, b, device) -> bool:
    """A twin's input gradient against its layer's: the same bits on the CPU, within :data:`GRAD_ORDER_TOL` on
    CUDA."""
    if a.shape != b.shape:
        return False
    if device.type != "cuda":
        return bool(torch.equal(a, b))
    return _relative(a, b) <= GRAD_ORDER_TOL[str(b.dtype).rpartition(".")[2]]


def check_twins(first: dict, collectives: dict, device) -> None:
    """Each N-rank twin against its one-rank layer: the same output and input gradient, all-to-alls in the twin's
    call and none in the layer's; else SystemExit naming the row (it would time another call)."""
    for twin, one in ONE_RANK_TWIN.items():
        if twin not in first:
            continue
        if one not in first:
            raise SystemExit(f"layer: {twin} has no one-rank layer to check against ({one} did not build)")
        (_, out, x_grad), (_, ref_out, ref_grad) = first[twin], first[one]
        if not (out.shape == ref_out.shape and torch.equal(out, ref_out) and same_input_grad(x_grad, ref_grad,
                                                                                              device)):
            raise SystemExit(f"layer: {twin} computed other bits than {one}; its row would time another call")
        exchanges = [sum(n for k, n in collectives[s].items() if "alltoall" in k) for s in (twin, one)]
        if not exchanges[0] or exchanges[1]:
            raise SystemExit(f"layer: {twin} issued {exchanges[0]} all-to-alls and {one} {exchanges[1]}; the twin "
                             "must take the N-rank path and its layer the one-rank path")


def measure_cell(shape_name: str, dtype_name: str, device_name: str, reps: int, warmup: int, names: List[str],
                 profile: bool = False) -> dict:
    """Every system's figures on one shape and dtype, in this process (the module docstring); the one-rank layers of
    the twins asked for are built for the check when not asked for themselves."""
    shape, dtype, device = SHAPES[shape_name], DTYPES[dtype_name], torch.device(device_name)
    init_one_rank(device)
    inputs = routed_inputs(shape, dtype, device)
    names = ["plain"] + [n for n in names if n != "plain"]
    built, skipped = {}, {}
    for name in names + [ONE_RANK_TWIN[n] for n in names if ONE_RANK_TWIN.get(n) not in names + [None]]:
        try:
            built[name] = BUILDERS[name](shape, inputs, dtype, device, **({"profile": profile}
                                                                          if name in PROFILED else {}))
        except Exception as exc:  # a system that cannot run here (AutoEP without its pins) is reported, not fatal
            traceback.print_exc()
            skipped[name] = f"{type(exc).__name__}: {exc}".strip()[:600]
    for s in [s for s in built if reference(s) not in built]:   # --hf: a family's two sides or neither
        skipped[s] = f"{reference(s)} did not build"
        del built[s]
    if "plain" not in built:
        raise SystemExit(f"layer: the plain layer did not build: {skipped.get('plain')}")
    xs = {s: inputs.x.reshape(b.input_shape) for s, b in built.items()}
    grads = {s: inputs.grad.reshape(b.input_shape) for s, b in built.items()}
    first = {s: one_call(b, xs[s], grads[s], device) for s, b in built.items()}
    check_twins(first, {s: one_call(b, xs[s], grads[s], device, lambda fn: profile_call(fn)["collectives"])[0]
                        for s, b in built.items()}, device)
    built = {s: b for s, b in built.items() if s in names}
    for _ in range(warmup):
        for s, b in built.items():
            one_call(b, xs[s], grads[s], device)
    before = {s: b.phases() for s, b in built.items() if b.phases}
    calls = {s: (lambda s=s: one_call(built[s], xs[s], grads[s], device)[0]) for s in built}
    outside = {s: (ROUTER, b.router) if b.router is not None else (HARNESS, _harness)
               for s, b in built.items() if profile and b.phases}
    routers = {f"{s} {name}": (lambda r=router, s=s: router_call(r, xs[s], device))
               for s, (name, router) in outside.items()}
    times = common.interleaved({**calls, **routers}, reps)
    out: Dict[str, dict] = {}
    for s, b in built.items():
        phases = {p: (v - before[s][p]) / reps for p, v in b.phases().items()} if b.phases and profile else None
        if phases is not None:   # what the call runs outside the layer's phases: its router, or the harness alone
            name = outside[s][0]
            phases = {**phases, name: statistics.fmean(times[f"{s} {name}"])}
        prof = one_call(b, xs[s], grads[s], device, profile_call)[0]
        ref = reference(s)
        agreement = {"out": _relative(first[s][1], first[ref][1]), "x_grad": _relative(first[s][2], first[ref][2])}
        out[s] = {"status": "ok", "description": {**DESCRIPTIONS, **FLOOR_DESCRIPTIONS}.get(s) or (
                      f"{ONE_RANK_TWIN[s]} on its N-rank path" if s in ONE_RANK_TWIN else f"--hf {s}"),
                  "times_s": times[s], "median_s": statistics.median(times[s]),
                  "ratio_vs_plain": list(common.paired_ratio(times[s], times["plain"])),
                  "ops": {"top": prof["top"], "nested": prof["nested"]}, "collectives": prof["collectives"],
                  "allocations": prof["allocations"], "allocated_bytes": prof["allocated_bytes"],
                  "agreement": agreement, **({"phases_s": phases} if phases else {}),
                  **({"relayout_ops": relayout_ops(b, xs[s], shape)} if s.endswith("/ds_hecate") else {})}
    for s in names:
        out.setdefault(s, {"status": "not run", "reason": skipped.get(s, "")})
    return {"shape": shape_name, **shape.__dict__, "dtype": dtype_name, "device": device_name, "reps": reps,
            "warmup": warmup, "systems": {s: out[s] for s in names}}


def cell_lines(cell: dict) -> str:
    return "\n".join([f"{cell['shape']} {cell['dtype']} ({cell['reps']} rounds)"] + [
        f"  {s:28s} " + (f"{1e3 * r['median_s']:9.2f} ms  x{common.ratio_text(r['ratio_vs_plain'])}  ops "
                         f"{r['ops']['top']:5d}  allocs {r['allocations']:5d}  differs "
                         f"{max(r['agreement'].values()):.1e}" if r["status"] == "ok" else f"not run: {r['reason']}")
        for s, r in cell["systems"].items()])


def run(args: argparse.Namespace) -> dict:
    """Each (shape, dtype) cell in a process of its own (fresh allocator, fresh DeepSpeed state)."""
    machine = common.describe_machine()
    cells = []
    for shape in args.shape:
        for dtype in args.dtype:
            with tempfile.TemporaryDirectory(prefix="layer_") as tmp:
                path = os.path.join(tmp, "cell.json")
                cmd = [sys.executable, "-m", MODULE, "--cell", path, "--shape", shape, "--dtype", dtype, "--device",
                       args.device, "--reps", str(args.reps), "--warmup", str(args.warmup)] + (
                           ["--hf", ",".join(args.hf)] if args.hf else ["--systems", ",".join(args.systems)]) + (
                           ["--profile"] if args.profile else [])
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if proc.returncode != 0 or not os.path.exists(path):
                    sys.exit(f"layer: {shape} {dtype} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
                cells.append(json.loads(Path(path).read_text()))
            print(cell_lines(cells[-1]), flush=True)
    return common.run_record(SCHEMA, MODULE, args.argv, machine, profile=args.profile, hf=args.hf, cells=cells)


def markdown(record: dict) -> str:
    """One row per (shape, dtype): the plain layer's median call and every other system's paired ratio to it
    (``-``: not measured; ``not run``: could not run here; ``!``: differs from the plain layer beyond the dtype's
    tolerance); the phases table when they were timed. ``--hf``: :func:`hf_markdown`."""
    cells = record["cells"]
    if record.get("hf"):
        return hf_markdown(record)
    systems = [s for s in NAMED_SYSTEMS if s != "plain" and any(s in c["systems"] for c in cells)]
    rows = []
    for c in cells:
        row = [c["shape"], c["dtype"], f"{1e3 * c['systems']['plain']['median_s']:.2f}"]
        for s in systems:
            r = c["systems"].get(s)
            flag = " !" if r and r["status"] == "ok" and max(r["agreement"].values()) > AGREEMENT_TOL[c["dtype"]] \
                else ""
            row.append("-" if r is None else "not run" if r["status"] != "ok" else
                       common.ratio_text(r["ratio_vs_plain"]) + flag)
        rows.append(row)
    reps = sorted({c["reps"] for c in cells})
    lines = common.header_lines(record) + [
        f"Paired ratio to the plain layer's call, median over {', '.join(map(str, reps))} interleaved rounds "
        "[95% interval]; below 1 is faster than the plain layer.", ""]
    lines += common.table(["shape", "dtype", "plain ms"] + systems, rows)
    phased = [(c, s, r) for c in cells for s, r in c["systems"].items() if r.get("phases_s") and record.get("profile")]
    if phased:
        names = list(dict.fromkeys(p for _, _, r in phased for p in r["phases_s"]))   # (the router: some have one)
        lines += ["", "ds_hecate's phases per call (ms, means; `--profile`), with what runs outside them timed in "
                  f"its own calls among the rounds (`{ROUTER}`: the router and the harness's leaf and backward entry; "
                  f"`{HARNESS}`, where the gate is the layer's `route` phase: the harness alone), their sum, the "
                  "call's mean and the sum over the mean:", ""]
        lines += common.table(["shape", "dtype", "system"] + names + ["sum", "call", "sum / call"], [
            [c["shape"], c["dtype"], s] + [f"{1e3 * r['phases_s'].get(p, 0.0):.2f}" for p in names]
            + [f"{1e3 * sum(r['phases_s'].values()):.2f}", f"{1e3 * statistics.fmean(r['times_s']):.2f}",
               f"{sum(r['phases_s'].values()) / statistics.fmean(r['times_s']):.3f}"] for c, s, r in phased])
    reasons = {s: r["reason"] for c in cells for s, r in c["systems"].items() if r["status"] != "ok" and s in systems}
    return "\n".join(lines + [""] * bool(reasons) + [f"- **{s}** not run: {why}" for s, why in reasons.items()])


def hf_markdown(record: dict) -> str:
    """One row per (shape, dtype, family): both sides' median calls, ds_hecate's paired ratios to transformers' call
    (``!``: outputs differ beyond the dtype's tolerance) and to the first family's through ds_hecate, the relayouts."""
    rows, base = [], record["hf"][0] + "/ds_hecate"
    for c in record["cells"]:
        for family in record["hf"]:
            r, t = (c["systems"][f"{family}/{side}"] for side in ("ds_hecate", "transformers"))
            if r["status"] != "ok":
                rows.append([c["shape"], c["dtype"], family, f"not run: {r['reason'][:80]}"])
                continue
            flag = " !" if max(r["agreement"].values()) > AGREEMENT_TOL[c["dtype"]] else ""
            ratio = [common.ratio_text(common.paired_ratio(r["times_s"], ref["times_s"]))
                     for ref in (t, c["systems"][base])]
            rows.append([c["shape"], c["dtype"], family, f"{1e3 * r['median_s']:.2f}", f"{1e3 * t['median_s']:.2f}",
                         ratio[0] + flag, ratio[1], "; ".join(r["relayout_ops"][:3]) or "none"])
    lines = common.header_lines(record) + [
        "transformers' experts modules taken over by ds_hecate (grouped GEMM) against transformers' own call "
        f"(`grouped_mm`) on the same weights and routing, and against {record['hf'][0]}'s: medians of per-round "
        "ratios over interleaved rounds [95% interval]; relayout ops: copies of all experts' weights in a call.", ""]
    return "\n".join(lines + common.table(["shape", "dtype", "family", "ds_hecate ms", "transformers ms",
                                            "/ transformers", f"/ {record['hf'][0]}", "relayout ops"], rows))


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable (default: the device's)")
    p.add_argument("--dtype", action="append", choices=("fp32", "bf16"), help="repeatable (default: fp32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--systems", default=",".join(DESCRIPTIONS),
                   help="comma-separated, from " + ", ".join(NAMED_SYSTEMS))
    p.add_argument("--n-rank", action="store_true", help="also each system's N-rank twin")
    p.add_argument("--hf", help="comma-separated transformers families, in place of --systems: from " +
                   ", ".join(HF_FAMILIES) + "; the first is the others' base")
    p.add_argument("--profile", action="store_true", help="time ds_hecate's phases (the runtime's profiling on)")
    p.add_argument("--reps", type=int, default=None, help="interleaved rounds per cell (default 30; --quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per system first (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="the tiny 'quick' shape, 3 rounds: checks that it runs")
    p.add_argument("--json", default=str(common.RUNS / "layer.json"), help="the run record (default %(default)s)")
    p.add_argument("--markdown", help="replace this file's generated block by the table")
    p.add_argument("--report-only", metavar="RECORD", help="no run: the table of this run record")
    p.add_argument("--cell", help=argparse.SUPPRESS)   # internal: measure one cell in this process
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.shape = args.shape or (["quick"] if args.quick else list(DEFAULT_SHAPES[args.device.split(":")[0]]))
    args.dtype = args.dtype or ["fp32"]
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in NAMED_SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {', '.join(NAMED_SYSTEMS)}")
    args.hf = [f for f in (args.hf or "").split(",") if f]
    if [f for f in args.hf if f not in HF_FAMILIES] or (args.hf and args.n_rank):
        p.error(f"--hf {','.join(args.hf)}: families from {', '.join(HF_FAMILIES)}, without --n-rank")
    args.systems = hf_systems(args.hf) if args.hf else args.systems
    if args.n_rank:
        args.systems += [N_RANK_TWIN[s] for s in list(args.systems) if s in N_RANK_TWIN]
    args.systems = list(dict.fromkeys(args.systems))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.cell:
        cell = measure_cell(args.shape[0], args.dtype[0], args.device, args.reps, args.warmup, args.systems,
                            args.profile)
        Path(args.cell).write_text(json.dumps(cell))
        return 0
    record = json.loads(Path(args.report_only).read_text()) if args.report_only else run(args)
    return common.publish(MODULE + " --hf" * bool(record.get("hf")), record, markdown(record), args.json,
                          args.markdown, not args.report_only)


if __name__ == "__main__":
    sys.exit(main())
