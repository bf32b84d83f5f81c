"""Train a small character-level GPT whose FFNs are DeepSpeed MoE layers.

The model deliberately uses DeepSpeed's own legacy ``deepspeed.moe.layer.MoE`` so the same
script serves as the baseline and, with ``import ds_hecate`` and the ``hecate`` ZeRO config,
as the ds_hecate run: only the DeepSpeed config changes between the two.

Launch as ``make demo`` does: DeepSpeed's launcher through ``ds_hecate.tools.launch``, which takes the arguments of
``deepspeed``, picks a free master port and removes the job's CPU all-reduce buffers from /dev/shm when it ends
(``deepspeed`` itself leaves them for a run without Hecate: docs/troubleshooting.md). DeepSpeed inserts
``--local_rank=N`` before the user arguments::

    OMP_NUM_THREADS=1 python -m ds_hecate.tools.launch --num_gpus 2 examples/train_gpt_moe.py \\
        --deepspeed_config ds_configs/ds_baseline.json --no-hecate-import
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.layer import MoE

from data import VOCAB_SIZE, get_batch


def parse_args() -> argparse.Namespace:
    """CLI for the model/run shape plus DeepSpeed's own ``--deepspeed``/``--deepspeed_config``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)),
                        help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2, choices=(1, 2), help="legacy MoE supports k=1 or 2")
    parser.add_argument("--ffn", type=int, default=128, help="expert FFN inner size")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234, help="seeds the model init and the data stream")
    parser.add_argument("--aux-coef", type=float, default=0.01, help="weight of the summed MoE load-balancing loss")
    parser.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=True,
                        help="share the token embedding with the LM head")
    parser.add_argument("--log-every", type=int, default=1, help="print progress every N steps")
    parser.add_argument("--log-file", type=str, default=None,
                        help="rank 0 writes a JSON list of per-step {step, loss, grad_norm, tokens_per_s}")
    parser.add_argument("--stats-file", type=str, default=None,
                        help="rank 0 writes engine.hecate.stats() as JSON at the end (Hecate runs only)")
    parser.add_argument("--monitor-dir", type=str, default=None,
                        help="write DeepSpeed's CSV monitor (with Hecate's per-layer metrics) and Hecate's routing "
                        "trace (trace.jsonl) into this directory; plot them with `ds-hecate report DIR`")
    parser.add_argument("--hecate-import", action=argparse.BooleanOptionalAction,
                        default=os.environ.get("DS_HECATE_EXAMPLE_IMPORT", "1") != "0",
                        help="import ds_hecate before deepspeed.initialize so it can hook in "
                        "(default: on unless DS_HECATE_EXAMPLE_IMPORT=0)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.hidden % args.heads != 0:
        parser.error(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    if args.monitor_dir and not args.deepspeed_config:
        parser.error("--monitor-dir needs --deepspeed_config (a JSON file it adds the monitor and trace to)")
    return args


def import_hecate() -> None:
    """Import ds_hecate for its side effects; fail loudly, since a silent baseline run would mislead."""
    try:
        import ds_hecate  # noqa: F401  (imported for its DeepSpeed hooks)
    except ImportError as exc:
        print(f"error: --hecate-import was requested but `import ds_hecate` failed ({exc}). "
              "Install the package (e.g. `pip install -e .` in the repo root), or run with "
              "--no-hecate-import / DS_HECATE_EXAMPLE_IMPORT=0.",
              file=sys.stderr)
        sys.exit(2)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention; SDPA picks the fastest kernel available on the device."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LN transformer block whose FFN is a DeepSpeed MoE layer."""

    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        expert = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        self.moe = MoE(hidden, expert=expert, num_experts=experts, ep_size=1, k=top_k,
                       drop_tokens=False, use_rts=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        moe_out, l_aux, _ = self.moe(self.ln2(x))
        return x + moe_out, l_aux


class GPTMoE(nn.Module):
    """Character-level GPT; ``forward`` returns logits and the summed MoE auxiliary loss."""

    def __init__(self, vocab: int, seq_len: int, hidden: int, layers: int, heads: int, ffn: int, experts: int,
                 top_k: int, tie_embeddings: bool) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, experts, top_k) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        # Re-initialise everything: MoE deep-copies one expert, so experts would otherwise start identical.
        self.apply(self._init_weights)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2 style small init keeps the initial loss near ln(vocab) even with tied embeddings."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        return self.head(self.ln_f(x)), aux


def grad_norm_of(engine: deepspeed.DeepSpeedEngine) -> Optional[float]:
    """Global grad norm, or None when DeepSpeed has not computed one (e.g. skipped or disabled)."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    norm = float(norm)
    return norm if math.isfinite(norm) else None


def expert_imbalance(engine) -> Optional[tuple]:
    """Mean over MoE layers of max/mean per-rank expert load: (plain expert parallelism, Hecate's plan)."""
    if not hasattr(engine, "hecate"):
        return None
    layers = [layer for layer in engine.hecate.stats()["layers"] if "load_imbalance_after" in layer]
    if not layers:
        return None
    return (sum(layer["load_imbalance_before"] for layer in layers) / len(layers),
            sum(layer["load_imbalance_after"] for layer in layers) / len(layers))


def with_monitoring(config_path: str, monitor_dir: str) -> dict:
    """The DeepSpeed config from ``config_path`` plus a CSV monitor and, when it has a hecate section, a trace, both
    writing into ``monitor_dir``; everything else as the user wrote it."""
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["csv_monitor"] = {"enabled": True, "output_path": monitor_dir, "job_name": "csv_monitor"}
    zero = config.get("zero_optimization") or {}
    section = zero.get("hecate") if "hecate" in zero else config.get("hecate")
    if isinstance(section, dict):
        section["trace_file"] = os.path.join(monitor_dir, "trace.jsonl")
    return config


def main() -> None:
    args = parse_args()
    if args.hecate_import:
        import_hecate()

    # Under mpirun DeepSpeed discovers ranks through mpi4py; MASTER_PORT picks its rendezvous port there too.
    deepspeed.init_distributed(distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    rank, world = dist.get_rank(), dist.get_world_size()

    # Same seed on every rank before building the model, so all replicas start identical.
    torch.manual_seed(args.seed)
    model = GPTMoE(VOCAB_SIZE, args.seq_len, args.hidden, args.layers, args.heads, args.ffn, args.experts,
                   args.top_k, args.tie_embeddings)
    config = None
    if args.monitor_dir:
        config, args.deepspeed_config = with_monitoring(args.deepspeed_config, args.monitor_dir), None
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                           config=config)

    if rank == 0:
        # hasattr (not a config lookup) so the example reports what actually got attached; what Hecate took over
        # is ds_hecate's own "[ds_hecate] Hecate took over ..." line, logged once by initialize.
        hecate = "on" if hasattr(engine, "hecate") else "off"
        # With Hecate the experts are no longer module parameters; ds_hecate.num_parameters counts them too.
        n_params = (sys.modules["ds_hecate"].num_parameters(model) if hasattr(engine, "hecate")
                    else sum(p.numel() for p in model.parameters()))
        print(f"hecate: {hecate}")
        print(f"model: {n_params / 1e6:.3f}M params, vocab {VOCAB_SIZE}, world size {world}", flush=True)

    micro_bs = engine.train_micro_batch_size_per_gpu()
    grad_accum = engine.gradient_accumulation_steps()
    tokens_per_step = micro_bs * grad_accum * args.seq_len * world

    use_tqdm = False
    if rank == 0 and sys.stdout.isatty():
        try:
            from tqdm import tqdm
            use_tqdm = True
        except ImportError:
            pass
    bar = tqdm(total=args.steps, desc="train", file=sys.stdout) if use_tqdm else None

    history: list[dict[str, Optional[float]]] = []
    engine.train()
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        step_loss = torch.zeros((), device=engine.device)
        for micro in range(grad_accum):
            # One batch index per micro-batch keeps data identical whatever the accumulation split.
            x, y = get_batch((step - 1) * grad_accum + micro, rank, micro_bs, args.seq_len, args.seed)
            x, y = x.to(engine.device), y.to(engine.device)
            logits, aux = engine(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) + args.aux_coef * aux
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach() / grad_accum
        # Report the mean over ranks so the number is comparable across world sizes.
        dist.all_reduce(step_loss)
        get_accelerator().synchronize()
        dt = time.perf_counter() - t0

        record = {"step": step, "loss": step_loss.item() / world, "grad_norm": grad_norm_of(engine),
                  "tokens_per_s": tokens_per_step / dt, "imbalance": expert_imbalance(engine)}
        history.append(record)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            gn = "n/a" if record["grad_norm"] is None else f"{record['grad_norm']:.4f}"
            imb = "" if record["imbalance"] is None else " | imbalance {:.2f} -> {:.2f}".format(*record["imbalance"])
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.4f}", grad_norm=gn, tok_s=f"{record['tokens_per_s']:.0f}",
                                imbalance=imb.split(" ", 3)[-1] if imb else "n/a")
            else:
                print(f"step {step:>5d} | loss {record['loss']:.4f} | grad_norm {gn} | "
                      f"tokens/s {record['tokens_per_s']:.0f}{imb}", flush=True)
        if bar is not None:
            bar.update(1)
    wall = time.perf_counter() - t_start
    if bar is not None:
        bar.close()

    if rank == 0:
        # Step 1 includes one-off warm-up work, so it is left out of the throughput mean when possible.
        timed = history[1:] or history
        mean_tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
        print("==== summary ====")
        print(f"steps:        {args.steps}")
        print(f"first loss:   {history[0]['loss']:.4f}")
        print(f"last loss:    {history[-1]['loss']:.4f}")
        print(f"tokens/s:     {mean_tps:.0f} (mean over steps {timed[0]['step']}-{timed[-1]['step']})")
        print(f"wall time:    {wall:.2f} s")
        print(f"world size:   {world}", flush=True)
        if args.log_file:
            with open(args.log_file, "w", encoding="utf-8") as f:
                json.dump(history, f, indent=1)
        if args.stats_file and hasattr(engine, "hecate"):
            with open(args.stats_file, "w", encoding="utf-8") as f:
                json.dump(engine.hecate.stats(), f, indent=1)


if __name__ == "__main__":
    main()
    # Tear the process groups down before interpreter exit: left to finalizers, gloo's worker threads can outlive
    # them (seen as "terminate called without an active exception"). The engine is cyclic garbage once main()
    # returns; collect it first, so its tensors and work handles die while the interpreter and the groups are
    # alive rather than during finalization (torch's gloo threads then take the GIL of a dying interpreter and
    # abort). The barrier next, so that no rank tears its groups down while a peer still talks to it.
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
