"""``ds-hecate`` command line."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from ..deepspeed_glue.consolidate import consolidated_state_dict

    state = consolidated_state_dict(args.checkpoint_dir, args.tag, args.layout)
    torch.save(state, args.output)
    experts = sum(1 for k in state if ".experts." in k)
    print(f"wrote {len(state)} tensors ({experts} expert tensors, "
          f"{sum(v.numel() for v in state.values()):,} parameters, fp32) to {args.output}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import report

    written = report(args.run_dir, args.output_dir)
    print(f"wrote {len(written)} plot(s):")
    for path in written:
        print(f"  {path}")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from .export_hf import export_hf

    counts = export_hf(args.checkpoint_dir, args.output, args.model_config, args.tag, args.dtype)
    print(f"wrote an HF checkpoint ({counts['tensors']} tensors, {counts['parameters']:,} parameters of which "
          f"{counts['expert_parameters']:,} in experts, {args.dtype}) to {args.output}")
    return 0


def _models(args: argparse.Namespace) -> int:
    from .models import model_rows, models_markdown

    print(models_markdown(model_rows()))
    return 0


def _check(args: argparse.Namespace) -> int:
    """One line per tag (complete, legacy, incomplete or damaged, with what is wrong); exit 1 when any checked tag
    cannot be loaded."""
    from ..deepspeed_glue.checkpoint_status import hecate_tags, latest_tag, tag_status

    tags = [args.tag] if args.tag else hecate_tags(args.save_dir)
    if not tags:
        print(f"{args.save_dir}: no tag with Hecate state (no <tag>/hecate folder)")
        return 1
    latest = latest_tag(args.save_dir)
    bad = 0
    for tag in tags:
        status = tag_status(args.save_dir, tag, verify=not args.no_verify)
        bad += not status.loadable
        note = f", {status.verified_files} expert file(s) verified" if status.verified_files else ""
        print(f"{tag}{' (latest)' if tag == latest else ''}: {status.state}{note}")
        for problem in status.problems:
            print(f"  - {problem}")
        if status.leftovers:
            print(f"  - temporary files of an interrupted save (removed by the next completed save of this tag): "
                  f"{', '.join(status.leftovers)}")
    return 1 if bad else 0


def main(argv: Optional[List[str]] = None) -> int:
    from .. import cli_args as types

    parser = argparse.ArgumentParser(prog="ds-hecate", description="ds_hecate tools")
    sub = parser.add_subparsers(dest="command", required=True)
    consolidate = sub.add_parser("consolidate", help="one fp32 state dict (dense + every expert) from a checkpoint")
    consolidate.add_argument("checkpoint_dir", type=types.existing_dir("checkpoint"),
                             help="the save_dir given to engine.save_checkpoint")
    consolidate.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    consolidate.add_argument("--layout", choices=("hecate", "deepspeed", "hf"), default=None,
                             help="parameter names of ds_hecate.MoE, of deepspeed.moe.layer.MoE, or of a Hugging Face "
                                  "experts module in its own layout (default: hf for a checkpoint of a Hugging Face "
                                  "model, else hecate)")
    consolidate.add_argument("--output", "-o", required=True, type=types.writable_path, help="output file (torch.save)")
    consolidate.set_defaults(run=_consolidate, parser=consolidate)
    report = sub.add_parser("report", help="PNG plots (expert load, per-rank compute, replicas, communication) "
                                           "from a run's trace and CSV monitor files")
    report.add_argument("run_dir", type=types.existing_dir("run"),
                        help="directory holding the trace (hecate.trace_file) and/or DeepSpeed's csv_monitor "
                             "output, e.g. the example's --monitor-dir")
    report.add_argument("--output-dir", "-o", default=None, type=types.new_directory,
                        help="where the PNGs go (default: RUN_DIR/report)")
    report.set_defaults(run=_report, parser=report)
    export_hf = sub.add_parser("export-hf", help="a Hugging Face checkpoint directory (safetensors, every expert) "
                                                 "from a Hecate checkpoint of an HF MoE model")
    export_hf.add_argument("checkpoint_dir", type=types.existing_dir("checkpoint"),
                           help="the save_dir given to engine.save_checkpoint (for the HF Trainer: "
                                "OUTPUT_DIR/checkpoint-N)")
    export_hf.add_argument("--model-config", default=None, type=types.file_or_dir("model config"),
                           help="HF config.json, or its directory (default: CHECKPOINT_DIR/config.json)")
    export_hf.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    export_hf.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weights dtype")
    export_hf.add_argument("--output", "-o", required=True, type=types.new_directory,
                           help="output directory (from_pretrained loads it)")
    export_hf.set_defaults(run=_export_hf, parser=export_hf)
    check = sub.add_parser("check", help="which checkpoint tags are complete, incomplete (a save that did not finish) "
                                         "or damaged; verifies every expert file's digest")
    check.add_argument("save_dir", type=types.existing_dir("save"),
                       help="the save_dir given to engine.save_checkpoint")
    check.add_argument("--tag", default=None, help="check this tag only (default: every tag with Hecate state)")
    check.add_argument("--no-verify", action="store_true", help="skip reading the expert files (marks and sizes only)")
    check.set_defaults(run=_check, parser=check)
    models = sub.add_parser("models", help="every experts class of the installed transformers' experts interface, "
                                           "its layout and whether Hecate takes it over (a Markdown table)")
    models.set_defaults(run=_models, parser=models)
    from ..sim.cli import add_parsers as add_sim_parsers
    add_sim_parsers(sub)   # simulate, plan
    from ..errors import HecateError
    try:   # argparse ends a bad command line with SystemExit(2): returned as main's status, as a run's is
        args = parser.parse_args(argv)
        try:
            return args.run(args)
        except HecateError as exc:   # what only the work itself finds out (file contents, combinations): in
            command: argparse.ArgumentParser = args.parser
            command.error(str(exc))   # argparse's form too, from the command's parser (usage line, status 2)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


if __name__ == "__main__":
    sys.exit(main())
