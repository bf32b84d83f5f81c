"""Bad numbers at an MoE layer stop every rank at the same collective with an error naming the layer and the rank,
instead of one rank failing while the others wait forever."""
from __future__ import annotations

from typing import List, cast

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


@pytest.mark.parametrize("fault,rank_text", [("nan", "non-finite gate values (NaN/Inf) on global rank 1"),
                                              ("out-of-range", "expert indices outside [0, 4) on global rank 0")])
def test_bad_numbers_stop_every_rank_with_the_layer_named(fault, rank_text):
    messages = run_ranks(2, _bad_numbers_worker, fault, timeout=120)
    for message in messages:
        assert "MoE layer 'blocks.3.moe'" in message and rank_text in message, message


# -- a rank killed (kill -9) in each phase ---------------------------------------------------------------------------
TIMEOUT_S = 20.0
KILL_PHASES = ("forward", "backward", "sparse-collective", "save-experts", "save-deepspeed", "reshard")
SAVED_STEP = 2    # every killed run saved global_step2 (complete) before its rank 1 died
KILL_STEP = {"save-experts": 3, "save-deepspeed": 3}   # a save of the NEW tag global_step3; others: step 2
# Costs pinned (configured values win over measured ones): every run schedules alike, so a run resumed from a
# killed run's checkpoint can be compared bit for bit with a run that was never interrupted.
PINNED = {"compute_s_per_pair": 5e-5, "link_gbps": 0.5, "replica_overhead_s": 0.0}


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
        from ds_hecate.comm.collectives import Communicator
        from ds_hecate.runtime.layer import LayerBinding

        if phase == "forward":  # on entering the second MoE layer
            run = LayerBinding.run
            setattr(LayerBinding, "run", lambda self, *a: _die(stamp) if self.shard.layer_id == 1 else run(self, *a))
        elif phase == "backward":  # while returning the second layer's gradients (first MoE backward)
            from ds_hecate.comm.requests import ReduceScatterRequest
            setattr(ReduceScatterRequest, "start", lambda self, *a: _die(stamp))
        elif phase in ("sparse-collective", "reshard"):  # about to send experts (a re-sharding moves them with
            label = "SparseAllGather" if phase == "sparse-collective" else "re-sharding expert move"  # their state)
            exchange = Communicator.exchange_rows

            def dying_exchange(self, *args, **kwargs):
                if label in args:
                    _die(stamp)
                return exchange(self, *args, **kwargs)
            setattr(Communicator, "exchange_rows", dying_exchange)
        elif phase == "save-experts":  # its first expert file written, while writing the second
            from ds_hecate.deepspeed_glue.checkpoint_integrity import DigestingWriter
            write = DigestingWriter.save
            written: List[str] = []

            def dying_write(self, obj, path):
                if written:
                    _die(stamp)
                write(self, obj, path)
                written.append(path)
            setattr(DigestingWriter, "save", dying_write)
        else:  # save-deepspeed: every expert file written, while DeepSpeed writes this rank's optimizer state
            save = engine.checkpoint_engine.save
            engine.checkpoint_engine.save = lambda state, path: (_die(stamp) if "optim_states" in path
                                                                 else save(state, path))
    if phase.startswith("save"):
        engine.save_checkpoint(ckpt)


def _fault_spec(**kw):
    from dataclasses import replace

    from test_checkpoint import SCHEDULED
    pinned = {**cast(dict, SCHEDULED.hecate), **PINNED, "collective_timeout_s": TIMEOUT_S}
    return replace(SCHEDULED, hecate=pinned, **kw)


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """One 2-rank run per phase: checkpoint after 2 steps, then rank 1 killed in step 3 (for 'reshard': in the
    re-sharding that ends step 3; for the saves: saving the new tag global_step3 before step 4)."""
    import functools
    import os

    from dist_utils import run_ranks_until_exit
    from moe_training import train

    out = {}
    for phase in KILL_PHASES:
        base = tmp_path_factory.mktemp(phase.replace("-", "_"))
        ckpt, stamp = str(base / "ckpt"), str(base / "killed_at")
        spec = _fault_spec(steps=5, save_after=SAVED_STEP, ckpt_dir=ckpt,
                           step_hook=functools.partial(_arm_kill, phase, stamp, ckpt, KILL_STEP.get(phase, 2)))
        ranks = run_ranks_until_exit(2, train, spec, timeout=TIMEOUT_S + 120)
        killed_at = float(open(stamp).read()) if os.path.exists(stamp) else None
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
    if phase == "save-deepspeed":  # the survivor waits in DeepSpeed's own barrier at the end of its save, which
        # fails as soon as gloo sees the peer's socket close; nothing names the new checkpoint before it
        assert "save_checkpoint" in survivor["payload"] and "latest" not in last[0], survivor["payload"]
        return
    # the survivor is inside one of Hecate's collectives when its peer goes (saving the experts: the barrier that
    # every rank's expert files are written)
    assert "HecateCollectiveError: Hecate collective '" in survivor["payload"], survivor["payload"]
    assert "Another rank probably died" in survivor["payload"]


def test_a_save_killed_midway_leaves_latest_on_the_last_complete_checkpoint(killed_runs):
    """The dying saves wrote a NEW tag partly: ``latest`` still names the previous, complete one."""
    import os

    for phase, run in killed_runs.items():
        latest = open(os.path.join(run["ckpt"], "latest")).read().strip()
        assert latest == f"global_step{SAVED_STEP}", (phase, latest)
    experts = os.path.join(killed_runs["save-experts"]["ckpt"], "global_step3", "hecate")
    written = [f for f in os.listdir(experts) if f.endswith(".pt")]
    assert 0 < len(written) < 2 * 8, f"the kill did not interrupt the expert files: {written}"
    tag = os.path.join(killed_runs["save-deepspeed"]["ckpt"], "global_step3")
    assert sum(f.endswith(".pt") for f in os.listdir(os.path.join(tag, "hecate"))) == 2 * 8
    assert not os.path.exists(os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))


def test_a_save_killed_midway_is_reported_and_refused_by_tag(killed_runs, capsys):
    """The interrupted tag has no completion mark: ``ds-hecate check`` reports it incomplete (the complete one
    beside it as complete), and loading it explicitly by tag is refused on every rank naming the missing mark."""
    from dist_utils import run_ranks
    from test_checkpoint import _load_tags

    from ds_hecate.tools.cli import main

    loads = []
    for phase in ("save-experts", "save-deepspeed"):
        ckpt = killed_runs[phase]["ckpt"]
        capsys.readouterr()
        assert main(["check", ckpt]) == 1
        out = capsys.readouterr().out
        assert f"global_step{SAVED_STEP} (latest): complete" in out, out
        assert "global_step3: incomplete" in out and "complete.json is missing" in out, out
        loads.append((ckpt, "global_step3"))
    for r in run_ranks(2, _load_tags, loads):
        for message in r["messages"]:
            assert "global_step3 is an incomplete save: hecate/complete.json" in message and "missing" in message, message


def test_last_complete_checkpoint_continues_exactly_after_each_kill(killed_runs, tmp_path):
    """Restarted from ``latest`` after each kill (one in a re-sharding among them), every expert is back with its
    optimizer state and training continues exactly as a run that was never interrupted."""
    import functools
    import os

    from moe_training import run_specs
    from resume_checks import assert_loaded_every_expert, assert_resumes_exactly, dump_expert_state

    clean = _fault_spec(steps=5, per_step_state=True)
    dumps = {p: str(tmp_path / p) for p in KILL_PHASES}
    loads = [_fault_spec(steps=5, per_step_state=True, resume_from=killed_runs[p]["ckpt"],
                         step_hook=functools.partial(dump_expert_state, dumps[p])) for p in KILL_PHASES]
    results = run_specs(2, [clean] + loads)
    assert results[0][0]["hecate_stats"]["reshards"] >= 1   # the continuation re-shards too
    for phase, loaded in zip(KILL_PHASES, results[1:]):
        assert_resumes_exactly(results[0], loaded, SAVED_STEP, phase)
        tag_dir = os.path.join(killed_runs[phase]["ckpt"], f"global_step{SAVED_STEP}")
        assert_loaded_every_expert(dumps[phase], 2, tag_dir, phase)


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


def test_gate_health_check_names_the_flagged_ranks_at_scale():
    """The exchanged health flags of 1,024 ranks: silent when healthy, and every flagged rank named otherwise, by
    its global name."""
    import numpy as np

    from ds_hecate.planning.groups import ExpertGroups
    from ds_hecate.runtime.stops import gate_problem

    groups = ExpertGroups(2048, 1024, 8)
    flags = np.zeros((1024, 2), dtype=np.int64)
    name = lambda i: groups.describe(groups.global_rank(1, i))   # noqa: E731 - group 1's communicator naming
    assert gate_problem(flags, "moe.0", 256, name) is None
    flags[[7, 900], 0] = 1
    flags[1023, 1] = 1
    assert gate_problem(flags, "moe.0", 256, name) == (
        "MoE layer 'moe.0': non-finite gate values (NaN/Inf) on global rank 1031 (group 1, index 7), global rank 1924 "
        "(group 1, index 900) and expert indices outside [0, 256) on global rank 2047 (group 1, index 1023)")
