"""The resident compute-dtype expert copies and the persistent gradient accumulator (issue 41).

Every owned expert's weights are kept in the compute dtype (``LayerShard.weight_rows``), what the layer calls
compute from and SparseAllGather sends; they must equal the fp32 masters cast to that dtype whenever a layer call
can read them: after every applied optimizer step, after a checkpoint load and after a re-shard. With fp32 compute
and whole masters the rows *are* the masters, so these checks run bf16 compute (the rows a cast copy) and, for the
re-shard, masters partitioned over the expert-data-parallel peers (the rows an all-gather of the peers' slices).
The expert gradient accumulator (``LayerShard.grads``) is kept across steps: the first contribution of each
accumulation window is written, later ones added, so a run with gradient accumulation must follow DeepSpeed's.

Each test trains with ``deepspeed.initialize`` and the ``hecate`` section (tests/moe_training.py); the rows are
checked on every rank before every optimizer step by a step hook (:func:`check_rows_are_the_masters`). The last test
is a unit test of the accumulator's cached column views (they must follow a freed or replaced accumulator).
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import cast

import pytest
import torch

from moe_training import Spec, run_specs
from resume_checks import assert_resumes_exactly
from trajectory_checks import assert_same_steps, assert_same_trajectory

# One rank, every expert owned by it (placement 'owner'): the cheapest real Hecate training.
ONE_RANK = Spec(steps=3, tokens=16, reseed_each_step=True, hecate={"enabled": True, "placement": "owner"})
BF16 = replace(ONE_RANK, bf16=True)


def check_rows_are_the_masters(rank: int, step: int, engine, changes: bool = True) -> None:
    """Step hook (before step ``step``): every layer's resident rows equal its whole masters cast to the rows'
    dtype, bit for bit (partitioned masters are all-gathered over the peers first: collective, as every rank calls
    the hook). With ``changes``, from the second step on the masters must differ from those of step 0 (the
    check is not vacuous: the optimizer did move them)."""
    from ds_hecate.runtime.edp import whole_masters

    rt = engine.hecate
    for binding in rt.bindings:
        shard = binding.shard
        masters, _ = whole_masters(rt, shard)
        if not shard.owned:
            continue
        whole = torch.stack([masters[e].reshape(-1) for e in shard.owned])
        rows = shard.weight_rows
        where = f"rank {rank} before step {step}: layer '{shard.name}'"
        if rows is None or rows.shape != whole.shape:
            raise _Failed(f"{where}: resident rows {None if rows is None else tuple(rows.shape)}, masters "
                          f"{tuple(whole.shape)}")
        expected = whole.to(rows.dtype)
        bad = (rows != expected).any(1).nonzero().flatten().tolist()
        if bad:
            diff = (rows.float() - expected.float()).abs().max().item()
            raise _Failed(f"{where}: the resident rows of experts {[shard.owned[i] for i in bad]} are not the "
                          f"masters cast to {rows.dtype} (max diff {diff:.3e})")
        first = _FIRST.setdefault((id(engine), shard.name), {e: m.clone() for e, m in masters.items()})
        if changes and step > 0 and all(e in first for e in masters) and \
                all(torch.equal(first[e], m) for e, m in masters.items()):
            raise _Failed(f"{where}: the masters never changed")


#: AssertionError under a name without "assert" or "Error": a rank's traceback then shows the message as the first
#: failure line pytest prints (what tests/mutations/run.py reports), not the raising source line
_Failed = AssertionError
#: (engine, layer) -> whole masters seen at the first check, in each rank process
_FIRST: dict = {}


def test_bf16_compute_copies_follow_every_optimizer_step():
    """bf16 compute on one rank: before every step the resident rows are the updated masters in bf16."""
    run = run_specs(1, [replace(BF16, step_hook=check_rows_are_the_masters)])[0]
    stats = run[0]["hecate_stats"]
    assert stats["steps_applied"] == BF16.steps, stats["steps_applied"]


def test_bf16_resume_refills_compute_copies(tmp_path):
    """bf16, one rank: a run resumed from step 2 (its engine built with the initial weights, then loaded) computes
    from the loaded masters (rows checked before each resumed step) and equals the run that never stopped, bit for
    bit."""
    ckpt = str(tmp_path / "ckpt")
    spec = replace(BF16, steps=4, step_hook=functools.partial(check_rows_are_the_masters, changes=False))
    straight, resumed = run_specs(1, [replace(spec, save_after=2, ckpt_dir=ckpt), replace(spec, resume_from=ckpt)])
    assert_resumes_exactly(straight, resumed, 2, "bf16 resume")


def _swap_owners_at_reshards(rank: int, step: int, engine) -> None:
    """Step hook: from the first step on, every re-shard the runtime starts (``reshard_interval``) moves every
    expert to the other rank of its group (the planner's choice replaced, so the move does not hang on the loads);
    before every step, the resident rows are checked."""
    from ds_hecate.runtime import resharding

    rt = engine.hecate
    if step == 0:
        resharding.heterogeneous_sharding = lambda *args, **kwargs: [
            tuple(len(set(b.shard.owners)) - 1 - o for o in b.shard.owners) for b in rt.bindings]
    check_rows_are_the_masters(rank, step, engine)


def test_partitioned_reshard_gathers_compute_copies():
    """4 ranks, ``hecate.ep_size`` 2 (two groups, masters partitioned over the two expert-data-parallel peers,
    ZeRO-2), a re-shard after step 2 that moves every expert: the moved experts' resident rows are gathered from
    the peers' slices before the next layer call, and the run keeps following plain DeepSpeed."""
    base = Spec(steps=4, layers=1, tokens=16, num_experts=4, reseed_each_step=True)
    mine = replace(base, step_hook=_swap_owners_at_reshards, hecate={
        "enabled": True, "placement": "hecate", "ep_size": 2, "reshard_interval": 2, "overlap_degree": 1,
        "compute_s_per_pair": 1e-6, "link_gbps": 1.0, "non_moe_time_s": 0.0})
    oracle = run_specs(4, [base])[0]
    run = run_specs(4, [mine])[0]
    stats = run[0]["hecate_stats"]
    assert stats["expert_data_parallel_size"] == 2 and stats["reshards"] == 2, stats["reshards"]
    assert all(len(r["losses"]) == base.steps for r in run)
    assert_same_trajectory(oracle, run, label="partitioned re-shard")


@pytest.mark.parametrize("expert_kind", ["ffn", "generic"])
def test_accumulation_windows_start_from_nothing(expert_kind):
    """Gradient accumulation (3 micro-steps per step, 3 steps) on one rank: after every step the experts equal
    plain DeepSpeed's, so no window's first micro-step adds onto what the persistent accumulator held. Both ways a
    window's first gradients arrive: the grouped FFN path writes them into the accumulator's columns, the generic
    experts' loop hands them to the SparseReduceScatter, which adds them in (``comm.buffers.add_into``)."""
    base = replace(ONE_RANK, gas=3, per_step_state=True, hecate=None, expert_kind=expert_kind)
    oracle = run_specs(1, [base])[0]
    mine = run_specs(1, [replace(base, hecate=ONE_RANK.hecate)])[0]
    assert_same_steps(oracle, mine, label=f"gas 3, {expert_kind} experts")


def test_accumulator_column_views_follow_a_replaced_or_freed_accumulator():
    """The column views the expert compute writes weight gradients into are made once per accumulator: when the
    accumulator is freed (partitioned masters, after each window's reduction) or replaced (a re-shard or a load
    lays the masters out anew), the next view must be of the new rows, not of the old ones it would keep alive."""
    from ds_hecate.experts import ExpertKernel, SwiGLUExpert
    from ds_hecate.runtime.shard_store import LayerShard, ShardAccumulator
    kernel = ExpertKernel(SwiGLUExpert(8, 16))
    shard = LayerShard(layer_id=0, name="moe", num_experts=2, kernel=kernel, owners=(0, 0), rank=0)
    shard.set_masters({e: torch.randn(kernel.numel) for e in (0, 1)})
    target = ShardAccumulator(shard, torch.device("cpu"))
    lo, hi = shard.param_columns("w2.weight")
    first = target.columns_view(lo, hi, (8, 16))
    assert shard.grads is not None
    assert first.data_ptr() == shard.grads[:, lo:].data_ptr()
    assert target.columns_view(lo, hi, (8, 16)) is first   # made once per accumulator
    for replaced in (False, True):
        old = shard.grads
        shard.grads = None   # freed after a window's reduction over the peers
        if replaced:
            shard.accumulator_rows(torch.device("cpu"))   # a new accumulator before the next view
        view = target.columns_view(lo, hi, (8, 16))
        assert shard.grads is not old
        grads = cast(torch.Tensor, shard.grads)   # the accumulator the view made (typed None since the line above)
        assert view.data_ptr() == grads[:, lo:].data_ptr()
        view.fill_(1.0)
        assert bool((grads[:, lo:hi] == 1.0).all())
