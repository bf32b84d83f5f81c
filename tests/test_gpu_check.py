"""`make gpu-check` (issue 15): its CPU-side dry run checks the script itself in CI, and the Makefile has the target."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and len(report["cpu_losses"]) == 2 and len(report["steps"]) == 6


def test_make_gpu_check_target():
    makefile = (ROOT / "Makefile").read_text()
    assert "gpu-check:" in makefile and "benchmarks/gpu_check.py" in makefile and ".[gpu]" in makefile
