"""The rank side of tests/test_hf_zoo.py: a tiny random model of a model type trained a few steps with plain
DeepSpeed and with Hecate, from the same initial weights, in one 2-rank job for every type.

Each run builds the type's tiny model (:func:`hf_zoo.build`, seeded: every rank and every run starts from the same
weights), wraps it with ``deepspeed.initialize`` (ZeRO-2 or 3, fp32, the ``hecate`` key or not) and takes
:data:`STEPS` steps, each rank on its own batch. A run's result is the loss log of every rank; a failing run is a
result too (its traceback), so that one type's failure fails that type's test only.
"""
from __future__ import annotations

import os
import time
import traceback
from typing import Any, Dict, List, Optional

import torch

STEPS = 3
BATCH = 2
LR = 1e-2


def ds_config(stage: int, hecate: bool) -> Dict[str, Any]:
    """The config ``deepspeed.initialize`` gets directly (no Trainer to fill in "auto" values)."""
    from hf_trainer import zero_section
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "zero_optimization": zero_section(stage, hecate),
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "eps": 1e-6,
                                                      "torch_adam": True}},
            "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def batches(rank: int) -> List[torch.Tensor]:
    """Every step's token ids of this rank (the same in every run)."""
    import hf_zoo
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(3, hf_zoo.VOCAB, (BATCH, hf_zoo.SEQ), generator=g) for _ in range(STEPS)]


def probe_ids() -> torch.Tensor:
    import hf_zoo
    return torch.randint(3, hf_zoo.VOCAB, (2, hf_zoo.SEQ), generator=torch.Generator().manual_seed(7))


def train(case: Dict[str, Any], workdir: str) -> Dict[str, Any]:
    """One run: ``case`` = {model_type, stage, hecate, [zero_init], [save]}."""
    import deepspeed
    import torch.distributed as dist

    import hf_zoo

    t0 = time.perf_counter()
    if case["hecate"] and case["model_type"] == hf_zoo.REGISTERED:
        hf_zoo.register_plain_experts()
    config = ds_config(case["stage"], case["hecate"])
    if case.get("zero_init"):   # built partitioned under zero.Init, as the Trainer builds a model at ZeRO-3
        from transformers.integrations import HfDeepSpeedConfig
        zero3 = HfDeepSpeedConfig(config)   # noqa: F841 - transformers reads it while the model is built
        model = hf_zoo.build(case["model_type"], check_size=False)
        del zero3
    else:
        model = hf_zoo.build(case["model_type"])
    t1 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    t2 = time.perf_counter()
    result: Dict[str, Any] = {"loss": []}
    for ids in batches(dist.get_rank()):
        loss = hf_zoo.forward_loss(engine, ids)
        engine.backward(loss)
        engine.step()
        result["loss"].append(loss.item())
    result["seconds"] = (t1 - t0, t2 - t1, time.perf_counter() - t2)
    if case["hecate"]:
        from ds_hecate.hf import hecate_of
        takeover = hecate_of(engine)
        result["hecate_layers"] = list(takeover.runtime.layer_names) if takeover else []
        # parameters of a taken-over experts module that DeepSpeed still holds (none may be left)
        result["experts_seen_by_deepspeed"] = [n for n, _ in engine.module.named_parameters()
                                               if n.rsplit(".", 1)[0] in result["hecate_layers"]]
    if case.get("save"):
        result.update(_save(case, engine, workdir))
    engine.destroy() if hasattr(engine, "destroy") else None
    return result


def _save(case: Dict[str, Any], engine, workdir: str) -> Dict[str, Any]:
    """What the save checks compare: the trained model's logits on a probe, ``save_pretrained`` of its state dict
    (collective: every rank gathers the experts, rank 0 writes, after the last collective so that a failing save
    cannot leave the other rank waiting) and, with ``case["checkpoint"]``, a DeepSpeed checkpoint for
    ``consolidate`` and ``export-hf``."""
    import torch.distributed as dist

    folder = os.path.join(workdir, case["name"])
    engine.eval()
    with torch.no_grad():
        logits = _logits(engine, probe_ids())
    # what Trainer.save_model saves: the module's state dict, under ZeRO-3 DeepSpeed's 16-bit consolidation
    # (fp32 here; rank 0 gets it)
    state = engine._zero3_consolidated_16bit_state_dict() if case["stage"] == 3 else engine.module.state_dict()
    experts = {k: v.clone() for k, v in (state or {}).items()
               if k.rsplit(".", 1)[-1].startswith(("gate_up_proj", "up_proj", "down_proj"))}
    out = {"logits": logits, "saved": os.path.join(folder, "saved"), "expert_state": experts}
    if case.get("checkpoint"):
        engine.save_checkpoint(os.path.join(folder, "checkpoint"), tag="final")
        out["checkpoint"] = os.path.join(folder, "checkpoint")
    dist.barrier()
    if dist.get_rank() == 0:   # (save_pretrained edits the dict it is given)
        engine.module.save_pretrained(out["saved"], state_dict=state)
    return out


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's output scores on ``ids`` (the logits of a causal LM or token classifier; a block-diffusion
    decoder's on the canvas ``ids``)."""
    if getattr(model, "module", model).config.model_type == "diffusion_gemma":
        return model(input_ids=ids, decoder_input_ids=ids).logits.float()
    return model(input_ids=ids).logits.float()


def run_cases(rank: int, world_size: int, cases: List[Dict[str, Any]], workdir: str) -> Optional[List[dict]]:
    """Entry point for dist_utils.run_ranks: every case in order; rank 0 returns every rank's loss log."""
    import torch.distributed as dist
    import transformers
    import transformers.integrations.hub_kernels as hub_kernels

    import ds_hecate  # noqa: F401 - deepspeed.initialize Hecate-aware

    transformers.logging.set_verbosity_error()
    # No network here: transformers would fetch CUDA-only state-space kernels from the Hub for Jamba, and without
    # the `kernels` package (an optional dependency) it takes its PyTorch path, which is what runs on a CPU anyway.
    hub_kernels._kernels_available = False
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for case in cases:
        try:
            result = train(case, workdir)
        except Exception:  # noqa: BLE001 - the type's test reports it
            result = {"error": traceback.format_exc()}
        gathered: List[Any] = [None] * world_size
        dist.all_gather_object(gathered, result.get("loss") if "error" not in result else None)
        result["rank_losses"] = gathered
        results.append(result)
    return results if rank == 0 else None
