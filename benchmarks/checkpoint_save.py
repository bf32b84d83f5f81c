"""What a checkpoint save costs, and what the expert files' digests add to it (issue 44).

One rank (a 1-rank gloo world), a model of ``--layers`` ``ds_hecate.MoE`` layers of ``--experts`` SwiGLU experts
(``hidden -> ffn -> hidden``), one training step with Adam (so every expert file holds its master and both moments),
then ``--repeats`` calls of ``engine.save_checkpoint`` into the same tag, each timed as a whole (DeepSpeed's files,
Hecate's expert files, their digests, the completion mark and ``latest``). Prints the median, minimum and maximum
seconds and the bytes written per save. Run it on two checkouts (``PYTHONPATH=<checkout>``) to compare; the page
cache and the disk are the host's, so compare medians from the same host and the same moment.

    python -m benchmarks.checkpoint_save --dir /tmp/ckpt_bench --json /tmp/save.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time


def _train_one_step(args):
    import deepspeed
    import torch
    from torch import nn

    import ds_hecate

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                ds_hecate.MoE(args.hidden, ds_hecate.SwiGLUExpert(args.hidden, args.ffn), num_experts=args.experts,
                              k=2, drop_tokens=False, min_capacity=0) for _ in range(args.layers))

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)[0]
            return x.pow(2).mean()

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-4,
                                                                                            "torch_adam": True}},
              "zero_optimization": {"stage": 2, "hecate": {"enabled": True, "log_conversion": False}}}
    engine, *_ = deepspeed.initialize(model=Model(), model_parameters=None, config=config)
    loss = engine(torch.randn(64, args.hidden))
    engine.backward(loss)
    engine.step()
    return engine


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/ds_hecate_checkpoint_bench", help="save directory (emptied first)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    for bad in ("layers", "experts", "hidden", "ffn", "repeats"):
        if getattr(args, bad) <= 0:
            parser.error(f"--{bad} must be positive, got {getattr(args, bad)}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    engine = _train_one_step(args)
    shutil.rmtree(args.dir, ignore_errors=True)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.save_checkpoint(args.dir, tag="bench")
        times.append(time.perf_counter() - start)
    written = _bytes_under(os.path.join(args.dir, "bench"))
    result = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "times_s": times,
              "bytes_per_save": written, "layers": args.layers, "experts": args.experts}
    print(f"save_checkpoint: median {result['median_s']:.3f} s (min {result['min_s']:.3f}, max {result['max_s']:.3f})"
          f" over {args.repeats} saves of {written / 1e6:.0f} MB")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
