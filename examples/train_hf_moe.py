"""Hugging Face Trainer quickstart: a transformers MoE model trained with Hecate through DeepSpeed.

The only Hecate-specific lines are ``import ds_hecate`` and the ``hecate`` section of the DeepSpeed config:

    deepspeed --num_gpus 2 examples/train_hf_moe.py --deepspeed ds_configs/ds_hecate_hf.json
    deepspeed --num_gpus 2 examples/train_hf_moe.py --deepspeed ds_configs/ds_hecate_hf_zero3.json --model qwen3_moe

(``python -m ds_hecate.tools.launch`` in place of ``deepspeed``, the same arguments: also removes the job's CPU
all-reduce buffers from /dev/shm when it ends, a rank killed early included; docs/troubleshooting.md.)

By default it builds a tiny random model (no download); ``--model-name-or-path`` trains a real one.
"""
from __future__ import annotations

import argparse
import os

import torch
import transformers as tf

import ds_hecate  # noqa: F401 - makes deepspeed.initialize (called by the Trainer via accelerate) Hecate-aware
from ds_hecate.hf import num_parameters


def tiny_config(kind: str):
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, output_router_logits=True, tie_word_embeddings=False)
    if kind == "mixtral":
        return tf.MixtralConfig(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, **common)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, head_dim=8, **common)
    raise SystemExit(f"--model {kind}: choose mixtral or qwen3_moe (or pass --model-name-or-path)")


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int, seq: int = 32) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed", default="ds_configs/ds_hecate_hf.json", help="DeepSpeed config (JSON)")
    parser.add_argument("--model", default="mixtral", help="tiny random model: mixtral or qwen3_moe")
    parser.add_argument("--model-name-or-path", default=None, help="train this HF model instead")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default="hf_moe_out")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()

    on_cpu = not torch.cuda.is_available()
    training_args = tf.TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=args.steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=5, save_strategy="no", report_to=[],
        use_cpu=on_cpu, gradient_checkpointing=True)
    import deepspeed
    deepspeed.init_distributed()  # before building the model: ZeRO-3's zero.Init needs the real world size
    if args.model_name_or_path:
        model = tf.AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    else:
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(tiny_config(args.model))
    data = RandomTokens(4 * 2 * args.steps * int(os.environ.get("WORLD_SIZE", "1")), model.config.vocab_size)
    trainer = tf.Trainer(model=model, args=training_args, train_dataset=data)
    trainer.train()
    if trainer.is_world_process_zero():
        print(f"parameters (experts included): {num_parameters(trainer.model):,}")
    trainer.save_model(os.path.join(args.output_dir, "final"))  # on every rank: the experts are gathered
    if trainer.is_world_process_zero():
        print(f"saved a normal HF checkpoint to {os.path.join(args.output_dir, 'final')} "
              "(AutoModelForCausalLM.from_pretrained loads it, every expert included)")


if __name__ == "__main__":
    main()
