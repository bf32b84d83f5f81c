"""fp16 overflow in expert gradients is reported as DeepSpeed reports an overflow (issue 43): rank 0 logs one line per
skipped step whose expert gradients were non-finite on some rank, with their count over the ranks; the other ranks
log nothing; each rank's statistics name its own experts (``last_nonfinite_grads``) and count the steps. Two cases:
ZeRO-2's loss-scale warm-up (an initial scale of 2^24: every step here overflows, DeepSpeed's check on the dense
gradients skips it before any norm is computed), and ZeRO-0 with one expert gradient made Inf on rank 0 at step 2
(DeepSpeed skips it through the norm, which includes the experts)."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from dist_utils import run_ranks
from moe_training import Spec, train

FP16 = Spec(steps=4, tokens=16, layers=2, num_experts=4, fp16=True, hecate={"enabled": True})
CASES = {"zero2-warmup": replace(FP16, stage=2, initial_scale_power=24),
         "zero0-inf": replace(FP16, stage=0, inject_inf_step=2)}


def _train_capturing_logs(rank: int, world: int, specs: dict) -> dict:
    import ds_hecate  # noqa: F401  (its logger)

    out = {}
    for name, spec in specs.items():
        lines = []

        class Capture(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())

        handler = Capture()
        logging.getLogger("ds_hecate").addHandler(handler)
        try:
            result = train(rank, world, spec)
        finally:
            logging.getLogger("ds_hecate").removeHandler(handler)
        out[name] = {"lines": [line for line in lines if "non-finite" in line], "skipped": result["skipped"],
                     "stats": result["hecate_stats"]}
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(2, _train_capturing_logs, CASES, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_one_line_per_skipped_step_from_rank_0(runs, name):
    zero, one = runs[0][name], runs[1][name]
    assert zero["skipped"] >= 1, zero
    reported = zero["stats"]["nonfinite_grad_steps_any_rank"]
    assert 1 <= reported <= zero["skipped"], zero["stats"]
    assert one["stats"]["nonfinite_grad_steps_any_rank"] == reported, one["stats"]
    assert len(zero["lines"]) == reported, zero["lines"]
    assert all("skipped" in line and "expert(s) over the ranks" in line for line in zero["lines"]), zero["lines"]
    assert one["lines"] == [], one["lines"]


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_names_its_own_experts_in_the_statistics(runs, name):
    """Warm-up: every rank's experts overflowed; the injected Inf: rank 0's expert only."""
    for rank in (0, 1):
        stats = runs[rank][name]["stats"]
        if rank == 1 and name == "zero0-inf":
            assert stats["nonfinite_grad_steps"] == 0 and stats["last_nonfinite_grads"] is None, stats
            continue
        assert stats["nonfinite_grad_steps"] >= 1, stats
        named = stats["last_nonfinite_grads"]["experts"]
        assert named and all(" expert " in n for n in named), stats["last_nonfinite_grads"]
