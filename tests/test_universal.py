"""DeepSpeed's universal-checkpoint route for changing the world size, with Hecate's experts riding along:
save on 4 ranks, ``ds_to_universal``, load with ``checkpoint.load_universal`` on 2 and on 1 rank, and train on
with the losses of the run that never changed size (same global batches, laid out for 4 data ranks)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import torch

from moe_training import Spec, run_specs

# aux loss off: it is computed per micro-batch, so merging two ranks' batches into one would change it.
RESIZE = Spec(steps=10, aux_coef=0.0, forced_routes=True, virtual_ranks=4, gate_bias=(2.0, 2.0) + (0.0,) * 6,
              hecate={"enabled": True, "placement": "hecate", "overlap_degree": 1, "reshard_interval": 2})


def _global_losses(results, first: int) -> torch.Tensor:
    return torch.tensor([r["losses"][first:] for r in results], dtype=torch.float64).mean(0)


def test_save_on_4_ranks_load_universal_on_2_and_1(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    four = run_specs(4, [replace(RESIZE, save_after=5, ckpt_dir=ckpt)])[0]
    assert four[0]["hecate_stats"]["reshards"] >= 1
    convert = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                              os.path.join(ckpt, "global_step5"), "--output_folder",
                              os.path.join(ckpt, "global_step5_universal"), "--inject_missing_state"],
                             capture_output=True, text=True, timeout=300)
    assert convert.returncode == 0, convert.stdout + convert.stderr
    assert open(os.path.join(ckpt, "latest_universal")).read().strip() == "global_step5_universal"
    reference = _global_losses(four, 5)
    universal = replace(RESIZE, resume_from=ckpt, extra_config={"checkpoint": {"load_universal": True}})
    for world in (2, 1):
        resumed = run_specs(world, [universal])[0]
        losses = _global_losses(resumed, 0)
        assert len(losses) == 5
        rel = ((losses - reference).abs() / reference.abs()).max().item()
        print(f"\n{world} rank(s) after universal load: worst loss rel. diff vs the 4-rank run {rel:.1e}")
        assert rel <= 1e-5, (world, losses.tolist(), reference.tolist())
        for name, value in four[0]["experts"].items():
            assert torch.allclose(value, resumed[0]["experts"][name], atol=1e-4), (world, name)
