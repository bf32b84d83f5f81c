"""Bad numbers at an MoE layer stop every rank at the same collective with an error naming the layer and the rank,
instead of one rank failing while the others wait forever."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks


class _OutOfRangeGate(torch.nn.Module):
    """A gate whose sparse routes name an expert that does not exist."""

    def __init__(self, gate) -> None:
        super().__init__()
        self.inner = gate

    def forward(self, x, used_token=None, sparse_routes=False, use_tutel=False):
        l_aux, cap, num_e, indices, locations, gates, counts = self.inner(x, used_token, sparse_routes, use_tutel)
        return l_aux, cap, num_e, torch.full_like(indices, num_e), locations, gates, counts


def _bad_numbers_worker(rank: int, world: int, fault: str) -> str:
    import torch.distributed as dist
    from torch import nn

    import ds_hecate
    from ds_hecate.config import HecateConfig
    from ds_hecate.deepspeed_glue.convert import take_over_layer
    from ds_hecate.errors import HecateError
    from ds_hecate.deepspeed_glue.initialize import build_runtime

    dist.init_process_group("gloo")
    runtime = build_runtime(HecateConfig(enabled=True, placement="hecate"), {})
    torch.manual_seed(0)
    layer = ds_hecate.MoE(8, nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), num_experts=4, k=2,
                          drop_tokens=False, min_capacity=0)
    take_over_layer("blocks.3.moe", layer, runtime)
    x = torch.randn(16, 8)
    if fault == "nan" and rank == 1:
        x[3, 2] = float("nan")
    if fault == "out-of-range" and rank == 0:
        layer.gate = _OutOfRangeGate(layer.gate)
    try:
        layer(x)
    except HecateError as exc:
        return str(exc)
    return "NO ERROR"


@pytest.mark.parametrize("fault,rank_text", [("nan", "non-finite gate values (NaN/Inf) on rank(s) [1]"),
                                              ("out-of-range", "expert indices outside [0, 4) on rank(s) [0]")])
def test_bad_numbers_stop_every_rank_with_the_layer_named(fault, rank_text):
    messages = run_ranks(2, _bad_numbers_worker, fault, timeout=120)
    for message in messages:
        assert "MoE layer 'blocks.3.moe'" in message and rank_text in message, message


# -- a rank killed (kill -9) in each phase ---------------------------------------------------------------------------
TIMEOUT_S = 20.0
KILL_PHASES = ("forward", "backward", "sparse-collective", "save")


def _die(stamp: str) -> None:
    import os
    import signal
    import time

    with open(stamp, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_kill(phase: str, stamp: str, ckpt: str, kill_step: int, rank: int, step: int, engine) -> None:
    """Step hook: at ``kill_step`` rank 1 arranges to SIGKILL itself inside ``phase``."""
    if step != kill_step:
        return
    if rank == 1:
        import ds_hecate.deepspeed_glue.checkpoint as checkpoint
        from ds_hecate.comm.collectives import Communicator
        from ds_hecate.runtime.layer import LayerBinding

        if phase == "forward":  # on entering the second MoE layer
            run = LayerBinding.run
            LayerBinding.run = lambda self, *a: _die(stamp) if self.shard.layer_id == 1 else run(self, *a)
        elif phase == "backward":  # while returning the second layer's gradients (first MoE backward)
            LayerBinding.reduce_scatter = lambda self, *a: _die(stamp)
        elif phase == "sparse-collective":  # about to send its experts in a SparseAllGather
            exchange = Communicator.exchange_chunks

            def dying_exchange(self, *args):
                if args[-1] == "SparseAllGather":
                    _die(stamp)
                return exchange(self, *args)
            Communicator.exchange_chunks = dying_exchange
        else:  # writing its first expert file of the save
            checkpoint._atomic_torch_save = lambda obj, path: _die(stamp)
    if phase == "save":
        engine.save_checkpoint(ckpt)


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """One 2-rank run per phase: checkpoint after 2 steps, rank 1 killed in step 3."""
    import functools
    from dataclasses import replace

    from dist_utils import run_ranks_until_exit
    from moe_training import train
    from test_checkpoint import SCHEDULED

    out = {}
    for phase in KILL_PHASES:
        base = tmp_path_factory.mktemp(phase.replace("-", "_"))
        ckpt, stamp = str(base / "ckpt"), str(base / "killed_at")
        spec = replace(SCHEDULED, steps=4, save_after=2, ckpt_dir=ckpt,
                       hecate={**SCHEDULED.hecate, "collective_timeout_s": TIMEOUT_S},
                       step_hook=functools.partial(_arm_kill, phase, stamp, ckpt, 2))
        ranks = run_ranks_until_exit(2, train, spec, timeout=TIMEOUT_S + 120)
        killed_at = float(open(stamp).read()) if __import__("os").path.exists(stamp) else None
        out[phase] = {"ranks": ranks, "killed_at": killed_at, "ckpt": ckpt}
    return out


@pytest.mark.parametrize("phase", KILL_PHASES)
def test_survivor_exits_within_the_timeout_naming_the_collective(killed_runs, phase):
    run = killed_runs[phase]
    victim, survivor = run["ranks"][1], run["ranks"][0]
    assert run["killed_at"] is not None and victim["exitcode"] == -9, victim
    assert survivor["exitcode"] not in (None, 0), f"survivor did not fail on its own: {survivor}"
    waited = survivor["exit_time"] - run["killed_at"]
    assert waited <= TIMEOUT_S + 30, f"survivor took {waited:.1f} s to exit"
    last = [line for line in (survivor["payload"] or "").splitlines() if line.strip()][-1:]
    print(f"\n[{phase}] survivor exit code {survivor['exitcode']} after {waited:.1f} s: {last}")
    if phase != "save":  # the survivor is inside one of Hecate's collectives when its peer goes
        assert "HecateCollectiveError: Hecate collective '" in survivor["payload"], survivor["payload"]
        assert "Another rank probably died" in survivor["payload"]


def test_previous_checkpoint_loads_after_each_kill(killed_runs):
    import os
    from dataclasses import replace

    import torch

    from moe_training import run_specs
    from test_checkpoint import SCHEDULED

    for phase, run in killed_runs.items():
        assert open(os.path.join(run["ckpt"], "latest")).read().strip() == "global_step2", phase
    clean = replace(SCHEDULED, steps=2)
    loads = [replace(SCHEDULED, steps=2, resume_from=killed_runs[p]["ckpt"]) for p in KILL_PHASES]
    results = run_specs(2, [clean] + loads)
    for phase, loaded in zip(KILL_PHASES, results[1:]):
        for rank in range(2):
            for name, value in results[0][rank]["experts"].items():
                assert torch.equal(value, loaded[rank]["experts"][name]), (phase, name)
            for name, value in results[0][rank]["dense"].items():
                assert torch.equal(value, loaded[rank]["dense"][name]), (phase, name)


def _poison_expert(rank: int, step: int, engine) -> None:
    """Step hook: before the last step, expert 2 of the last MoE layer (on its owner) becomes NaN."""
    if step == 1:
        shard = engine.hecate.bindings[-1].shard
        if 2 in shard.masters:
            shard.masters[2].data.fill_(float("nan"))


def test_nonfinite_expert_gradients_are_reported_in_the_step_statistics():
    from dataclasses import replace

    from moe_training import run_specs
    from test_checkpoint import SCHEDULED

    spec = replace(SCHEDULED, steps=2, gate_bias=None, step_hook=_poison_expert)
    results = run_specs(2, [spec])[0]
    for r in results:  # the norm (experts included) is not finite: DeepSpeed skips the step, Hecate with it
        assert r["hecate_stats"]["steps_skipped"] == 1 and r["hecate_stats"]["steps_applied"] == 1
    # NaN flows back from the tokens that met the NaN expert: each rank names its own experts that got NaN
    named = set()
    for r in results:
        stats = r["hecate_stats"]
        assert stats["nonfinite_grad_steps"] == 1 and stats["last_nonfinite_grads"]["step"] == 2, stats
        named.update(stats["last_nonfinite_grads"]["experts"])
    assert "blocks.1.moe expert 2" in named, named
