"""Does ds_hecate's GPU path work, and how fast are its kernels and its layer call? ``make gpu-check`` runs this:

    python benchmarks/gpu_check.py [--out runs/gpu_check.json] [--quick] [--dry-run] [--stages a,b]

The stages are :data:`benchmarks.gpu.runner.STAGES`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
