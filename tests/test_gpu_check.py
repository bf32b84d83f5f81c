"""`make gpu-check` (issues 24 and 53): a CPU dry run of its measuring stages and of one test stage under the GPU
stand-in, once per module (the test stages' files run in this suite themselves, under tests/gpu; CI's `make gpu-check
ARGS=--dry-run` runs every stage); a stage that times out or crashes fails the check and leaves the JSON of the stages
before it, and the Markdown names it and why in one line; the stages' budgets leave a minute of the Makefile's limit;
the layer stage holds the layer benchmark's ratio to its targets; the Makefile runs the check on a GPU machine as it
is (no install of torch, CuPy or the requirements) and `make gpu-wheels` builds what that machine lacks. Cost: one
dry run of five stages (about a minute on 2 cores), the rest seconds."""
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any, cast

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import runner  # noqa: E402
from benchmarks.gpu.common import Context  # noqa: E402

#: the stages the suite's dry run takes: every measuring stage and one test stage (the test stages' files run in
#: the suite themselves)
DRY_STAGES = ("device", "streams", "memcheck", "micro", "layer")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of the whole check, as CI runs it: (its JSON report, its Markdown, what it printed)."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    out, md = tmp / "gpu_check.json", tmp / "gpu_check.md"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out), "--markdown",
                           str(md), "--stages", ",".join(DRY_STAGES)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), md.read_text(), proc.stdout


def test_gpu_check_dry_run(dry_run):
    report, table, printed = dry_run
    assert report["dry_run"] is True and report["ok"] is True and "stand-in" in report["note"]
    assert list(report["stages"]) == list(DRY_STAGES)
    for name, stage in report["stages"].items():
        assert stage["status"] == "passed", (name, stage)
        assert stage["seconds"] <= stage["timeout_s"] and stage["summary"]
    stages = report["stages"]
    assert stages["device"]["cupy_usable"] and stages["streams"]["counts"]["passed"] == 2
    assert not stages["streams"]["skipped"], "tests/gpu must run under the stand-in, not skip"
    assert isinstance(stages["layer"]["targets_met"], bool)
    assert table.startswith("make gpu-check: dry run on the CPU")
    assert "| stage | status | seconds | timeout s | key figures |" in table and "| **all** | **passed** |" in table
    for name in report["stages"]:
        assert f"| {name} | passed |" in table
    assert "Kernel micro-benchmarks" in table and "Layer call (python -m benchmarks.layer)" in table
    assert table in printed, "the Markdown table is printed at the end"
    assert {s.name for s in runner.STAGES} >= set(DRY_STAGES) | {"tests", "training", "syncs", "two_rank_training"}
    for stage in runner.STAGES:   # every test stage names files that exist
        if stage.spec.startswith("pytest "):
            assert all((ROOT / path).is_file() for path in stage.spec.split()[1:]), stage


def test_stage_budgets_leave_a_minute_of_the_make_limit():
    """The stages' timeouts sum at most a minute under the Makefile's limit (they once summed to 535 of its 540 s,
    leaving nothing for the interpreter's start and the wheelhouse)."""
    total = sum(s.timeout_s for s in runner.STAGES)
    assert total <= runner.BUDGET_S == runner.MAKE_TIMEOUT_S - 60, total
    recipe = _recipe((ROOT / "Makefile").read_text(), "gpu-check")
    assert f"timeout {runner.MAKE_TIMEOUT_S} " in recipe


def test_kernel_use_is_held_to_what_each_dtype_runs():
    """fp32: the combine through the kernel and nothing packed (the masters are the resident weights: the check once
    demanded packs there and would have failed on every GPU); bf16: the resident refresh packs through the kernel."""
    from gpu_training import kernel_use_problems
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

    from gpu_training import build_model, hecate_runtime
    from ds_hecate.comm.backend import build_communicator
    comm = build_communicator("torch", None, 0, 1, torch.device("cpu"))
    rt, _ = hecate_runtime(build_model(), comm, torch.device("cpu"), 1)
    binding = rt.bindings[0]
    configured = rt.step_costs(binding)
    rt.measured = {"compute_s_per_pair": 3e-3, "link_gbps": 0.01, "non_moe_time_s": 2.0, "replica_overhead_s": 5.0,
                   "inter_node_gbps": 0.5}
    assert rt.step_costs(binding) == configured
    assert not dist.is_initialized()
def test_training_stage_routes_without_drawing_random_numbers():
    """CPU and CUDA draw different random numbers, so the training comparison's gate must draw none (DeepSpeed's
    top-2 gate samples its second expert with Gumbel noise by default): the same input routes the same under any
    generator state."""
    import torch

    from gpu_training import HIDDEN, build_model
    gate = cast(Any, build_model()["moe"]).gate   # ds_hecate.MoE's
    x = torch.randn(512, HIDDEN, generator=torch.Generator().manual_seed(3))
    routes = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        routes.append([t.detach() for t in gate(x)[1:3]])   # combine weights, dispatch mask
    assert all(torch.equal(a, b) for a, b in zip(*routes))


def test_layer_stage_targets_and_failures(tmp_path, monkeypatch):
    """On the GPU shapes a missed target leads the summary and leaves the stage passed; a system that computes
    something else, or did not run, fails it; the benchmark runs on CUDA in bf16 on the two systems the targets
    need, with every core for drawing the weights."""
    from benchmarks.gpu import layer

    def cell(shape, ratio, agreement=1e-3, hecate_status="ok"):
        sys_ = {"status": "ok", "median_s": 0.01, "ratio_vs_plain": [ratio, ratio, ratio],
                "agreement": {"out": agreement, "x_grad": 0.0}, "ops": {"top": 10}}
        hecate = sys_ if hecate_status == "ok" else {"status": hecate_status, "reason": "no"}
        return {"shape": shape, "dtype": "bf16", "systems": {"plain": {**sys_, "ratio_vs_plain": [1.0] * 3,
                                                                        "agreement": {"out": 0.0}},
                                                              "ds_hecate": hecate}}
    ctx = Context(timeout_s=60)
    cmd = " ".join(layer.command(ctx, "deepseek-v3", tmp_path / "x.json"))
    assert "-m benchmarks.layer --device cuda --dtype bf16 --shape deepseek-v3" in cmd
    assert "--systems plain,ds_hecate" in cmd
    for cells, status, met, words in [
            ([cell("qwen3-30b-a3b", 1.2), cell("deepseek-v3", 1.05)], "passed", True, "met"),
            ([cell("qwen3-30b-a3b", 1.2), cell("deepseek-v3", 1.3)], "passed", False, "TARGET MISSED"),
            ([cell("qwen3-30b-a3b", 1.2, agreement=0.2), cell("deepseek-v3", 1.0)], "failed", True, "differs"),
            ([cell("qwen3-30b-a3b", 1.2, hecate_status="not run"), cell("deepseek-v3", 1.0)], "failed", None,
             "not run"),
            ([cell("qwen3-30b-a3b", 1.2)], "failed", None, "deepseek-v3: no cell")]:
        monkeypatch.setattr(layer, "measure", lambda ctx, cells=cells: (cells, []))
        res = layer.run(ctx)
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
    report, on_disk = _check(tmp_path, [runner.Stage("slow", "fake_stages:slow", 2),
                                        runner.Stage("after", "fake_stages:probe", 30)])
    assert report["stages"]["slow"]["status"] == "timeout" and report["ok"] is False
    assert report["stages"]["slow"]["seconds"] < 30, "the stage was not killed at its timeout"
    assert on_disk["stages"]["after"]["seen"] == {"slow": "timeout"}
    assert "| slow | timeout |" in (tmp_path / "report.md").read_text()


def test_the_json_is_written_after_a_stage_crash(tmp_path):
    report, on_disk = _check(tmp_path, [runner.Stage("crash", "fake_stages:crash", 30),
                                        runner.Stage("boom", "fake_stages:boom", 30),
                                        runner.Stage("late", "fake_stages:passed_then_crash", 30),
                                        runner.Stage("probe", "fake_stages:probe", 30)])
    stages = report["stages"]
    assert stages["crash"]["status"] == "crashed" and stages["crash"]["returncode"] == 3
    assert stages["boom"]["status"] == "failed" and "RuntimeError: boom" in stages["boom"]["summary"]
    assert stages["late"]["status"] == "crashed" and "exit code 5" in stages["late"]["summary"]
    # the probe stage read the JSON the runner wrote before it started: every earlier stage was in it
    assert stages["probe"]["seen"] == {"crash": "crashed", "boom": "failed", "late": "crashed"}
    assert on_disk["ok"] is False and report["ok"] is False


def test_tests_stage_names_the_failed_tests(monkeypatch):
    """A failing pytest run is reported with the tests that failed, even when its last lines are all warnings (the
    first GPU run's table said only "2 failed")."""
    from benchmarks.gpu import suite
    text = "\n".join([".F.F", "FAILED tests/gpu/test_gpu_comm.py::test_one - ValueError: no group",
                       "FAILED tests/gpu/test_gpu_comm.py::test_two - AssertionError"]
                      + ["  DeprecationWarning: ExternalStream is deprecated"] * 40
                      + ["2 failed, 119 passed, 2 skipped, 135 warnings in 46.13s"])
    monkeypatch.setattr(suite, "run_command", lambda cmd, timeout, env=None: (1, text))
    res = suite.run(Context(timeout_s=60), ["tests/gpu/test_gpu_comm.py"])
    assert res["status"] == "failed"
    assert "test_gpu_comm.py::test_one" in res["summary"] and "test_gpu_comm.py::test_two" in res["summary"]
    assert res["failures"][1].endswith("AssertionError") and res["tail"][0].startswith("FAILED ")
    assert "-rfEs" in suite.pytest_args(Context(), ["tests/gpu"])


def _wheel(path: Path, name: str, requires):
    with zipfile.ZipFile(path / f"{name}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-1.0.dist-info/METADATA", "Name: %s\n" % name
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_wheelhouse_names_every_dependency(tmp_path):
    """Every requirement of a wheel in the wheelhouse is in the wheelhouse or on the GPU machine (extras aside)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_wheels as wheelhouse  # type: ignore[import-not-found]  # tools/, put on sys.path above
    _wheel(tmp_path, "deepspeed", ["pydantic>=2.0.0", "torch>=2.0.0", "hjson", 'sphinx; extra == "dev"'])
    _wheel(tmp_path, "pydantic", ["pydantic-core==2.46.4", "annotated-types>=0.6.0"])
    _wheel(tmp_path, "pydantic_core", ["typing-extensions>=4.14.1"])
    # a requirement whose marker does not hold on the target (Python 3.12 on Linux) is not needed there
    _wheel(tmp_path, "kernels", ['tomli; python_version < "3.11"', 'colorama; platform_system == "Windows"',
                                 'huggingface-hub>=0.26; python_version >= "3.9"'])
    wheels = sorted(tmp_path.glob("*.whl"))
    assert wheelhouse.check(wheels) == ["deepspeed-1.0-py3-none-any.whl needs hjson",
                                        "kernels-1.0-py3-none-any.whl needs huggingface-hub",
                                        "pydantic-1.0-py3-none-any.whl needs annotated-types"]
    assert set(wheelhouse.FETCHED) | set(wheelhouse.BUILT) >= {"deepspeed", "pydantic", "pydantic-core", "hjson",
                                                               "annotated-types", "typing-inspection",
                                                               "transformers", "kernels", "huggingface-hub"}


def _recipe(makefile: str, target: str) -> str:
    lines = makefile.split(f"\n{target}:", 1)[1].splitlines()[1:]
    recipe = []
    for line in lines:
        if not line.startswith("\t"):
            break
        recipe.append(line)
    return "\n".join(recipe)


def test_make_gpu_check_runs_on_the_machine_as_it_is():
    """gpu-check and gpu-fit take the machine as it is: no install target before them, only the wheelhouse (gpu-site)
    installed where DeepSpeed or AutoEP's transformers is missing, never torch, CuPy or the requirements."""
    makefile = (ROOT / "Makefile").read_text()
    for target in ("gpu-site", "gpu-check", "gpu-fit"):
        head = makefile.split(f"\n{target}:", 1)[1].splitlines()[0]
        assert head.strip() == "", f"{target} must not depend on an install target: {head!r}"
        recipe = _recipe(makefile, target)
        assert "torch" not in recipe and "cupy" not in recipe and "requirements" not in recipe, target
        installs = [line for line in recipe.splitlines() if "pip install" in line]
        assert all("--no-index" in line and "--no-deps" in line for line in installs), target
        assert bool(installs) == (target == "gpu-site"), target
    site = _recipe(makefile, "gpu-site")
    assert "import deepspeed, pydantic, transformers" in site and ".whl/*.whl" in site
    recipe = _recipe(makefile, "gpu-check")
    assert "$(MAKE) --no-print-directory gpu-site" in recipe
    assert "benchmarks/gpu_check.py" in recipe and "$(ARGS)" in recipe
    assert f"timeout {runner.MAKE_TIMEOUT_S} " in recipe
    assert "tools/gpu_wheels.py" in _recipe(makefile, "gpu-wheels")
    assert "make gpu-check ARGS=--dry-run" in (ROOT / ".ci" / "run").read_text()
    assert "/.whl/" in (ROOT / ".gitignore").read_text().splitlines()


def test_markdown_names_each_failed_stage_and_why_in_one_line(tmp_path):
    """The first failing stage does not stop the others, and under the table each failed one is named with why."""
    report, _ = _check(tmp_path, [runner.Stage("boom", "fake_stages:boom", 30),
                                  runner.Stage("slow", "fake_stages:slow", 2),
                                  runner.Stage("after", "fake_stages:probe", 30)])
    lines = (tmp_path / "report.md").read_text().splitlines()
    failed = [line for line in lines if line.startswith("- **")]
    assert failed == ["- **boom failed**: RuntimeError: boom", "- **slow timeout**: timed out after 2 s (killed)"]
    assert report["stages"]["after"]["status"] == "passed"


def test_a_file_with_the_checks_block_gets_the_block_replaced(tmp_path):
    """``--markdown docs/benchmarks.md``: the block between the check's markers is the new table, the rest stays."""
    from benchmarks import common
    begin, end = common.markers(runner.MODULE)
    doc = tmp_path / "report.md"
    doc.write_text(f"# Benchmarks\n{begin}\nold table\n{end}\nafter\n")
    _check(tmp_path, [runner.Stage("probe", "fake_stages:probe", 30)])
    text = doc.read_text()
    assert text.startswith(f"# Benchmarks\n{begin}") and text.endswith(f"{end}\nafter\n") and "old table" not in text
    assert "| probe | passed |" in text


def test_markdown_table_marks_stages_not_run():
    stages = [runner.Stage("a", "m", 5), runner.Stage("b", "m", 7)]
    report = {"dry_run": False, "quick": True, "started": "now", "ok": False, "seconds": 1.0, "budget_s": 360,
              "stage_timeouts_s": 12, "stages": {"a": {"status": "failed", "seconds": 1.0, "summary": "x | y",
                                                       "device_name": "NVIDIA H200"}}}
    text = runner.render_markdown(report, stages)
    assert "| a | failed | 1.0 | 5 | x \\| y |" in text and "| b | not run |" in text
    assert "| **all** | **FAILED** |" in text and textwrap.dedent(text).startswith("make gpu-check: one ")
