"""``ds-hecate`` command line."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from .consolidate import consolidated_state_dict

    state = consolidated_state_dict(args.checkpoint_dir, args.tag, args.layout)
    torch.save(state, args.output)
    experts = sum(1 for k in state if ".experts." in k)
    print(f"wrote {len(state)} tensors ({experts} expert tensors, "
          f"{sum(v.numel() for v in state.values()):,} parameters, fp32) to {args.output}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-hecate", description="ds_hecate tools")
    sub = parser.add_subparsers(dest="command", required=True)
    consolidate = sub.add_parser("consolidate", help="one fp32 state dict (dense + every expert) from a checkpoint")
    consolidate.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint")
    consolidate.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    consolidate.add_argument("--layout", choices=("hecate", "deepspeed"), default="hecate",
                             help="parameter names of ds_hecate.MoE (default) or deepspeed.moe.layer.MoE")
    consolidate.add_argument("--output", "-o", required=True, help="output file (torch.save)")
    consolidate.set_defaults(run=_consolidate)
    args = parser.parse_args(argv)
    from .errors import HecateError
    try:
        return args.run(args)
    except HecateError as exc:
        print(f"ds-hecate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
