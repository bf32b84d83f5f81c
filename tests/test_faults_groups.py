"""A rank killed while saving, with groups (issue 25): 4 ranks as 2 groups of 2 (``hecate.ep_size`` 2, the expert
state partitioned over the 2 expert-data-parallel peers, re-sharding on), a checkpoint after 2 steps, then rank 1
(an owner of the first group, the one that writes the expert files) SIGKILLed while it writes its second expert file
of the next checkpoint. ``latest`` must still name the complete checkpoint, the survivors must stop on their own
within the collective timeout, and a restart from ``latest`` must continue bit for bit like a run that was never
interrupted (every group resumes its own load window and schedule), every expert back with its optimizer state."""
from __future__ import annotations

import functools
import os
from dataclasses import replace

import pytest

from test_faults import SAVED_STEP, TIMEOUT_S, _arm_kill, _fault_spec

WORLD = 4


def _group_spec(**kw):
    spec = _fault_spec(**kw)
    return replace(spec, hecate={**spec.hecate, "ep_size": 2})


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    from dist_utils import run_ranks_until_exit
    from moe_training import train

    base = tmp_path_factory.mktemp("groups_kill")
    ckpt, stamp = str(base / "ckpt"), str(base / "killed_at")
    spec = _group_spec(steps=5, save_after=SAVED_STEP, ckpt_dir=ckpt,
                       step_hook=functools.partial(_arm_kill, "save-experts", stamp, ckpt, 3))
    ranks = run_ranks_until_exit(WORLD, train, spec, timeout=TIMEOUT_S + 150)
    return {"ranks": ranks, "ckpt": ckpt, "killed_at": float(open(stamp).read()) if os.path.exists(stamp) else None}


def test_latest_stays_on_the_complete_checkpoint_and_the_survivors_stop(killed):
    assert killed["killed_at"] is not None and killed["ranks"][1]["exitcode"] == -9, killed["ranks"][1]
    for rank in (0, 2, 3):
        survivor = killed["ranks"][rank]
        assert survivor["exitcode"] not in (None, 0), f"rank {rank} did not fail on its own: {survivor}"
        assert survivor["exit_time"] - killed["killed_at"] <= TIMEOUT_S + 60, rank
    assert open(os.path.join(killed["ckpt"], "latest")).read().strip() == f"global_step{SAVED_STEP}"
    partial = os.path.join(killed["ckpt"], "global_step3", "hecate")
    written = [f for f in os.listdir(partial) if f.endswith(".pt")]
    assert 0 < len(written) < 2 * 8, f"the kill did not interrupt the expert files: {written}"


def test_restart_from_latest_continues_exactly(killed, tmp_path):
    from moe_training import run_specs
    from resume_checks import assert_loaded_every_expert, assert_resumes_exactly, dump_expert_state

    dump = str(tmp_path / "loaded")
    clean, loaded = run_specs(WORLD, [_group_spec(steps=5, per_step_state=True),
                                      _group_spec(steps=5, per_step_state=True, resume_from=killed["ckpt"],
                                                  step_hook=functools.partial(dump_expert_state, dump))])
    assert clean[0]["hecate_stats"]["expert_data_parallel_size"] == 2
    assert clean[0]["hecate_stats"]["reshards"] >= 1
    assert_resumes_exactly(clean, loaded, SAVED_STEP, "groups kill")
    assert_loaded_every_expert(dump, WORLD, os.path.join(killed["ckpt"], f"global_step{SAVED_STEP}"), "groups kill")


def _nan_input_on_rank3(rank: int, step: int, engine) -> None:
    """Step hook: from step 1 on, global rank 3's input to the first MoE layer is NaN (its gate values follow)."""
    if step == 1 and rank == 3:
        moe = dict(engine.module.named_modules())["blocks.0.moe"]
        moe.register_forward_pre_hook(lambda module, args: (args[0] * float("nan"),) + tuple(args[1:]))


def test_a_nan_gate_in_one_group_stops_every_rank_of_every_group_with_the_same_error():
    """NaN gate values on global rank 3 (group 1, index 1) of 4 ranks in 2 groups: every rank, the other group's
    included, raises the same error naming the layer and the global rank, at the end of that forward (the stop
    agreement), within seconds of each other; none dies of an unrelated collective error."""
    from dist_utils import run_ranks_until_exit
    from moe_training import train

    spec = _group_spec(steps=3, step_hook=_nan_input_on_rank3)
    ranks = run_ranks_until_exit(WORLD, train, spec, timeout=TIMEOUT_S + 120)
    expected = ("HecateError: MoE layer 'blocks.0.moe': non-finite gate values (NaN/Inf) on global rank 3 (group 1, "
                "index 1); ")   # then the next layer's, which the NaN reaches too
    errors = []
    for rank, result in enumerate(ranks):
        assert result["exitcode"] not in (None, 0), (rank, result)
        last = [line for line in (result["payload"] or "").splitlines() if line.strip()][-1]
        errors.append(last)
        assert expected in last and "every rank stops at the end of this forward, every group included" in last, \
            (rank, result["payload"])
    assert len(set(errors)) == 1, errors
    times = [r["exit_time"] for r in ranks]
    assert max(times) - min(times) < 10, times
