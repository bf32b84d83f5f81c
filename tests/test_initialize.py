"""deepspeed.initialize with a hecate section: bad input fails early and names the problem; the switch works in
every documented spelling; the engine exposes the runtime."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

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
    out["near_miss_key"] = _expect_error(moe, cfg(materialise_budget_mb=64), HecateConfigError)
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
    value: Any
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
    out.update(_mpu_refusals(moe, cfg))

    # Spellings that turn Hecate on: nested key, top-level alias, explicit ds_hecate.initialize.
    import ds_hecate
    top = ds_config(spec)
    top["hecate"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=moe(), config=top)
    out["top_level_alias"] = type(engine).__name__
    engine, *_ = ds_hecate.initialize(model=moe(), config=cfg())
    out["explicit"] = type(engine).__name__
    out["stats"] = engine.hecate.stats()
    from ds_hecate.comm import exit_guard
    out["exit_guard"] = (exit_guard._registered, len(exit_guard._groups))
    reference = sum(p.numel() for p in moe().parameters())
    out["num_parameters"] = (ds_hecate.num_parameters(engine.module), reference)
    disabled = ds_config(replace(spec, hecate={"enabled": False}))
    engine, *_ = deepspeed.initialize(model=moe(), config=disabled)
    out["disabled"] = (type(engine).__name__, hasattr(engine, "hecate"))
    return out


class _FakeMPU:
    """Answers what initialize asks an mpu before any group is built (tensor-parallel size ``tp``)."""

    def __init__(self, tp: int = 1, pipeline: int = 1, sequence: bool = False) -> None:
        self.tp, self.pipeline = tp, pipeline
        if sequence:
            self.initialize_sequence_parallel = lambda *a: None

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group(self):
        return None

    def get_pipeline_model_parallel_world_size(self):
        return self.pipeline


def _mpu_refusals(moe, cfg) -> dict:
    """What a model-parallel unit Hecate cannot follow gives: refused before DeepSpeed builds anything."""
    import deepspeed
    from deepspeed.moe.layer import MoE
    from torch import nn
    from ds_hecate import HecateConfigError, HecateUnsupportedError

    def attempt(model, mpu, error_type):
        try:
            deepspeed.initialize(model=model, config=cfg(), mpu=mpu)
        except error_type as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001
            return f"WRONG TYPE {type(exc).__name__}: {exc}"
        return "NO ERROR"

    expert_tp = MoE(8, nn.Linear(8, 8), num_experts=2, enable_expert_tensor_parallelism=True)
    return {"mpu_incomplete": attempt(moe(), object(), HecateConfigError),
            "mpu_pipeline": attempt(moe(), _FakeMPU(pipeline=2), HecateUnsupportedError),
            "mpu_sequence": attempt(moe(), _FakeMPU(sequence=True), HecateUnsupportedError),
            "mpu_expert_tp": attempt(expert_tp, _FakeMPU(tp=2), HecateUnsupportedError)}


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(1, _errors_worker)[0]


@pytest.mark.parametrize("case,needles", [
    ("unknown_key", ["placemnet", "zero_optimization.hecate", "did you mean 'placement'?"]),
    ("near_miss_key", ["'zero_optimization.hecate.materialise_budget_mb'", "did you mean 'materialize_budget_mb'?"]),
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
    ("mpu_incomplete", ["model-parallel unit (mpu)", "get_data_parallel_world_size", "lacks"]),
    ("mpu_pipeline", ["pipeline parallelism", "pipeline-parallel size is 2"]),
    ("mpu_sequence", ["sequence-parallel mpu"]),
    ("mpu_expert_tp", ["enable_expert_tensor_parallelism=True", "tensor-parallel size of 2", "<the model>"]),
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


def test_initialize_registers_the_exit_guard_with_hecates_groups(outcomes):
    """Without the guard a CPU run may abort at exit (tests/test_exit_guard.py); every engine registers it."""
    registered, groups = outcomes["exit_guard"]
    assert registered and groups >= 2, outcomes["exit_guard"]


def test_engine_exposes_runtime_statistics(outcomes):
    import json
    stats = outcomes["stats"]
    json.dumps(stats)  # JSON-serialisable
    assert stats["world_size"] == 1 and len(stats["layers"]) == 1
    assert stats["layers"][0]["num_experts"] == 4 and stats["layers"][0]["owned_experts"] == [0, 1, 2, 3]


def test_parameter_count_still_counts_the_experts(outcomes):
    counted, reference = outcomes["num_parameters"]
    assert counted == reference


# -- node discovery: ranks per node from the launcher's environment ------------------------------------------------
NODE_KEYS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


@pytest.mark.parametrize("env,world,expected", [
    ({}, 8, 8),                                               # nothing set: one node
    ({"LOCAL_SIZE": "4"}, 8, 4),                              # the deepspeed launcher
    ({"LOCAL_WORLD_SIZE": "2"}, 8, 2),                        # torchrun
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 8, 4),              # Open MPI
    ({"MPI_LOCALNRANKS": "2"}, 8, 2),                         # MPICH (hydra)
    # LOCAL_SIZE wins: under the deepspeed launcher accelerate sets LOCAL_WORLD_SIZE=1 on CPU
    ({"LOCAL_SIZE": "4", "LOCAL_WORLD_SIZE": "1"}, 8, 4),
    ({"LOCAL_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MPI_LOCALNRANKS": "8"}, 8, 2),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MPI_LOCALNRANKS": "2"}, 8, 4),
    # unusable values are skipped: not a divisor of the world size, zero, not a number, empty
    ({"LOCAL_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 8, 2),
    ({"LOCAL_SIZE": "0", "MPI_LOCALNRANKS": "4"}, 8, 4),
    ({"LOCAL_SIZE": "four", "LOCAL_WORLD_SIZE": "-2", "OMPI_COMM_WORLD_LOCAL_SIZE": "", "MPI_LOCALNRANKS": "2"}, 8, 2),
    ({"MPI_LOCALNRANKS": "16"}, 8, 8),
])
def test_ranks_per_node_from_the_launcher_environment(monkeypatch, env, world, expected):
    from ds_hecate.config import HecateConfig
    from ds_hecate.deepspeed_glue.initialize import _ranks_per_node

    for key in NODE_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _ranks_per_node(HecateConfig(enabled=True), world) == expected
    # the config wins over every variable
    assert _ranks_per_node(HecateConfig(enabled=True, ranks_per_node=1), world) == 1


def _nodes_worker(rank: int, world: int, settings: list) -> list:
    """Hecate's runtime built under each launcher environment (the variables torchrun would set removed)."""
    import os

    import torch.distributed as dist

    from ds_hecate.config import HecateConfig
    from ds_hecate.deepspeed_glue.initialize import build_runtime

    dist.init_process_group("gloo")
    out = []
    for env in settings:
        for key in NODE_KEYS:
            os.environ.pop(key, None)
        os.environ.update(env)
        stats = build_runtime(HecateConfig(enabled=True, log_conversion=False), {}).stats()
        out.append((stats["ranks_per_node"], stats["nodes"]))
    return out


def test_runtime_finds_the_nodes_under_mpi_launchers():
    settings = [{"OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, {"MPI_LOCALNRANKS": "1"}, {"LOCAL_SIZE": "1"},
                {"MPI_LOCALNRANKS": "2"}, {}]
    for result in run_ranks(2, _nodes_worker, settings, timeout=120):
        assert result == [(1, 2), (1, 2), (1, 2), (2, 1), (2, 1)], result
