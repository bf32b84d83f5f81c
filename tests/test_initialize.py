"""deepspeed.initialize with a hecate section: bad input fails early and names the problem; the switch works in
every documented spelling; the engine exposes the runtime."""
from __future__ import annotations

from dataclasses import replace

import pytest

from dist_utils import run_ranks
from moe_training import Spec, TinyMoE, ds_config


def _expect_error(build, config, error_type):
    import deepspeed
    try:
        deepspeed.initialize(model=build(), model_parameters=None, config=config)
    except error_type as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - report the wrong type to the parent
        return f"WRONG TYPE {type(exc).__name__}: {exc}"
    return "NO ERROR"


def _errors_worker(rank: int, world: int) -> dict:
    from torch import nn

    import deepspeed
    from ds_hecate import HecateConfigError, HecateModelError, HecateUnsupportedError

    deepspeed.init_distributed(dist_backend="gloo")
    spec = Spec(num_experts=4, layers=1)
    moe = lambda: TinyMoE(spec)  # noqa: E731

    def cfg(**hecate):
        return ds_config(replace(spec, hecate={"enabled": True, **hecate}))

    out = {}
    out["unknown_key"] = _expect_error(moe, cfg(placemnet="owner"), HecateConfigError)
    out["wrong_type"] = _expect_error(moe, cfg(enabled="yes"), HecateConfigError)
    out["bad_value"] = _expect_error(moe, cfg(placement="everywhere"), HecateConfigError)
    both = cfg()
    both["hecate"] = {"enabled": True}
    out["both_sections"] = _expect_error(moe, both, HecateConfigError)
    autoep = cfg()
    autoep["expert_parallel"] = {"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}
    out["expert_parallel"] = _expect_error(moe, autoep, HecateConfigError)
    stage0 = cfg()
    stage0["zero_optimization"]["stage"] = 0
    stage0["fp16"] = {"enabled": True}
    stage0["optimizer"] = {"type": "Adam", "legacy_fusion": True, "params": {"lr": 1e-3}}
    out["stage0_fp16_legacy_fusion"] = _expect_error(moe, stage0, HecateUnsupportedError)
    out["no_moe"] = _expect_error(lambda: nn.Sequential(nn.Linear(4, 4)), cfg(), HecateModelError)
    for case, (key, value) in {
        "offload": ("zero_optimization", {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
        "hybrid_engine": ("hybrid_engine", {"enabled": True}),
        "deepcompile": ("compile", {"deepcompile": True}),
        "torch_autocast": ("torch_autocast", {"enabled": True}),
        "autotp": ("tensor_parallel", {"autotp_size": 2}),
        "sequence_parallel": ("sequence_parallel_size", 2),
    }.items():
        bad = cfg()
        bad[key] = value if key != "zero_optimization" else {**value, "hecate": bad[key]["hecate"]}
        out[case] = _expect_error(moe, bad, HecateUnsupportedError)
    from deepspeed.pipe import PipelineModule
    out["pipeline"] = _expect_error(lambda: PipelineModule(layers=[nn.Linear(4, 4)], num_stages=1), cfg(),
                                    HecateUnsupportedError)
    try:
        deepspeed.initialize(model=moe(), config=cfg(), mpu=object())
        out["mpu"] = "NO ERROR"
    except HecateUnsupportedError as exc:
        out["mpu"] = str(exc)

    # Spellings that turn Hecate on: nested key, top-level alias, explicit ds_hecate.initialize.
    import ds_hecate
    top = ds_config(spec)
    top["hecate"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=moe(), config=top)
    out["top_level_alias"] = type(engine).__name__
    engine, *_ = ds_hecate.initialize(model=moe(), config=cfg())
    out["explicit"] = type(engine).__name__
    out["stats"] = engine.hecate.stats()
    reference = sum(p.numel() for p in moe().parameters())
    out["num_parameters"] = (ds_hecate.num_parameters(engine.module), reference)
    disabled = ds_config(replace(spec, hecate={"enabled": False}))
    engine, *_ = deepspeed.initialize(model=moe(), config=disabled)
    out["disabled"] = (type(engine).__name__, hasattr(engine, "hecate"))
    return out


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(1, _errors_worker)[0]


@pytest.mark.parametrize("case,needles", [
    ("unknown_key", ["placemnet", "zero_optimization.hecate"]),
    ("wrong_type", ["zero_optimization.hecate.enabled", "'yes'"]),
    ("bad_value", ["zero_optimization.hecate.placement", "everywhere"]),
    ("both_sections", ["both", "zero_optimization.hecate"]),
    ("expert_parallel", ["expert_parallel", "AutoEP"]),
    ("stage0_fp16_legacy_fusion", ["fp16 with ZeRO stage 0", "optimizer.legacy_fusion"]),  # fp16 stage 0 itself
    # trains (tests/test_fp16_stage0.py); only FP16_Optimizer's legacy fused step is refused
    ("no_moe", ["Sequential", "no MoE layer", "hecate.enabled"]),
    ("offload", ["ZeRO-Offload"]),
    ("hybrid_engine", ["hybrid engine"]),
    ("deepcompile", ["DeepCompile"]),
    ("torch_autocast", ["torch_autocast"]),
    ("autotp", ["AutoTP"]),
    ("sequence_parallel", ["sequence parallelism"]),
    ("pipeline", ["pipeline engine"]),
    ("mpu", ["model-parallel unit"]),
])
def test_bad_input_fails_at_initialize_with_a_clear_message(outcomes, case, needles):
    message = outcomes[case]
    assert not message.startswith(("NO ERROR", "WRONG TYPE")), f"{case}: {message}"
    for needle in needles:
        assert needle in message, f"{case}: {needle!r} not in {message!r}"


def test_every_spelling_turns_hecate_on(outcomes):
    assert outcomes["top_level_alias"] == "HecateEngine"
    assert outcomes["explicit"] == "HecateEngine"
    assert outcomes["disabled"] == ("DeepSpeedEngine", False)


def test_engine_exposes_runtime_statistics(outcomes):
    import json
    stats = outcomes["stats"]
    json.dumps(stats)  # JSON-serialisable
    assert stats["world_size"] == 1 and len(stats["layers"]) == 1
    assert stats["layers"][0]["num_experts"] == 4 and stats["layers"][0]["owned_experts"] == [0, 1, 2, 3]


def test_parameter_count_still_counts_the_experts(outcomes):
    counted, reference = outcomes["num_parameters"]
    assert counted == reference
