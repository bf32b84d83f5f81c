"""Every MoE model type of the installed transformers' experts interface, trained with Hecate like plain DeepSpeed.

The zoo: one tiny random model per model type whose modeling file decorates an experts class with
``@use_experts_implementation`` (38 types in transformers 5.10.4, 72 in 5.25; tests/hf_zoo.py builds them, none is
left out as unbuildable on a CPU), plus a Mixtral whose experts class is outside the interface and registered.
Each type trains :data:`zoo_training.STEPS` steps on 2 ranks at ZeRO-2, fp32, with plain DeepSpeed and with
Hecate from the same initial weights; every rank's loss at every step must agree within 1e-5 relative. The layout
variants (:data:`VARIANTS`) train once more with Hecate under ZeRO-3 with DeepSpeed's default leaf list (held
against the plain ZeRO-2 run: the ZeRO stage does not change the arithmetic), and their trained models are saved
(``save_pretrained`` of the state dict, a DeepSpeed checkpoint) and checked: the saved folder reloads in plain
transformers, in a process that never imports ds_hecate, with the trained model's logits; ``consolidate`` and
``export-hf`` give the same weights. Types Hecate refuses (:data:`REFUSED`) must fail at initialize naming the
module, the class and the feature, while plain DeepSpeed trains them.

Cost: one 2-rank job for every run (forked from the suite's fork server; transformers imported once per rank;
each run 0.3 to 1 s), one interpreter reloading every saved folder, and the models table: on 2 busy CPU cores
about 95 s on transformers 5.10.4 (the job 61 s, the reload 16 s, the table 7 s) and about 160 s on 5.25 (117, 29
and 10 s).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_zoo  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from zoo_training import run_cases  # noqa: E402

from ds_hecate.hf.interface import interface_model_types  # noqa: E402

#: ``DS_HECATE_ZOO=mixtral,gpt_oss`` runs only those types (for debugging one type without the whole zoo)
TYPES = [t for t in interface_model_types() + [hf_zoo.REGISTERED]
         if not os.environ.get("DS_HECATE_ZOO") or t in os.environ["DS_HECATE_ZOO"].split(",")]
#: one model type per layout variant (where the installed transformers has it): ZeRO-3 run and save checks
VARIANTS = {
    "gpt_oss": "interleaved gate/up, transposed, biases, own _apply_gate (clamped SwiGLU)",
    "openai_privacy_filter": "concatenated, transposed, biases, own _apply_gate; a token classifier",
    "nemotron_h": "no gate (up, relu2, down); a hybrid of Mamba-2, attention and MoE layers",
    "deepseek_v4": "own _apply_gate (clamped SwiGLU); hash-routed and learned-router MoE layers",
    "qwen2_moe": "shared expert (with its gate) beside the routed ones",
    "deepseek_v3": "dense-first (first_k_dense_replace), shared experts, bias-corrected sigmoid router",
    "qwen3_vl_moe": "multimodal: the text tower (text_config) holds the MoE",
    "aria": "transposed without biases",
    "ergo": "no gate, transposed; a subclass runs the interface per route, then a per-expert norm of its own",
    hf_zoo.REGISTERED: "an experts class outside the interface, registered",
}
#: model type -> the feature Hecate refuses by name
REFUSED = {"muse_spark": "post-expert norm 'post_expert_norm' (MuseSparkTextInputScaledRMSNorm) holds parameters"}
TOLERANCE = 1e-5


def _cases():
    cases = []
    for model_type in TYPES:
        cases.append(dict(name=f"{model_type}_plain", model_type=model_type, stage=2, hecate=False))
        variant = model_type in VARIANTS
        cases.append(dict(name=f"{model_type}_hecate", model_type=model_type, stage=2, hecate=True,
                          save=model_type not in REFUSED, checkpoint=variant))
        if variant:   # ZeRO-3 with DeepSpeed's default leaf list (no leaf_module in the config)
            cases.append(dict(name=f"{model_type}_hecate_zero3", model_type=model_type, stage=3, hecate=True,
                              save=model_type == "gpt_oss", checkpoint=model_type == "gpt_oss"))
        if model_type == "gpt_oss":   # built under zero.Init (partitioned biases and transposed weights gathered)
            for hecate in (False, True):
                cases.append(dict(name=f"gpt_oss_{'hecate' if hecate else 'plain'}_zero_init",
                                  model_type=model_type, stage=3, hecate=hecate, zero_init=True))
    return cases


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("zoo"))
    cases = _cases()
    results = run_ranks(2, run_cases, cases, workdir, timeout=1200)[0]
    return {c["name"]: r for c, r in zip(cases, results)}


def _max_rel(hecate, plain):
    assert len(hecate) == len(plain) == 2
    pairs = [(h, p) for h_rank, p_rank in zip(hecate, plain) for h, p in zip(h_rank, p_rank)]
    assert pairs and all(len(h) == len(p) for h, p in zip(hecate, plain))
    return max(abs(h - p) / max(abs(p), 1e-12) for h, p in pairs)


def _check_follows_plain(zoo, plain_name, hecate_name):
    plain, hecate = zoo[plain_name], zoo[hecate_name]
    assert "error" not in plain, plain.get("error")
    assert "error" not in hecate, hecate.get("error")
    assert hecate["hecate_layers"], "Hecate took no experts module over"
    assert hecate["experts_seen_by_deepspeed"] == []
    rel = _max_rel(hecate["rank_losses"], plain["rank_losses"])
    print(f"{hecate_name}: max relative loss difference {rel:.1e} over {len(plain['loss'])} steps, 2 ranks")
    assert rel < TOLERANCE, (hecate["rank_losses"], plain["rank_losses"])


@pytest.mark.parametrize("model_type", TYPES)
def test_zero2_follows_plain_deepspeed(zoo, model_type):
    if model_type in REFUSED:
        error = zoo[f"{model_type}_hecate"].get("error", "")
        assert "HecateModelError" in error and REFUSED[model_type] in error, error[-2000:]
        assert "experts module 'model." in error and "error" not in zoo[f"{model_type}_plain"]
        return
    _check_follows_plain(zoo, f"{model_type}_plain", f"{model_type}_hecate")


@pytest.mark.parametrize("model_type", [t for t in VARIANTS if t in TYPES])
def test_zero3_default_leaves_follows_plain_deepspeed(zoo, model_type):
    _check_follows_plain(zoo, f"{model_type}_plain", f"{model_type}_hecate_zero3")


@pytest.mark.skipif("gpt_oss" not in TYPES, reason="DS_HECATE_ZOO selects types")
def test_zero_init_built_model_follows_plain_deepspeed(zoo):
    """GPT-OSS built under ``zero.Init`` (as the Trainer builds a model at ZeRO-3): its partitioned, transposed
    weights and biases are gathered once at take-over; plain ZeRO-3 from the same construction is the reference."""
    _check_follows_plain(zoo, "gpt_oss_plain_zero_init", "gpt_oss_hecate_zero_init")


@pytest.mark.skipif(bool(os.environ.get("DS_HECATE_ZOO")), reason="DS_HECATE_ZOO selects types")
def test_every_variant_is_covered():
    """The variants the issue names are all in the zoo of the oldest supported transformers too."""
    assert {"gpt_oss", "nemotron_h", "deepseek_v4", "qwen2_moe", "deepseek_v3", "qwen3_vl_moe"} <= set(TYPES)


# -- saving ------------------------------------------------------------------------------------------------------
#: every type's ZeRO-2 Hecate run saves (save_pretrained); the variants' also write a DeepSpeed checkpoint
SAVED = [f"{t}_hecate" for t in TYPES if t not in REFUSED] + (["gpt_oss_hecate_zero3"] if "gpt_oss" in TYPES else [])
CHECKPOINTED = [f"{t}_hecate" for t in VARIANTS if t in TYPES] + (["gpt_oss_hecate_zero3"] if "gpt_oss" in TYPES
                                                                   else [])

RELOAD = r"""
import json, sys, traceback, torch, transformers
import transformers.integrations.hub_kernels as hub_kernels
hub_kernels._kernels_available = False   # no network: Jamba's PyTorch path, as in the training ranks
out = {}
for name, folder in json.loads(sys.argv[1]).items():
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        model = getattr(transformers, config.architectures[0]).from_pretrained(folder, dtype=torch.float32).eval()
        ids = torch.randint(3, %(vocab)d, (2, %(seq)d), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            if config.model_type == "diffusion_gemma":
                logits = model(input_ids=ids, decoder_input_ids=ids).logits
            else:
                logits = model(input_ids=ids).logits
        out[name] = logits.float().tolist()
    except Exception:
        out[name] = traceback.format_exc()
assert not any(m == "ds_hecate" or m.startswith("ds_hecate.") for m in sys.modules), "ds_hecate was imported"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reloaded(zoo):
    """Every saved folder reloaded by plain transformers in a fresh interpreter that never imports ds_hecate."""
    folders = {name: zoo[name]["saved"] for name in SAVED if "saved" in zoo[name]}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["DS_HECATE_AUTOLOAD"] = "0"   # an installed ds_hecate would otherwise load with DeepSpeed
    script = RELOAD % {"vocab": hf_zoo.VOCAB, "seq": hf_zoo.SEQ}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(folders)], capture_output=True, text=True,
                          env=env, cwd=os.path.dirname(next(iter(folders.values()))), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", SAVED)
def test_save_pretrained_reloads_in_plain_transformers(zoo, reloaded, name):
    assert "error" not in zoo[name], zoo[name].get("error")
    assert not isinstance(reloaded[name], str), reloaded[name]
    torch.testing.assert_close(torch.tensor(reloaded[name]), zoo[name]["logits"], rtol=1e-5, atol=1e-5)


def _model_from(folder):
    config = transformers.AutoConfig.from_pretrained(folder)
    return getattr(transformers, config.architectures[0]).from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", CHECKPOINTED)
def test_consolidate_and_export_hf_agree_with_save_pretrained(zoo, name, tmp_path):
    from ds_hecate.deepspeed_glue.consolidate import consolidated_state_dict
    from ds_hecate.tools.cli import main

    from zoo_training import _logits, probe_ids

    result = zoo[name]
    assert "error" not in result, result.get("error")
    saved = _model_from(result["saved"])
    params = saved.state_dict()
    # consolidate: the module's own layout (transposed, interleaved, biases), the experts as the trained model
    # held them
    state = consolidated_state_dict(result["checkpoint"], "final")
    assert result["expert_state"]
    for key, value in result["expert_state"].items():
        assert torch.equal(state[key], value.float()), key
        assert torch.equal(params[key], value.float()), key
    for key, value in state.items():   # dense weights and buffers (zero_to_fp32's) too
        assert key in params and torch.equal(params[key].float(), value), key
    # export-hf: a folder that loads with the trained model's logits
    out = str(tmp_path / "exported")
    assert main(["export-hf", result["checkpoint"], "--tag", "final", "--model-config", result["saved"],
                 "-o", out]) == 0
    with torch.no_grad():
        logits = _logits(_model_from(out), probe_ids())
    torch.testing.assert_close(logits, result["logits"], rtol=1e-5, atol=1e-5)


# -- the models table --------------------------------------------------------------------------------------------
def test_models_table_in_the_docs_is_the_commands_output():
    """``ds-hecate models`` (``models_markdown(model_rows())``) says what the zoo shows (every class taken over but
    the refused types'), and docs/huggingface.md shows its output for the installed transformers verbatim (for the
    tested versions)."""
    import re

    from ds_hecate.tools.models import model_rows, models_markdown

    rows = model_rows()
    assert {r.model_type for r in rows} == set(interface_model_types())
    for row in rows:
        assert row.taken_over == (row.model_type not in REFUSED), row
        if row.model_type in REFUSED:
            assert REFUSED[row.model_type] in row.status, row
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "huggingface.md"), encoding="utf-8").read()
    documented = dict(re.findall(r"<!-- ds-hecate models: transformers (\S+) -->\n(.*?)\n<!-- end -->", docs, re.S))
    assert len(documented) >= 2
    if transformers.__version__ not in documented:
        pytest.skip(f"docs/huggingface.md shows the tables of {sorted(documented)}, not {transformers.__version__}")
    assert documented[transformers.__version__] == models_markdown(rows)
