"""transformers' own ``run_clm.py``, unmodified, trains a tiny GLM-4.5-style MoE with the ``hecate`` key as it
trains it with plain DeepSpeed (issue 55, acceptance 3).

Opt-in: the script is transformers' (``examples/pytorch/language-modeling/run_clm.py`` in its repository, not part
of the pip package, not shipped here) and needs ``datasets`` and ``evaluate``. Run it in an environment where
ds_hecate is installed as users install it (``pip install .``: the autoload hook makes ``deepspeed`` Hecate-aware,
the script never imports ds_hecate)::

    python -m venv --system-site-packages /tmp/clm && /tmp/clm/bin/pip install datasets evaluate wheel
    /tmp/clm/bin/pip install --no-deps --no-build-isolation .
    DS_HECATE_RUN_CLM=/path/to/run_clm.py /tmp/clm/bin/python -m pytest tests/test_hf_run_clm.py

The model: ``glm4_moe`` (GLM-4.5's architecture) at hidden 32, two layers, the first dense
(``first_k_dense_replace=1``), 8 routed experts top-2 behind GLM's sigmoid router with its score-correction bias,
one shared expert. The tokenizer is a word-level one built from the training text (no download). Both runs: the
``deepspeed`` launcher, 2 CPU ranks, ZeRO-2, fp32, 6 steps, ``--logging_steps 1``; every logged loss and grad norm
must agree within 1e-5 relative, and the model ``run_clm.py`` saves must reload in plain transformers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN_CLM = os.environ.get("DS_HECATE_RUN_CLM")
pytestmark = pytest.mark.skipif(not RUN_CLM, reason="set DS_HECATE_RUN_CLM to transformers' run_clm.py")

from dist_utils import free_port  # noqa: E402

WORDS = ("the expert router sends each token to two of eight experts and the shared expert sees every token while "
         "the dense layer comes first").split()
STEPS = 6


def _data(folder: Path) -> Path:
    """A deterministic text file of sentences over :data:`WORDS`."""
    import random
    rng = random.Random(0)
    path = folder / "train.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(400)),
                    encoding="utf-8")
    return path


def _tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<eos>"] + sorted(set(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   model_max_length=64)
    path = folder / "tokenizer"
    fast.save_pretrained(path)
    return path


def _config(folder: Path, vocab: int) -> Path:
    from transformers import Glm4MoeConfig

    # head_dim: kept as an attribute, though the config's __init__ does not declare it
    config = Glm4MoeConfig(  # type: ignore[call-arg]
        vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, norm_topk_prob=True, max_position_embeddings=64, initializer_range=0.3,
        tie_word_embeddings=False, pad_token_id=1, eos_token_id=2, bos_token_id=2)
    config.architectures = ["Glm4MoeForCausalLM"]
    path = folder / "config"
    config.save_pretrained(path)
    return path


def _ds_config(folder: Path, hecate: bool) -> Path:
    zero = {"stage": 2, **({"hecate": {"enabled": True}} if hecate else {})}
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": zero, "bf16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                         "weight_decay": "auto", "torch_adam": True}}}
    path = folder / f"ds_{'hecate' if hecate else 'plain'}.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def _run_clm(folder: Path, hecate: bool, data: Path, tokenizer: Path, config: Path) -> dict:
    out = folder / f"out_{'hecate' if hecate else 'plain'}"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           str(RUN_CLM), "--config_name", str(config), "--tokenizer_name", str(tokenizer), "--train_file", str(data),
           "--do_train", "--block_size", "16", "--per_device_train_batch_size", "2", "--max_steps", str(STEPS),
           "--logging_steps", "1", "--learning_rate", "5e-3", "--seed", "0", "--output_dir", str(out),
           "--report_to", "none", "--save_strategy", "no", "--use_cpu", "--dataloader_num_workers", "0",
           "--deepspeed", str(_ds_config(folder, hecate))]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the installed ds_hecate, not the checkout
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(folder / "cache"))
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    history = json.loads((out / "trainer_state.json").read_text(encoding="utf-8"))["log_history"]
    steps = [h for h in history if "loss" in h]
    return {"log": log, "loss": [h["loss"] for h in steps], "grad_norm": [h["grad_norm"] for h in steps],
            "out": out}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("datasets")
    pytest.importorskip("evaluate")
    probe = subprocess.run([sys.executable, "-c", "import ds_hecate_autoload, ds_hecate; print(ds_hecate.__file__)"],
                           capture_output=True, text=True, cwd="/",
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if probe.returncode != 0:
        pytest.skip("ds_hecate is not installed in this interpreter (pip install .): run_clm.py never imports it")
    folder = tmp_path_factory.mktemp("run_clm")
    data, tokenizer = _data(folder), _tokenizer(folder)
    from transformers import AutoTokenizer
    config = _config(folder, len(AutoTokenizer.from_pretrained(tokenizer)))
    return {h: _run_clm(folder, h, data, tokenizer, config) for h in (False, True)}


def test_run_clm_trains_glm4_moe_with_hecate_like_plain_deepspeed(runs):
    plain, hecate = runs[False], runs[True]
    assert "Hecate took over 1 MoE layer(s)" in hecate["log"], hecate["log"][-3000:]
    assert "Hecate took over" not in plain["log"]
    assert len(plain["loss"]) == len(hecate["loss"]) == STEPS
    for key in ("loss", "grad_norm"):
        rel = max(abs(h - p) / abs(p) for h, p in zip(hecate[key], plain[key]))
        print(f"run_clm.py glm4_moe: {key} {plain[key]} / {hecate[key]}: max relative difference {rel:.1e}")
        assert rel < 1e-5, (key, plain[key], hecate[key])


def test_the_model_run_clm_saved_reloads_in_plain_transformers(runs):
    import torch
    from transformers import AutoModelForCausalLM

    hecate = AutoModelForCausalLM.from_pretrained(runs[True]["out"], dtype=torch.float32)
    names = [n for n, _ in hecate.named_parameters()]
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names), names
