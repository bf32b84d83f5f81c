"""A Hugging Face Trainer script as users write them: imports transformers first, never imports ds_hecate.

Trains a tiny random Qwen3-MoE (no download) for a few steps. The DeepSpeed config comes from ``--deepspeed``
(``deepspeed`` launcher, as transformers' run_clm.py takes it) or from ``accelerate launch`` (the accelerate config
file's ``deepspeed_config_file``); either way it holds ``zero_optimization.hecate``, which only works when the
installed autoload hook made DeepSpeed Hecate-aware. Prints ``autoload trainer: ...`` for tests/test_autoload.py.
"""
from __future__ import annotations

import argparse

import torch
import transformers
from transformers import Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    """Random token ids, the same on every rank (no dataset or tokenizer download)."""

    def __init__(self, n: int, vocab: int, seq: int = 8) -> None:
        self.ids = torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed config; none under accelerate launch")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--output-dir", default="trainer_out")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fp16", action="store_true", help="the Trainer's fp16 switch (config: \"auto\")")
    parser.add_argument("--bf16", action="store_true", help="the Trainer's bf16 switch (config: \"auto\")")
    args = parser.parse_args()

    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=args.steps, per_device_train_batch_size=2,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, fp16=args.fp16,
        bf16=args.bf16)
    # head_dim: kept as an attribute, though the config's __init__ does not declare it
    config = transformers.Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=64, output_router_logits=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(4 * args.steps, config.vocab_size))
    trainer.train()
    if trainer.is_world_process_zero():
        hecate = hasattr(trainer.model_wrapped, "hecate")
        print(f"autoload trainer: engine.hecate={'yes' if hecate else 'no'} "
              f"steps={trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
