"""tests/dist_utils.py, the harness every multi-rank test runs on: ranks forked from a server that imported torch and
DeepSpeed once must still start as a launcher's would, with the caller's environment of the moment, DeepSpeed's CPU
accelerator and nothing of ds_hecate loaded, and the watchdog must still fail a hang."""
from __future__ import annotations

import os
import sys

import pytest

import dist_utils


def _what_a_rank_sees(rank: int, world_size: int) -> dict:
    return {"marker": os.environ.get("DS_HECATE_TEST_MARKER"), "rank": os.environ["RANK"],
            "world": os.environ["WORLD_SIZE"], "threads": os.environ["OMP_NUM_THREADS"],
            "ds_hecate_loaded": any(name == "ds_hecate" or name.startswith("ds_hecate.") for name in sys.modules),
            "accelerator": _accelerator()}


def _accelerator() -> str:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name()


def test_ranks_get_the_callers_environment_at_the_start_of_each_run(monkeypatch):
    monkeypatch.setenv("DS_HECATE_TEST_MARKER", "first")
    first = dist_utils.run_ranks(2, _what_a_rank_sees)
    monkeypatch.setenv("DS_HECATE_TEST_MARKER", "second")   # after the fork server started
    second = dist_utils.run_ranks(2, _what_a_rank_sees)
    assert [r["marker"] for r in first] == ["first", "first"]
    assert [r["marker"] for r in second] == ["second", "second"]
    assert [(r["rank"], r["world"], r["threads"]) for r in second] == [("0", "2", "1"), ("1", "2", "1")]
    # the oracle's ranks must be DeepSpeed alone: the fork server preloads torch and DeepSpeed, not ds_hecate
    assert not any(r["ds_hecate_loaded"] for r in first + second)
    # DeepSpeed, preloaded by the server, chose its accelerator as a rank would (DS_ACCELERATOR=cpu)
    assert [r["accelerator"] for r in first + second] == ["cpu"] * 4


def _sleep_forever(rank: int, world_size: int) -> None:
    import time
    time.sleep(60)


def test_the_watchdog_fails_a_hang():
    with pytest.raises(AssertionError, match="watchdog"):
        dist_utils.run_ranks(2, _sleep_forever, timeout=2)
