"""DeepSpeed's universal-checkpoint route for changing the world size, with Hecate's experts riding along, down and up:
4 -> 2 -> 1 and 1 -> 2 -> 4 ranks (``ds_to_universal`` after each save, ``checkpoint.load_universal`` to load),
optimizer state included. Each leg trains on with the losses of the 4-rank run that never changed size (same global
batches, laid out for 4 data ranks), and every rank that loads holds exactly the saved experts with their Adam
state."""
from __future__ import annotations

import functools
import os
from dataclasses import replace

import pytest
import torch

from moe_training import Spec, run_specs
from resume_checks import assert_loaded_every_expert, dump_expert_state, to_universal

# aux loss off: it is computed per micro-batch, so merging two ranks' batches into one would change it.
RESIZE = Spec(steps=9, aux_coef=0.0, forced_routes=True, virtual_ranks=4, gate_bias=(2.0, 2.0) + (0.0,) * 6,
              hecate={"enabled": True, "placement": "hecate", "overlap_degree": 1, "reshard_interval": 2})
UNIVERSAL = {"checkpoint": {"load_universal": True}}
FIRST, SECOND = 3, 6   # the legs: steps [0, 3) [3, 6) [6, 9)


def _global_losses(results) -> torch.Tensor:
    return torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    base = tmp_path_factory.mktemp("universal")
    down, up = str(base / "down"), str(base / "up")
    dumps = {key: str(base / f"loaded-{key}") for key in ("down2", "up2", "down1", "up4")}

    def resumed(ckpt, steps, dump, **kw):
        return replace(RESIZE, steps=steps, resume_from=ckpt, extra_config=UNIVERSAL,
                       step_hook=functools.partial(dump_expert_state, dump), **kw)

    four = run_specs(4, [replace(RESIZE, save_after=FIRST, ckpt_dir=down)])[0]   # also the reference
    one = run_specs(1, [replace(RESIZE, steps=FIRST, save_after=FIRST, ckpt_dir=up)])[0]
    to_universal(os.path.join(down, f"global_step{FIRST}"), os.path.join(up, f"global_step{FIRST}"))
    assert open(os.path.join(down, "latest_universal")).read().strip() == f"global_step{FIRST}_universal"
    two_down, two_up = run_specs(2, [resumed(down, SECOND, dumps["down2"], save_after=SECOND, ckpt_dir=down),
                                     resumed(up, SECOND, dumps["up2"], save_after=SECOND, ckpt_dir=up)])
    to_universal(os.path.join(down, f"global_step{SECOND}"), os.path.join(up, f"global_step{SECOND}"))
    one_down = run_specs(1, [resumed(down, RESIZE.steps, dumps["down1"])])[0]
    four_up = run_specs(4, [resumed(up, RESIZE.steps, dumps["up4"])])[0]
    return {"four": four, "down": [four, two_down, one_down], "up": [one, two_up, four_up], "dirs": (down, up),
            "dumps": dumps}


@pytest.mark.parametrize("direction", ["down", "up"])
def test_resized_legs_follow_the_run_that_never_changed_size(chains, direction):
    reference = _global_losses(chains["four"])
    assert chains["four"][0]["hecate_stats"]["reshards"] >= 1
    legs = chains[direction]
    # the down chain starts with the reference run itself, up to its save
    losses = torch.cat([_global_losses(legs[0])[:FIRST]] + [_global_losses(leg) for leg in legs[1:]])
    assert len(losses) == RESIZE.steps, [len(leg[0]["losses"]) for leg in legs]
    rel = ((losses - reference).abs() / reference.abs()).max().item()
    sizes = " -> ".join(str(len(leg)) for leg in legs)
    print(f"\n{sizes} ranks through universal checkpoints: worst loss rel. diff vs the 4-rank run {rel:.1e}")
    assert rel <= 1e-5, (direction, losses.tolist(), reference.tolist())
    last = legs[-1]
    for name, value in chains["four"][0]["experts"].items():
        assert torch.allclose(value, last[0]["experts"][name], atol=1e-4), (direction, name)
    for name, value in chains["four"][0]["dense"].items():
        assert torch.allclose(value, last[0]["dense"][name], atol=1e-4), (direction, name)


@pytest.mark.parametrize("leg,world,source", [("down2", 2, ("down", FIRST)), ("up2", 2, ("up", FIRST)),
                                              ("down1", 1, ("down", SECOND)), ("up4", 4, ("up", SECOND))])
def test_every_expert_arrives_with_its_optimizer_state(chains, leg, world, source):
    down, up = chains["dirs"]
    tag_dir = os.path.join(down if source[0] == "down" else up, f"global_step{source[1]}")
    assert_loaded_every_expert(chains["dumps"][leg], world, tag_dir, leg)
