"""ZeRO-3 with every supported transformers MoE model: no hang, no trace disagreement, the same training.

Under ZeRO-3 DeepSpeed hooks every module outside its leaf list and checks, at the start of each forward, that the
ranks recorded the same module trace. Hecate runs an experts module's activation once per materialized expert or
once per call, a number that depends on the rank's placement and tokens; called through the module (today's main
before this test) that made OLMoE and DeepSeek-V3 (not on DeepSpeed's default leaf list), and every model with
``leaf_module.classes: []``, fail with "disagreement on list length" or hang. Here each model trains 3 steps on 2
ranks with 8 experts, with DeepSpeed's default leaf list and with an empty one, on skewed per-rank data (rank 0's
tokens from a narrow band of the vocabulary) and on uniform data, and must follow a plain DeepSpeed run from the
same initial weights within 1e-5 relative per step: plain ZeRO-3 for the models on DeepSpeed's default leaf list,
plain ZeRO-2 for OLMoE and DeepSeek-V3, whose eager experts call their activation once per expert hit (so plain
ZeRO-3 itself disagrees across ranks when the routing differs). Initial weights: every run builds its model from
the same pretrained folder (random weights saved once), so plain ZeRO-2 and ZeRO-3 start from the same numbers.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

import pytest

pytest.importorskip("transformers")

from dist_utils import run_ranks  # noqa: E402
from hf_trainer import run_cases, save_random_model  # noqa: E402

#: model -> the stage of the plain DeepSpeed run it is held against
MODELS = {"mixtral": 3, "qwen2_moe": 3, "qwen3_moe": 3, "olmoe": 2, "deepseek_v3": 2}
ROUTINGS = ("skewed", "uniform")
LEAVES: Dict[str, Optional[List[str]]] = {"default_leaves": None, "no_leaves": []}
STEPS = 3
#: Adam's eps: with HF's default 1e-8 an element whose gradient is about 1e-8 takes a first step of about lr * g /
#: (|g| + eps), which turns the last-bit differences of another summation order (Hecate's grouped experts against
#: HF's eager loop, ZeRO-3's partitioned reduction) into 1e-5 of the weight: measured on Qwen3-MoE, uniform data,
#: one element of one expert 1.4e-5 apart after the first step, every other weight within 1e-7, which moved the
#: next loss by 8e-6 relative. 1e-6 keeps the comparison to the reduction order it is about.
ADAM_EPSILON = 1e-6


def _cases(workdir: str):
    cases = []
    for model, plain_stage in MODELS.items():
        pretrained = save_random_model(model, 8, os.path.join(workdir, f"{model}_init"))
        for routing in ROUTINGS:
            common = dict(model=model, routing=routing, experts=8, steps=STEPS, adam_epsilon=ADAM_EPSILON,
                          pretrained=pretrained)
            cases.append(dict(common, name=f"{model}_{routing}_plain", stage=plain_stage, hecate=False))
            for leaves, classes in LEAVES.items():
                cases.append(dict(common, name=f"{model}_{routing}_{leaves}", stage=3, hecate=True,
                                  leaf_classes=classes))
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("hf_z3"))
    cases = _cases(workdir)
    results = run_ranks(2, run_cases, cases, workdir, timeout=900)[0]
    return {c["name"]: r for c, r in zip(cases, results)}


def _max_rel(a, b):
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize("leaves", sorted(LEAVES))
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_zero3_hecate_follows_plain_deepspeed(runs, model, routing, leaves):
    plain, hecate = runs[f"{model}_{routing}_plain"], runs[f"{model}_{routing}_{leaves}"]
    assert hecate["hecate_layers"], "Hecate took no experts module over"
    loss_rel, norm_rel = _max_rel(hecate["loss"], plain["loss"]), _max_rel(hecate["grad_norm"], plain["grad_norm"])
    print(f"{model} {routing} {leaves}: loss {loss_rel:.2e}, grad norm {norm_rel:.2e}")
    assert loss_rel < 1e-5 and norm_rel < 1e-5


def test_skewed_routing_is_skewed(runs):
    """The skewed data really concentrates rank 0's tokens: the busiest expert gets at least twice the mean (so
    the ranks' placements and per-expert calls differ, which is what the ZeRO-3 trace check catches)."""
    for model in MODELS:
        stats = runs[f"{model}_skewed_no_leaves"]["hecate_layer_stats"]
        tokens = stats[0]["tokens_per_expert"]
        assert max(tokens) >= 2 * sum(tokens) / len(tokens), (model, tokens)


def _mixtral_experts(act=None):
    """A MixtralExperts module (8 experts of hidden 3, FFN 4) with ``act`` as its activation."""
    import transformers as tf
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = tf.MixtralConfig(hidden_size=3, intermediate_size=4, num_local_experts=8)
    module = MixtralExperts(config)
    if act is not None:
        module.act_fn = act
    return module


def test_the_activation_runs_without_module_hooks():
    """The unit of the fix: the kernel calls the experts module's activation without its hooks (ZeRO-3's are
    forward hooks), so how often it runs is invisible to ZeRO-3. Fails when the module itself is called."""
    import torch
    from torch import nn

    from ds_hecate.hf.experts import experts_kernel
    from ds_hecate.hf.layouts import plan_experts

    calls = []
    act = nn.SiLU()
    act.register_forward_pre_hook(lambda module, args: calls.append(1))
    module = _mixtral_experts(act)
    kernel = experts_kernel(plan_experts("experts", module), module)
    out = kernel(torch.randn(kernel.numel), torch.randn(5, 3))
    assert out.shape == (5, 3) and calls == []


def test_an_activation_with_parameters_is_refused_by_name():
    from torch import nn

    from ds_hecate.errors import HecateModelError
    from ds_hecate.hf.layouts import plan_experts

    with pytest.raises(HecateModelError, match="experts module 'model.layers.0.mlp.experts' \\(MixtralExperts\\).*"
                                               "act_fn.*PReLU"):
        plan_experts("model.layers.0.mlp.experts", _mixtral_experts(nn.PReLU()))
