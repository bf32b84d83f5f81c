"""Every ``ds-hecate`` flag is checked by the command line itself (issue 43): a bad value ends with argparse's usage
line and ``ds-hecate <command>: error: argument <flag>: <what is wrong, what is accepted>``, exit status 2, no
traceback, before any work starts; one case per flag. The routing-workload message is the one docs/troubleshooting.md
lists."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ds_hecate.tools.cli import main

SIM = ["simulate", "--cluster", "cpu-2", "--model", "gpt-moe-s", "--workload", "W0", "--steps", "2"]
PLAN = ["plan", "--model", "gpt-moe-s", "--world-size", "8"]
MISSING = "/nonexistent-ds-hecate-dir"

CASES = {
    # simulate
    "sim-budget-negative": (SIM + ["--materialize-budget-mb", "-100"], "--materialize-budget-mb",
                            "must be between 0 and 1e+09 MiB, got -100"),
    "sim-budget-nan": (SIM + ["--materialize-budget-mb", "nan"], "--materialize-budget-mb",
                       "expected a finite number, got 'nan'"),
    "sim-workload-unknown": (SIM[:6] + ["W9"], "--workload",
                             "unknown routing workload 'W9'; choose one of W0, W1, W2, W3, W4, W5, W6, W7"),
    "sim-workload-trace-missing": (SIM[:6] + [MISSING + "/t.jsonl"], "--workload", "no routing trace file"),
    "sim-cluster": (["simulate", "--cluster", "a100", "--model", "gpt-moe-s", "--workload", "W0"], "--cluster",
                    "unknown cluster 'a100'; choose one of v100-4x8, a100-4x8"),
    "sim-model": (["simulate", "--cluster", "cpu-2", "--model", "gpt", "--workload", "W0"], "--model",
                  "unknown model 'gpt'; choose one of gpt-moe-s"),
    "sim-systems": (SIM + ["--systems", "ep,zero3"], "--systems", "unknown system 'zero3'; choose from ep,"),
    "sim-steps": (SIM[:6] + ["W0", "--steps", "0"], "--steps", "must be a positive integer, got 0"),
    "sim-warmup-negative": (SIM + ["--warmup", "-1"], "--warmup", "must be 0 or a positive integer, got -1"),
    "sim-warmup-not-below-steps": (SIM + ["--warmup", "2"], "--warmup", "must be fewer than --steps (2), got 2"),
    "sim-world-size": (SIM + ["--world-size", "0"], "--world-size", "must be a positive integer, got 0"),
    "sim-tokens": (SIM + ["--tokens-per-rank", "-5"], "--tokens-per-rank", "must be a positive integer, got -5"),
    "sim-ep-size": (SIM + ["--ep-size", "0"], "--ep-size", "must be a positive integer, got 0"),
    "sim-seed": (SIM + ["--seed", "-1"], "--seed", "must be 0 or a positive integer, got -1"),
    "sim-steps-not-int": (SIM + ["--steps", "2.5"], "--steps", "expected an integer, got '2.5'"),
    "sim-config": (SIM + ["--config", MISSING + "/ds.json"], "--config", "no DeepSpeed config file"),
    "sim-measured": (SIM + ["--measured", MISSING + "/m.json"], "--measured", "no measured costs file"),
    "sim-json": (SIM + ["--json", MISSING + "/out.json"], "--json", "no directory"),
    "sim-precision": (SIM + ["--precision", "fp8"], "--precision", "invalid choice: 'fp8'"),
    "sim-call-overhead-fit": (SIM + ["--call-overhead-fit", "gpu"], "--call-overhead-fit",
                              "invalid choice: 'gpu' (choose from"),
    # plan
    "plan-device-memory": (PLAN + ["--device-memory-gb", "-1"], "--device-memory-gb",
                           "must be a positive number, got -1"),
    "plan-world-size-negative": (["plan", "--model", "gpt-moe-s", "--world-size", "-4"], "--world-size",
                                 "must be a positive integer, got -4"),
    "plan-world-size-default-node": (["plan", "--model", "gpt-moe-s", "--world-size", "12"], "--world-size",
                                     "12 must be a multiple of the ranks per node, 8 (the default; set "
                                     "--ranks-per-node)"),
    "plan-world-size-cluster-node": (["plan", "--model", "gpt-moe-s", "--world-size", "12", "--cluster",
                                      "a100-4x8"], "--world-size", "(the devices per node of --cluster a100-4x8)"),
    "plan-ranks-per-node": (PLAN + ["--ranks-per-node", "0"], "--ranks-per-node", "must be a positive integer"),
    "plan-ep-size": (PLAN + ["--ep-size", "-2"], "--ep-size", "must be a positive integer, got -2"),
    "plan-model": (["plan", "--model", "mixtral", "--world-size", "8"], "--model", "unknown model 'mixtral'"),
    "plan-cluster": (PLAN + ["--cluster", "h100"], "--cluster", "unknown cluster 'h100'"),
    "plan-config": (PLAN + ["--config", MISSING + "/ds.json"], "--config", "no DeepSpeed config file"),
    # consolidate, report, export-hf
    "consolidate-dir": (["consolidate", MISSING, "-o", "x.pt"], "checkpoint_dir", "no checkpoint directory"),
    "consolidate-output": (["consolidate", ".", "-o", MISSING + "/x.pt"], "--output/-o", "no directory"),
    "consolidate-layout": (["consolidate", ".", "-o", "x.pt", "--layout", "megatron"], "--layout", "invalid choice"),
    "report-dir": (["report", MISSING], "run_dir", "no run directory"),
    "report-output": (["report", ".", "-o", MISSING + "/plots"], "--output-dir/-o", "cannot create"),
    "export-hf-dir": (["export-hf", MISSING, "-o", "out"], "checkpoint_dir", "no checkpoint directory"),
    "export-hf-output": (["export-hf", ".", "-o", MISSING + "/hf"], "--output/-o", "cannot create"),
    "export-hf-config": (["export-hf", ".", "-o", "out", "--model-config", MISSING], "--model-config",
                         "no model config"),
    "export-hf-dtype": (["export-hf", ".", "-o", "out", "--dtype", "int8"], "--dtype", "invalid choice"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_flag_is_an_argparse_error(name, capsys):
    argv, flag, needle = CASES[name]
    assert main(argv) == 2, name
    err = capsys.readouterr().err
    command = argv[0]
    assert f"usage: ds-hecate {command}" in err, err
    assert f"ds-hecate {command}: error: argument {flag}: " in err, err
    assert needle in err, err
    assert "Traceback" not in err, err


def test_run_time_errors_are_argparse_errors_of_the_command(capsys):
    """What only the work finds out (here: an ep_size that does not divide the world) is reported in the same form,
    naming the key."""
    assert main(SIM + ["--ep-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "ds-hecate simulate: error: hecate.ep_size = 3 must be a positive divisor of the world size 2" in err, err


def test_the_workload_message_is_the_documented_one():
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "troubleshooting.md"), encoding="utf-8").read()
    assert "`unknown routing workload 'X'; choose one of W0, W1, ..., W7" in docs


def test_the_entry_point_exits_2_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "ds_hecate.tools.cli", *SIM, "--materialize-budget-mb", "-100"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "argument --materialize-budget-mb: must be between 0 and 1e+09 MiB" in proc.stderr
    assert "Traceback" not in proc.stderr and "ValidationError" not in proc.stderr, proc.stderr
