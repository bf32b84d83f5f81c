"""HF Trainer runs for tests/test_hf.py: tiny random-initialized transformers MoE models, 2 CPU ranks.

One spawned job runs many Trainer runs in sequence (plain DeepSpeed and Hecate, several models and ZeRO stages)
to keep the process start-up cost (import of torch, transformers, deepspeed) to one per job.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, cast

import torch

VOCAB, SEQ = 64, 8


def tiny_config(kind: str, experts: int = 4):
    """Tiny random configs (no download); ``experts`` routed experts (4 by default), top-2, router logits on so the
    aux loss is in the loss."""
    import transformers as tf
    common: Dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, output_router_logits=True,
                  router_aux_loss_coef=0.02, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, initializer_range=0.3)  # large init: experts move the loss visibly
    if kind == "mixtral":
        return tf.MixtralConfig(intermediate_size=24, num_local_experts=experts, num_experts_per_tok=2, **common)
    if kind == "qwen3_moe":   # head_dim: kept as an attribute, though the config's __init__ does not declare it
        return tf.Qwen3MoeConfig(  # type: ignore[call-arg]
            intermediate_size=24, moe_intermediate_size=12, num_experts=experts, num_experts_per_tok=2,
            head_dim=8, decoder_sparse_step=1, norm_topk_prob=True, **common)
    if kind == "qwen2_moe":
        return tf.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                                 num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1, **common)
    if kind == "olmoe":
        return tf.OlmoeConfig(intermediate_size=12, num_experts=experts, num_experts_per_tok=2, **common)
    if kind == "deepseek_v3":
        c = dict(common)
        c.pop("output_router_logits")
        c.pop("router_aux_loss_coef")
        # Multi-head latent attention has one key/value head per query head: transformers 5.24 enforces it
        # (5.10 ignored a smaller num_key_value_heads).
        c["num_key_value_heads"] = c["num_attention_heads"]
        return tf.DeepseekV3Config(intermediate_size=24, moe_intermediate_size=12, n_routed_experts=experts,
                                   n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                                   first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                                   qk_nope_head_dim=4, v_head_dim=4, **c)
    if kind == "llama":  # no MoE block at all
        c = {k: v for k, v in common.items() if k not in ("output_router_logits", "router_aux_loss_coef")}
        return tf.LlamaConfig(intermediate_size=24, **c)
    raise ValueError(kind)


class TokenData(torch.utils.data.Dataset):
    """``n`` random sequences of token ids from ``[3, high)`` (the whole vocabulary by default)."""

    def __init__(self, n: int, seed: int = 123, high: int = VOCAB) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, high, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def zero_section(stage: int, hecate: bool, leaf_classes: Optional[List[str]] = None) -> Dict[str, Any]:
    """The ``zero_optimization`` section of the HF tests' configs: ZeRO-3 saves 16-bit weights (what
    ``save_pretrained`` needs), ``leaf_classes`` is ZeRO-3's ``leaf_module.classes`` (None: DeepSpeed's default
    list), ``hecate`` adds the key."""
    zero: Dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if leaf_classes is not None:
        zero["leaf_module"] = {"classes": list(leaf_classes)}
    if hecate:
        zero["hecate"] = {"enabled": True, "log_conversion": False}
    return zero


def ds_config(stage: int, hecate: bool, ds_optimizer: bool = True,
              leaf_classes: Optional[List[str]] = None) -> Dict[str, Any]:
    """A DeepSpeed config as HF users write it: "auto" everywhere the Trainer fills values in."""
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                           "gradient_clipping": "auto", "zero_optimization": zero_section(stage, hecate, leaf_classes),
                           "bf16": {"enabled": "auto"}}
    if ds_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                         "weight_decay": "auto", "torch_adam": True}}
    return cfg


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def trainer_run(case: Dict[str, Any], workdir: str) -> Dict[str, Any]:
    """One Trainer run; returns its loss/grad-norm log and, when asked, what the save checks need (rank 0)."""
    import deepspeed
    import transformers as tf

    import ds_hecate  # noqa: F401 - makes deepspeed.initialize Hecate-aware

    _reset_accelerate()
    kind, stage, hecate = case["model"], case["stage"], case["hecate"]
    out_dir = os.path.join(workdir, case["name"])
    args = tf.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=case.get("gas", 1),
        max_steps=case.get("steps", 10), learning_rate=case.get("lr", 5e-3), max_grad_norm=case.get("clip", 1.0),
        weight_decay=0.01, adam_epsilon=case.get("adam_epsilon", 1e-8), logging_steps=1, save_strategy="steps" if case.get("save_steps") else "no",
        save_steps=case.get("save_steps") or 500, report_to=[], use_cpu=True, seed=0, data_seed=0,
        gradient_checkpointing=case.get("grad_ckpt", False), disable_tqdm=True, dataloader_num_workers=0,
        deepspeed=ds_config(stage, hecate, case.get("ds_optimizer", True), case.get("leaf_classes")),
        lr_scheduler_type="linear",
        save_only_model=False)
    deepspeed.init_distributed(dist_backend="gloo")  # before from_config under ZeRO-3 (zero.Init reads the world)
    torch.manual_seed(0)
    if case.get("pretrained"):  # the same initial weights whatever the stage (zero.Init draws them otherwise)
        model = tf.AutoModelForCausalLM.from_pretrained(case["pretrained"], dtype=torch.float32)
    else:
        model = tf.AutoModelForCausalLM.from_config(tiny_config(kind, case.get("experts", 4)), dtype=torch.float32)
    n = 2 * 2 * case.get("gas", 1) * case.get("steps", 10)
    # "skewed": every rank its own data, rank 0's from a narrow band of the vocabulary (its tokens route to a few
    # experts, rank 1's everywhere), so the ranks' routing differs; else one data set the sampler splits
    data = (TokenData(n, seed=100 + rank_of_world(), high=11 if rank_of_world() == 0 else VOCAB)
            if case.get("routing") == "skewed" else TokenData(n))
    trainer = tf.Trainer(model=model, args=args, train_dataset=data)
    # resume_from: (case name, step): continue from that case's Trainer checkpoint, as `--resume_from_checkpoint`
    resume = case.get("resume_from")
    trainer.train(resume_from_checkpoint=os.path.join(workdir, resume[0], f"checkpoint-{resume[1]}")
                  if resume else None)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    trained: Any = trainer.model   # the PreTrainedModel (the Trainer types it as any Module or None)
    result: Dict[str, Any] = {"loss": [e["loss"] for e in logs], "grad_norm": [e.get("grad_norm") for e in logs],
                              "learning_rate": [e.get("learning_rate") for e in logs],
                              "steps": [e.get("step") for e in logs],
                              "num_parameters": trained.num_parameters(),
                              "ds_hecate_num_parameters": None,
                              # what the Trainer logs as "Number of trainable parameters"
                              "trainer_param_count": tf.trainer.get_model_param_count(trainer.model_wrapped, True),
                              "expert_params_seen_by_deepspeed": [n for n, _ in trainer.model_wrapped.named_parameters()
                                                                  if n.endswith((".gate_up_proj", ".down_proj"))]}
    if hecate:
        from ds_hecate.hf import hecate_of, num_parameters
        takeover = hecate_of(trained)
        result["ds_hecate_num_parameters"] = num_parameters(trained)
        result["hecate_layers"] = list(takeover.runtime.layer_names) if takeover else []
        result["hecate_layer_stats"] = takeover.runtime.stats()["layers"] if takeover else []
    if case.get("final_state"):  # fp32 weights after the last step: dense (ZeRO-1/2) and Hecate's expert masters
        from ds_hecate.hf import hecate_of
        dense = cast(Any, trainer.model_wrapped).module   # the engine's module
        result["dense"] = {n: p.detach().float().clone() for n, p in dense.named_parameters()}
        takeover = hecate_of(trained)
        result["expert_masters"] = dict(takeover.runtime.full_expert_weights()) if takeover else {}
    if case.get("save"):
        save_dir = os.path.join(out_dir, "saved")
        trainer.save_model(save_dir)
        probe = TokenData(2, seed=7).ids
        engine = trainer.model_wrapped
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=probe).logits
        result["save_dir"] = save_dir
        result["probe"] = probe
        result["logits"] = logits
        if hecate:
            takeover = hecate_of(trained)
            assert takeover is not None
            names = {id(m): n for n, m in trained.named_modules()}
            result["experts"] = {f"{names[id(m)]}.{k}": v for (_, m), fused in
                                 zip(takeover.modules, takeover.full_experts()) for k, v in fused.items()}
    trainer.accelerator.free_memory()
    del trainer
    return result


def save_random_model(kind: str, experts: int, directory: str) -> str:
    """A randomly initialized tiny model (seed 0) saved as a pretrained folder, for runs that must start from the
    same weights at different ZeRO stages (single process; no DeepSpeed)."""
    import transformers as tf
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(tiny_config(kind, experts), dtype=torch.float32).save_pretrained(directory)
    return directory


def rank_of_world() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else 0


def run_cases(rank: int, world_size: int, cases: List[Dict[str, Any]], workdir: str) -> Optional[List[dict]]:
    """Entry point for dist_utils.run_ranks: every case in order; rank 0 returns the results."""
    results = []
    for case in cases:
        try:
            results.append(trainer_run(case, workdir))
        except Exception as exc:  # noqa: BLE001 - an expected error is a result for the test to check
            if not case.get("expect_error"):
                raise
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    return results if rank == 0 else None
