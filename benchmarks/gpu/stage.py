"""Run one stage of the GPU check in this process and write its result (JSON) to --out.

``python -m benchmarks.gpu.stage MODULE[:FUNCTION] --out FILE [--quick] [--dry-run] [--prior REPORT]``: FUNCTION
(default ``run``) of MODULE is called with a :class:`~benchmarks.gpu.common.Context` and returns the stage's result
dict. An exception is written as a failed result (with the end of its traceback) and exits 1; the runner
(:mod:`benchmarks.gpu.runner`) gives each stage its own process so a crash, a hang or a wrecked CUDA context
stays inside the stage.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.common import Context  # noqa: E402


def call(spec: str, ctx: Context) -> dict:
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function or "run")(ctx)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--prior", default=None, help="the report of the stages before this one (JSON)")
    parser.add_argument("--timeout", type=float, default=None, help="the stage's limit, in seconds")
    args = parser.parse_args(argv)
    prior = {}
    if args.prior and Path(args.prior).is_file():
        prior = json.loads(Path(args.prior).read_text())
    ctx = Context(quick=args.quick, dry_run=args.dry_run, prior=prior, timeout_s=args.timeout)
    try:
        out = call(args.spec, ctx)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a result the runner reports
        lines = traceback.format_exc().strip().splitlines()
        out = {"status": "failed", "summary": f"{type(exc).__name__}: {str(exc)[:200]}", "traceback": lines[-25:]}
        code = 1
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
