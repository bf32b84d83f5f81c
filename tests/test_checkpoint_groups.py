"""Checkpoints across group sizes (issue 25): saved as logical experts whatever the groups, loaded at any world size
and ``hecate.ep_size``, optimizer state included, and the training continues on the trajectory of the run that did
not stop.

Every run trains the same global batches (laid out for 4 data ranks, forced routes, no aux loss: a rank merging
two ranks' batches computes the same function) with the expert state partitioned over the expert-data-parallel
peers wherever there are groups (ZeRO-2). Legs, each saving at step 3 and continuing to step 6:

- from ``ep_size`` 2 on 4 ranks (2 groups) to ``ep_size`` 4 on 4 ranks (one group), to 2 ranks and to 1 rank;
- the reverse: from ``ep_size`` 4 on 4 ranks, from 2 ranks and from 1 rank to ``ep_size`` 2 on 4 ranks.

Worlds that change go through DeepSpeed's universal checkpoint (the dense part; Hecate's experts load as they
are). Checked: the global loss of every step of every leg against the 4-rank ``ep_size`` 2 run that never stopped
(fp32), the final weights, and that the loading ranks hold exactly the saved experts with their Adam state.
"""
from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import cast

import pytest
import torch

from moe_training import Spec, run_specs
from resume_checks import assert_loaded_every_expert, dump_expert_state, to_universal

SAVE, STEPS = 3, 6
# aux loss off: computed per micro-batch, so merging two ranks' batches into one would change it.
BASE = Spec(steps=STEPS, aux_coef=0.0, forced_routes=True, virtual_ranks=4, native=True,
            gate_bias=(2.0, 2.0) + (0.0,) * 6, hecate={"enabled": True, "placement": "local", "ep_size": 2})
UNIVERSAL = {"checkpoint": {"load_universal": True}}
LAYOUTS = {"ep2x2": (4, 2), "ep4": (4, 4), "two": (2, None), "one": (1, None)}   # name: (world, hecate.ep_size)


def _spec(layout: str, **kw) -> Spec:
    world, ep_size = LAYOUTS[layout]
    hecate = {k: v for k, v in cast(dict, BASE.hecate).items() if k != "ep_size"}
    if ep_size is not None:
        hecate["ep_size"] = ep_size
    return replace(BASE, hecate=hecate, **kw)


def _global_losses(results) -> torch.Tensor:
    return torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    base = tmp_path_factory.mktemp("groups_ckpt")
    dirs = {name: str(base / name) for name in LAYOUTS}
    # every layout trains to step 3 and saves (ep2x2: to the end); the runs of one world share one launch of its
    # processes (start-up is most of a run's time on a CPU)
    saved = _by_world({name: (LAYOUTS[name][0], _spec(name, steps=STEPS if name == "ep2x2" else SAVE,
                                                       save_after=SAVE, ckpt_dir=dirs[name])) for name in LAYOUTS})
    to_universal(*(os.path.join(dirs[n], f"global_step{SAVE}") for n in LAYOUTS))
    dumps = {(s, t): str(base / f"loaded-{s}-{t}") for s, t in LEGS}

    def resume(source: str, target: str):
        world = LAYOUTS[target][0]
        changes = LAYOUTS[source][0] != world
        return world, _spec(target, resume_from=dirs[source], extra_config=UNIVERSAL if changes else {},
                            step_hook=functools.partial(dump_expert_state, dumps[(source, target)]))

    continued = _by_world({(s, t): resume(s, t) for s, t in LEGS})
    return {"saved": saved, "continued": continued, "dirs": dirs, "dumps": dumps}


def _by_world(runs):
    """``{key: (world, spec)}`` -> ``{key: results}``, one launch per world size, in the order given."""
    out = {}
    for world in dict.fromkeys(w for w, _ in runs.values()):
        keys = [k for k, (w, _) in runs.items() if w == world]
        for key, result in zip(keys, run_specs(world, [runs[k][1] for k in keys])):
            out[key] = result
    return out


LEGS = [("ep2x2", "ep4"), ("ep2x2", "two"), ("ep2x2", "one"), ("ep4", "ep2x2"), ("two", "ep2x2"), ("one", "ep2x2")]


@pytest.mark.parametrize("source,target", LEGS, ids=[f"{s}-to-{t}" for s, t in LEGS])
def test_a_leg_continues_the_run_that_did_not_stop(legs, source, target):
    reference = legs["saved"]["ep2x2"]
    assert reference[0]["hecate_stats"]["expert_data_parallel_size"] == 2
    before = _global_losses(legs["saved"][source])[:SAVE]
    after = _global_losses(legs["continued"][(source, target)])
    losses = torch.cat([before, after])
    expected = _global_losses(reference)
    rel = ((losses - expected).abs() / expected.abs()).max().item()
    assert rel <= 1e-5, (source, target, losses.tolist(), expected.tolist())
    last = legs["continued"][(source, target)][0]
    for name, value in reference[0]["experts"].items():
        assert torch.allclose(value, last["experts"][name], atol=1e-4), (source, target, name)
    for name, value in reference[0]["dense"].items():
        assert torch.allclose(value, last["dense"][name], atol=1e-4), (source, target, name)
    stats = last["hecate_stats"]
    world, ep_size = LAYOUTS[target]
    assert stats["ep_size"] == (ep_size or world) and stats["world_size"] == world


@pytest.mark.parametrize("source,target", LEGS, ids=[f"{s}-to-{t}" for s, t in LEGS])
def test_every_expert_arrives_with_its_optimizer_state(legs, source, target):
    tag_dir = os.path.join(legs["dirs"][source], f"global_step{SAVE}")
    assert_loaded_every_expert(legs["dumps"][(source, target)], LAYOUTS[target][0], tag_dir, f"{source}->{target}")
