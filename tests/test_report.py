"""``ds-hecate report``: the demo run with monitoring on (deepspeed launcher, 2 CPU ranks) writes the metrics and
the trace, and the report turns them into PNGs that decode to real, non-blank images. A hand-made trace with many
ranks and layers exercises the large-job layouts (bands instead of per-rank lines, a subset of layers)."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port

from ds_hecate.tools.cli import main as cli_main
from ds_hecate.deepspeed_glue.monitor import LOAD_METRICS, TRAFFIC_METRICS
from ds_hecate.tools.report import MAX_LAYERS_SHOWN, ReportError, report
from ds_hecate.trace import TraceLayer, TraceWriter, read_trace

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5


def _assert_real_image(path: str, min_colours: int = 20) -> None:
    import matplotlib.image
    import numpy as np

    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert height >= 300 and width >= 600, (path, image.shape)
    pixels = (image[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours, counts = np.unique(pixels, axis=0, return_counts=True)
    assert len(colours) >= min_colours, (path, len(colours))
    assert counts.max() / len(pixels) < 0.9, (path, "mostly one colour")  # something is drawn, not a blank canvas


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           str(ROOT / "examples" / "train_gpt_moe.py"),
           "--deepspeed_config", str(ROOT / "ds_configs" / "ds_hecate.json"),
           "--steps", str(STEPS), "--monitor-dir", str(run_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "| imbalance " in output and "tokens/s" in output  # the progress line (no tty: plain lines)
    return run_dir


def test_demo_with_monitor_dir_writes_metrics_and_trace(demo_run):
    monitor = demo_run / "csv_monitor"
    for layer in range(2):
        for metric in LOAD_METRICS + TRAFFIC_METRICS:
            rows = (monitor / f"Hecate_layer{layer}_{metric}.csv").read_text().splitlines()
            assert rows[0] == f"step,{metric}" and len(rows) == STEPS + 1, rows
    trace = read_trace(str(demo_run / "trace.jsonl"))
    assert len(trace.records) == 2 * STEPS and trace.meta["owners"]


def test_report_on_the_demo_run_writes_readable_pngs(demo_run, tmp_path, capsys):
    out = tmp_path / "plots"
    assert cli_main(["report", str(demo_run), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    names = {"expert_load.png", "rank_compute.png", "replicas.png", "communication.png", "imbalance.png",
             "phase_time.png"}
    assert set(os.listdir(out)) == names
    for name in names:
        assert str(out / name) in printed
        _assert_real_image(str(out / name))


def test_report_of_a_large_job_trace(tmp_path):
    """64 experts on 16 ranks, 9 layers: bands instead of 16 lines, and 8 of the 9 layers."""
    rng = random.Random(0)
    world, experts, layers, steps = 16, 64, 9, 8
    owners = [[e * world // experts for e in range(experts)] for _ in range(layers)]
    path = tmp_path / "run" / "trace.jsonl"
    with TraceWriter(str(path), world, 2, [TraceLayer(f"layers.{i}.moe", experts) for i in range(layers)],
                     meta={"owners": owners, "ranks_per_node": 8}) as writer:
        for step in range(1, steps + 1):
            for layer in range(layers):
                hot = rng.sample(range(experts), 4)
                counts = [[rng.randint(0, 8) + (60 if e in hot else 0) for e in range(experts)] for _ in range(world)]
                materialized = [sorted({e for e in range(experts) if owners[layer][e] == r}
                                       | set(rng.sample(hot, rng.randint(0, 2)))) for r in range(world)]
                writer.write(step, layer, counts, materialized)
    written = report(str(tmp_path / "run"))
    assert sorted(os.path.basename(p) for p in written) == ["expert_load.png", "rank_compute.png", "replicas.png"]
    for png in written:
        assert os.path.dirname(png) == str(tmp_path / "run" / "report")
        _assert_real_image(png)
    assert MAX_LAYERS_SHOWN < layers


def test_report_without_inputs_says_what_to_enable(tmp_path, capsys):
    with pytest.raises(ReportError, match="found neither a ds_hecate trace"):
        report(str(tmp_path))
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    assert "argument run_dir: no run directory" in capsys.readouterr().err
