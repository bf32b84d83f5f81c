"""`make gpu-check` (issues 24 and 53): its CPU dry run runs every stage's code under the GPU stand-in in CI, once per
module (each test below reads its report); a stage that times out or crashes fails the check and leaves the JSON of
the stages before it, and the Markdown names it and why in one line; the stages' budgets leave a minute of the
Makefile's limit; the layer-call stage reads the layer-call benchmark's figures; the Makefile runs the check on a GPU
machine as it is (no install of torch, CuPy or the requirements) and `make gpu-wheels` builds what that machine
lacks. Cost: one dry run of the check (about 2 minutes on 2 cores), the rest seconds."""
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import runner  # noqa: E402
from benchmarks.gpu.common import Context  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of the whole check, as CI runs it: (its JSON report, its Markdown, what it printed)."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    out, md = tmp / "gpu_check.json", tmp / "gpu_check.md"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out), "--markdown",
                           str(md)], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), md.read_text(), proc.stdout


def test_gpu_check_dry_run(dry_run):
    report, table, printed = dry_run
    assert report["dry_run"] is True and report["ok"] is True and "stand-in" in report["note"]
    assert list(report["stages"]) == [s.name for s in runner.STAGES]
    for name, stage in report["stages"].items():
        assert stage["status"] == "passed", (name, stage)
        assert stage["seconds"] <= stage["timeout_s"] and stage["summary"]
    stages = report["stages"]
    assert stages["streams"]["watchdog"]["aborted"] and stages["nccl_round_trips"]["cupy"]
    assert {r["mode"] for r in stages["layer_call"]["records"]} == {"grouped", "loop"}
    assert isinstance(stages["layer_versus"]["targets_met"], bool)
    assert stages["device"]["cupy_usable"] and stages["tests"]["counts"]["passed"] > 100
    assert not stages["tests"]["skipped"], "tests/gpu must run under the stand-in, not skip"
    assert table.startswith("make gpu-check: dry run on the CPU")
    assert "| stage | status | seconds | timeout s | key figures |" in table and "| **all** | **passed** |" in table
    for name in report["stages"]:
        assert f"| {name} | passed |" in table
    assert "Kernel micro-benchmarks" in table and "Layer call, 1 rank" in table and "Layer call side by side" in table
    assert table in printed, "the Markdown table is printed at the end"


def test_stage_budgets_leave_a_minute_of_the_make_limit():
    """The stages' timeouts sum at most a minute under the Makefile's limit (they once summed to 535 of its 540 s,
    leaving nothing for the interpreter's start and the wheelhouse)."""
    total = sum(s.timeout_s for s in runner.STAGES)
    assert total <= runner.BUDGET_S == runner.MAKE_TIMEOUT_S - 60, total
    recipe = _recipe((ROOT / "Makefile").read_text(), "gpu-check")
    assert f"timeout {runner.MAKE_TIMEOUT_S} " in recipe


def test_training_stages_hold_the_kernels_to_what_each_dtype_runs(dry_run):
    """fp32: the combine through the kernel and nothing packed (the masters are the resident weights: the check once
    demanded packs there and would have failed on every GPU); bf16: the resident refresh after each optimizer step
    packs through the kernel, the kernel runs follow the torch-ops run, and the resident rows equal their masters.
    The dry run runs these checks too (the kernels under the stand-in), where it once skipped them."""
    from benchmarks.gpu.training import kernel_use_problems
    stages = dry_run[0]["stages"]
    for name in ("cuda_torch", "cuda_cupy"):
        assert stages["training"][name]["kernel_use"] == {"combine": stages["training"]["steps"]}
        bf16 = stages["training_bf16"][name]
        assert bf16["kernel_use"]["pack"] >= stages["training_bf16"]["steps"] and bf16["kernel_use"]["combine"] > 0
        assert bf16["resident_error"] == 0.0
    assert stages["training"]["cuda_torch_ops"]["kernel_use"] == {} and not stages["training"]["problems"]
    ok = {"cuda_torch": {"kernel_use": {"combine": 2}}, "cuda_torch_ops": {"kernel_use": {}}}
    assert kernel_use_problems(ok, "fp32") == []
    assert kernel_use_problems({"cuda_torch": {"kernel_use": {"combine": 2, "pack": 2}}}, "fp32")
    assert kernel_use_problems(ok, "bf16") == ["cuda_torch: the resident refresh did not pack through the kernel "
                                               "({'combine': 2})"]
    assert kernel_use_problems({"cuda_torch_ops": {"kernel_use": {"pack": 1}}}, "bf16")


def test_the_stages_plan_without_timing():
    """Every cost the scheduler reads is configured in the stages' runtime, so a measured figure (the runtime still
    measures them at steps 1 and 4) changes no placement: the CPU and the CUDA run of a stage place alike. The
    replica overhead was once left to its measurement."""
    import torch
    import torch.distributed as dist

    from benchmarks.gpu.training import build_model, hecate_runtime
    from ds_hecate.comm.backend import build_communicator
    comm = build_communicator("torch", None, 0, 1, torch.device("cpu"))
    rt, _ = hecate_runtime(build_model(), comm, torch.device("cpu"), 1)
    binding = rt.bindings[0]
    configured = rt.step_costs(binding)
    rt.measured = {"compute_s_per_pair": 3e-3, "link_gbps": 0.01, "non_moe_time_s": 2.0, "replica_overhead_s": 5.0,
                   "inter_node_gbps": 0.5}
    assert rt.step_costs(binding) == configured
    assert not dist.is_initialized()
def test_syncs_stage_names_host_reads_in_a_layer_call_and_in_backward(monkeypatch):
    """A host read inside a layer call beyond the counts' and one in backward fail the stage, which names the lines
    that made them (under the stand-in here; on CUDA the sync debug mode also sees those inside an op)."""
    from benchmarks.gpu import syncs
    built = syncs.build_model

    def reading(*args):
        model = built(*args)
        model["block0"]["moe"].register_forward_hook(lambda m, a, out: (out[0].sum().item(), None)[1], prepend=True)
        model["block1"]["inp"].register_forward_hook(   # in backward: a hook on the output's gradient
            lambda m, a, out: (out.register_hook(lambda grad: (grad.sum().item(), None)[1]), None)[1])
        return model
    ctx = Context(dry_run=True)
    with ctx.stand_in() as stand_in:
        clean = syncs.run_one(ctx, stand_in, "bf16-biased", "biased", "bf16", "shortcuts")
        monkeypatch.setattr(syncs, "build_model", reading)
        dirty = syncs.run_one(ctx, stand_in, "bf16-biased", "biased", "bf16", "shortcuts")
    steps = syncs.sizes(ctx)[-1]
    assert clean["ok"] and clean["per_call"] == [1] * 2 * steps and clean["backward"] == 0
    assert not dirty["ok"] and dirty["per_call"] == [2, 1] * steps and dirty["backward"] == steps
    here = f"tests/{Path(__file__).name}"
    assert {site.split(":")[0] for site in dirty["unexpected_sites"]} == {here}, dirty["unexpected_sites"]
    text = syncs._describe(dirty)
    assert text.startswith("bf16-biased/shortcuts: 2 syncs in a layer call (1 allowed); 2 in backward at tests/")


def test_training_stage_routes_without_drawing_random_numbers():
    """CPU and CUDA draw different random numbers, so the training comparison's gate must draw none (DeepSpeed's
    top-2 gate samples its second expert with Gumbel noise by default): the same input routes the same under any
    generator state."""
    import torch

    from benchmarks.gpu.training import HIDDEN, build_model
    gate = build_model()["moe"].gate
    x = torch.randn(512, HIDDEN, generator=torch.Generator().manual_seed(3))
    routes = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        routes.append([t.detach() for t in gate(x)[1:3]])   # combine weights, dispatch mask
    assert all(torch.equal(a, b) for a, b in zip(*routes))


def test_two_rank_training_stage_dry_run(dry_run):
    """Two spawned ranks over gloo train two MoE layers on the CPU and under the GPU stand-in, on the N-rank path
    (tokens sent to the other rank, replicas gathered); every step's loss and the final weights (experts and dense)
    of each rank agree within the tolerance."""
    res = dry_run[0]["stages"]["two_rank_training"]
    assert res["world"] == 2 and res["backend"] == "gloo" and set(res["ranks"]) == {"0", "1"}
    assert len(res["max_rel_diff_per_step"]) == res["steps"] == 3
    assert res["max_rel_diff"] <= res["tolerance"] == 1e-4 and res["weights_max_rel_diff"] <= 1e-4
    for fig in res["ranks"].values():
        assert fig["weights_compared"] >= 4 and fig["first_step_routing_differs"] is None
        assert len(fig["cuda_losses"]) == 3 and fig["cpu_seconds"] > 0 and fig["cuda_seconds"] > 0
        assert fig["sent_tokens"] and fig["comm"]["calls"]["alltoall"] > 0
    # the experts are placed across the ranks: each owns some of every layer, not all; replicas travel
    owned = [[set(layer) for layer in fig["owned"]] for fig in res["ranks"].values()]
    assert all(o[0] and o[1] and o[0].isdisjoint(o[1]) for o in zip(*owned)), owned
    assert sum(fig["comm"]["bytes_allgather"] for fig in res["ranks"].values()) > 0
    assert res["wall_s"] > 0 and "2 ranks on 1 device over gloo, N-rank path" in res["summary"]


def test_two_rank_training_compare_fails_a_differing_run():
    import torch

    from benchmarks.gpu.two_rank_training import compare
    run = {"losses": [1.0, 0.5], "counts": [[3, 1], [2, 2]], "weights": {"w": torch.ones(4)}, "seconds": 1.0,
           "owned": [[0]], "kernel_use": {}, "comm": {"bytes_dispatch": 10, "bytes_allgather": 0}}
    assert compare(run, run)["ok"]
    assert not compare(run, {**run, "comm": {"bytes_dispatch": 0, "bytes_allgather": 0}})["ok"]
    assert not compare(run, {**run, "losses": [1.0, 0.5001]})["ok"]
    assert not compare(run, {**run, "weights": {"w": torch.tensor([1.0, 1.0, 1.0, 1.001])}})["ok"]
    assert not compare(run, {**run, "weights": {}})["ok"]
    assert compare(run, {**run, "counts": [[3, 1], [1, 3]]})["first_step_routing_differs"] == 2


def test_layer_versus_stage_dry_run(dry_run):
    """The side-by-side benchmark runs as the stage's subprocess; the ratio of ds_hecate over the plain layer is held
    against its target and reported (a missed speed target is a figure, not a failure)."""
    res = dry_run[0]["stages"]["layer_versus"]
    assert res["checked_system"] == "ds_hecate" and isinstance(res["targets_met"], bool) and not res["failures"]
    (shape,) = res["shapes"]
    assert shape["shape"] == "quick" and shape["target"] == 1.25 and shape["met"] == (shape["ratio"] <= 1.25)
    assert set(shape["systems"]) == {"plain", "ds_hecate"}
    assert shape["systems"]["plain"]["ratio"][0] == 1.0 and shape["systems"]["ds_hecate"]["agreement"] <= 1e-4
    rows = res["tables"][0]["rows"]
    assert [r[2] for r in rows] == ["plain", "ds_hecate"] and "<= 1.25" in rows[1][5]


def _versus_builds(rank, world):
    """(systems built, reasons of those not, drawings of the canonical weights) of the stage's systems on the quick
    shape, in a 1-rank gloo world."""
    import torch
    import torch.distributed as dist

    from benchmarks import systems
    from benchmarks.gpu import versus
    from benchmarks.layer_versus import SHAPES, build_systems
    from benchmarks.versus_systems import routed_inputs
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shape = SHAPES["quick"]
    inputs = routed_inputs(shape.hidden, shape.experts, shape.top_k, shape.tokens, torch.float32, torch.device("cpu"))
    built, skipped = build_systems(list(versus.SYSTEMS), shape, inputs, torch.float32, torch.device("cpu"))
    return sorted(built), skipped, systems._canonical_weights.cache_info().misses


def test_layer_versus_draws_the_weights_once_per_process():
    """The DeepSeek-V3-like layer's 1.4e9 weights are drawn on the host: the stage builds only the two systems its
    target needs, both from one drawing, with every core (it once drew them three times, for three systems, on one
    core, close to the stage's limit)."""
    from benchmarks.gpu import versus
    from dist_utils import run_ranks
    assert versus.SYSTEMS == ("plain", "ds_hecate")
    assert "--systems plain,ds_hecate" in " ".join(versus.command(Context(), "deepseek-v3", Path("x.json")))
    assert versus.environment(Context())["OMP_NUM_THREADS"] == str(os.cpu_count())
    assert run_ranks(1, _versus_builds)[0] == (["ds_hecate", "plain"], {}, 1)


def test_nrank_path_cells_fit_an_80gb_h100():
    """``benchmarks.nrank_path --device cuda`` keeps six layers on the device at once: its CUDA shapes fit an 80 GB
    H100 (the DeepSeek-V3-like layer with all 32 of its experts held about 70 GB and ran out), and a cell that
    would not fit is refused before it builds, naming the sizes."""
    from types import SimpleNamespace

    import torch

    from benchmarks import nrank_path
    h100 = 80 * 10 ** 9
    for shape in nrank_path.DEFAULT_SHAPES["cuda"]:
        for dtype in ("fp32", "bf16"):
            assert nrank_path.cell_bytes(nrank_path.SHAPES[shape], dtype) <= nrank_path.DEVICE_SHARE * h100
    assert nrank_path.cell_bytes(nrank_path.SHAPES["deepseek-v3"], "bf16") > nrank_path.DEVICE_SHARE * h100
    props = SimpleNamespace(total_memory=h100)
    original = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: props
    try:
        with pytest.raises(SystemExit, match=r"deepseek-v3 bf16 cell holds about 7\d GiB on the device at once"):
            nrank_path.check_fits("deepseek-v3", "bf16", torch.device("cuda", 0))
        nrank_path.check_fits("deepseek-v3-ep16", "bf16", torch.device("cuda", 0))
    finally:
        torch.cuda.get_device_properties = original


def test_layer_versus_stage_targets_and_failures(tmp_path, monkeypatch):
    """On the GPU shapes a missed target leads the summary and leaves the stage passed; a system that computes
    something else, or did not run, fails it."""
    from benchmarks.gpu import versus

    def cell(shape, ratio, agreement=1e-3, hecate_status="ok"):
        sys_ = {"status": "ok", "median_s": 0.01, "ratio_vs_plain": [ratio, ratio, ratio],
                "agreement": {"out": agreement, "x_grad": 0.0}, "ops": {"top": 10}}
        hecate = sys_ if hecate_status == "ok" else {"status": hecate_status, "reason": "no"}
        return {"shape": shape, "dtype": "bf16", "systems": {"plain": {**sys_, "ratio_vs_plain": [1.0] * 3,
                                                                        "agreement": {"out": 0.0}},
                                                              "ds_hecate": hecate}}
    ctx = Context(timeout_s=60)
    assert versus.command(ctx, "deepseek-v3", tmp_path / "x.json")[3:7] == ["--device", "cuda", "--dtype", "bf16"]
    for cells, status, met, words in [
            ([cell("qwen3-30b-a3b", 1.2), cell("deepseek-v3", 1.05)], "passed", True, "met"),
            ([cell("qwen3-30b-a3b", 1.2), cell("deepseek-v3", 1.3)], "passed", False, "TARGET MISSED"),
            ([cell("qwen3-30b-a3b", 1.2, agreement=0.2), cell("deepseek-v3", 1.0)], "failed", True, "differs"),
            ([cell("qwen3-30b-a3b", 1.2, hecate_status="not run"), cell("deepseek-v3", 1.0)], "failed", None,
             "not run"),
            ([cell("qwen3-30b-a3b", 1.2)], "failed", None, "deepseek-v3: no cell")]:
        monkeypatch.setattr(versus, "measure", lambda ctx, cells=cells: (cells, []))
        res = versus.run(ctx)
        assert (res["status"], res["targets_met"]) == (status, met) and words in res["summary"], res["summary"]


_STAGES = '''
import atexit, os, time
def slow(ctx):
    time.sleep(60)
def crash(ctx):
    os._exit(3)
def boom(ctx):
    raise RuntimeError("boom")
def passed_then_crash(ctx):
    atexit.register(lambda: os._exit(5))
    return {"status": "passed", "summary": "looked fine"}
def probe(ctx):
    seen = {k: v["status"] for k, v in ctx.prior.get("stages", {}).items()}
    return {"status": "passed", "summary": f"saw {seen}", "seen": seen}
'''


def _check(tmp_path, stages):
    (tmp_path / "fake_stages.py").write_text(_STAGES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    out = tmp_path / "report.json"
    report = runner.run_check(stages, out, tmp_path / "report.md", env=env, log=lambda line: None)
    return report, json.loads(out.read_text())


def test_a_stage_that_times_out_fails_the_check(tmp_path):
    report, on_disk = _check(tmp_path, [runner.Stage("slow", "fake_stages:slow", 2, "sleeps"),
                                        runner.Stage("after", "fake_stages:probe", 30, "runs anyway")])
    assert report["stages"]["slow"]["status"] == "timeout" and report["ok"] is False
    assert report["stages"]["slow"]["seconds"] < 30, "the stage was not killed at its timeout"
    assert on_disk["stages"]["after"]["seen"] == {"slow": "timeout"}
    assert "| slow | timeout |" in (tmp_path / "report.md").read_text()


def test_the_json_is_written_after_a_stage_crash(tmp_path):
    report, on_disk = _check(tmp_path, [runner.Stage("crash", "fake_stages:crash", 30, "dies"),
                                        runner.Stage("boom", "fake_stages:boom", 30, "raises"),
                                        runner.Stage("late", "fake_stages:passed_then_crash", 30, "dies at exit"),
                                        runner.Stage("probe", "fake_stages:probe", 30, "reads the JSON")])
    stages = report["stages"]
    assert stages["crash"]["status"] == "crashed" and stages["crash"]["returncode"] == 3
    assert stages["boom"]["status"] == "failed" and "RuntimeError: boom" in stages["boom"]["summary"]
    assert stages["late"]["status"] == "crashed" and "exit code 5" in stages["late"]["summary"]
    # the probe stage read the JSON the runner wrote before it started: every earlier stage was in it
    assert stages["probe"]["seen"] == {"crash": "crashed", "boom": "failed", "late": "crashed"}
    assert on_disk["ok"] is False and report["ok"] is False


_LAYER_CALL = '''
import argparse, json
p = argparse.ArgumentParser()
p.add_argument("--shape", action="append"); p.add_argument("--device"); p.add_argument("--dtype")
p.add_argument("--repeat"); p.add_argument("--json")
a = p.parse_args()
rows = [{"shape": s, "mode": m, "fwd_bwd_s": 0.01 if m == "grouped" else 0.03, "expert_compute_s": 0.004,
         "expert_tflops": 316.0 if m == "grouped" else 100.0, "phases": {"compute": 0.005, "combine": 0.001},
         "ops": {"top": 100, "nested": 900}} for s in a.shape for m in ("grouped", "loop") if s != "deepseek-v3" or %s]
json.dump({"rows": rows, "argv": [a.device, a.dtype]}, open(a.json, "w"))
'''


@pytest.mark.parametrize("complete", [True, False])
def test_layer_call_stage_reports_tflops_against_the_peak(tmp_path, monkeypatch, complete):
    """The stage runs the layer-call benchmark (a stand-in here) per shape on CUDA in bf16 and reports the experts'
    TFLOP/s against the peak the device stage measured; a shape without figures fails the stage."""
    from benchmarks.gpu import layer
    (tmp_path / "fake_layer_call.py").write_text(_LAYER_CALL % complete)
    monkeypatch.setenv(layer.MODULE_ENV, "fake_layer_call")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    ctx = Context(prior={"stages": {"device": {"bf16_matmul_tflops": 632.0}}}, timeout_s=60)
    res = layer.run(ctx)
    assert res["status"] == ("passed" if complete else "failed"), res["summary"]
    grouped = [r for r in res["records"] if r["mode"] == "grouped"]
    assert grouped[0]["pct_of_peak_measured"] == pytest.approx(50.0)   # against the peak measured on this GPU
    assert grouped[0]["pct_of_peak_named"] == pytest.approx(40.0)      # against H200_BF16_TFLOPS_MEASURED_HERE
    assert "--device cuda" in " ".join(layer.command(ctx, "qwen3-30b-a3b", tmp_path / "x.json"))
    assert "--dtype bf16" in " ".join(layer.command(ctx, "qwen3-30b-a3b", tmp_path / "x.json"))
    rows = res["tables"][0]["rows"]
    assert ["qwen3-30b-a3b", "grouped", "10.00", "4.00", "316.0", "50", "100 (900 nested)"] == rows[0][:7]
    if not complete:
        assert "deepseek-v3" in res["summary"]


def test_tests_stage_names_the_failed_tests(monkeypatch):
    """A failing pytest run is reported with the tests that failed, even when its last lines are all warnings (the
    first GPU run's table said only "2 failed")."""
    from benchmarks.gpu import suite
    text = "\n".join([".F.F", "FAILED tests/gpu/test_gpu_comm.py::test_one - ValueError: no group",
                       "FAILED tests/gpu/test_gpu_comm.py::test_two - AssertionError"]
                      + ["  DeprecationWarning: ExternalStream is deprecated"] * 40
                      + ["2 failed, 119 passed, 2 skipped, 135 warnings in 46.13s"])
    monkeypatch.setattr(suite, "run_command", lambda cmd, timeout, env=None: (1, text))
    res = suite.run(Context(timeout_s=60))
    assert res["status"] == "failed"
    assert "test_gpu_comm.py::test_one" in res["summary"] and "test_gpu_comm.py::test_two" in res["summary"]
    assert res["failures"][1].endswith("AssertionError") and res["tail"][0].startswith("FAILED ")
    assert "-rfEs" in suite.pytest_args(Context())


def _wheel(path: Path, name: str, requires):
    with zipfile.ZipFile(path / f"{name}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-1.0.dist-info/METADATA", "Name: %s\n" % name
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_wheelhouse_names_every_dependency(tmp_path):
    """Every requirement of a wheel in the wheelhouse is in the wheelhouse or on the GPU machine (extras aside)."""
    from benchmarks.gpu import wheelhouse
    _wheel(tmp_path, "deepspeed", ["pydantic>=2.0.0", "torch>=2.0.0", "hjson", 'sphinx; extra == "dev"'])
    _wheel(tmp_path, "pydantic", ["pydantic-core==2.46.4", "annotated-types>=0.6.0"])
    _wheel(tmp_path, "pydantic_core", ["typing-extensions>=4.14.1"])
    wheels = sorted(tmp_path.glob("*.whl"))
    assert wheelhouse.check(wheels) == ["deepspeed-1.0-py3-none-any.whl needs hjson",
                                        "pydantic-1.0-py3-none-any.whl needs annotated-types"]
    assert set(wheelhouse.FETCHED) | set(wheelhouse.BUILT) >= {"deepspeed", "pydantic", "pydantic-core", "hjson",
                                                               "annotated-types", "typing-inspection"}


def _recipe(makefile: str, target: str) -> str:
    lines = makefile.split(f"\n{target}:", 1)[1].splitlines()[1:]
    recipe = []
    for line in lines:
        if not line.startswith("\t"):
            break
        recipe.append(line)
    return "\n".join(recipe)


def test_make_gpu_check_runs_on_the_machine_as_it_is():
    makefile = (ROOT / "Makefile").read_text()
    head = makefile.split("\ngpu-check:", 1)[1].splitlines()[0]
    assert head.strip() == "", f"gpu-check must not depend on an install target: {head!r}"
    recipe = _recipe(makefile, "gpu-check")
    assert "benchmarks/gpu_check.py" in recipe and "$(ARGS)" in recipe
    assert f"timeout {runner.MAKE_TIMEOUT_S} " in recipe
    installs = [line for line in recipe.splitlines() if "pip install" in line]
    assert installs and all("--no-index" in line and "--no-deps" in line and ".whl/" in makefile for line in installs)
    assert "torch" not in recipe and "cupy" not in recipe and "requirements" not in recipe
    assert "benchmarks.gpu.wheelhouse" in _recipe(makefile, "gpu-wheels")
    assert "make gpu-check ARGS=--dry-run" in (ROOT / ".ci" / "run").read_text()
    assert "/.whl/" in (ROOT / ".gitignore").read_text().splitlines()


def test_markdown_names_each_failed_stage_and_why_in_one_line(tmp_path):
    """The first failing stage does not stop the others, and under the table each failed one is named with why."""
    report, _ = _check(tmp_path, [runner.Stage("boom", "fake_stages:boom", 30, "raises"),
                                  runner.Stage("slow", "fake_stages:slow", 2, "sleeps"),
                                  runner.Stage("after", "fake_stages:probe", 30, "runs anyway")])
    lines = (tmp_path / "report.md").read_text().splitlines()
    failed = [line for line in lines if line.startswith("- **")]
    assert failed == ["- **boom failed**: RuntimeError: boom", "- **slow timeout**: timed out after 2 s (killed)"]
    assert report["stages"]["after"]["status"] == "passed"


def test_markdown_table_marks_stages_not_run():
    stages = [runner.Stage("a", "m", 5, "x"), runner.Stage("b", "m", 7, "y")]
    report = {"dry_run": False, "quick": True, "started": "now", "ok": False, "seconds": 1.0, "budget_s": 360,
              "stage_timeouts_s": 12, "stages": {"a": {"status": "failed", "seconds": 1.0, "summary": "x | y",
                                                       "device_name": "NVIDIA H200"}}}
    text = runner.render_markdown(report, stages)
    assert "| a | failed | 1.0 | 5 | x \\| y |" in text and "| b | not run |" in text
    assert "| **all** | **FAILED** |" in text and textwrap.dedent(text).startswith("make gpu-check: one ")
