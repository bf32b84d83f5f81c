#!/usr/bin/env python
"""Proof by mutation: each mutation plants one known bug in a copy of the repository and runs the tests that are
supposed to catch it. A mutation the tests do not catch (they pass) *survives*, and this script exits non-zero.

    python tests/mutations/run.py                  # every mutation, each against its tests in TESTS_FOR
    python tests/mutations/run.py --only NAME      # one mutation (repeat --only for several)
    python tests/mutations/run.py --list           # the mutations, their files and their tests
    python tests/mutations/run.py --tests-from-map # the default: each mutation's tests come from TESTS_FOR
    python tests/mutations/run.py --only NAME --tests tests/test_x.py::test_y   # other tests, same mutation

For each mutation: the working tree (without .git and build outputs) is copied to a temporary directory, the
mutation's exact text replacements are applied to one source file of the copy (a snippet that is not found exactly
once is a *stale* mutation and fails loudly: update it to the code), and ``python -m pytest -x`` runs the named node
ids with the copy as working directory and first on PYTHONPATH (checked: the copy's ``ds_hecate`` is the one
imported), OMP_NUM_THREADS=1, DS_ACCELERATOR=cpu. First the same tests run once on an unmutated copy (the baseline:
they must pass, or a "kill" would mean nothing; ``--no-baseline`` skips it). Results: a Markdown table mutation ->
failing tests -> killed/survived and the time of each run.

The mutations and their expected killers live in ``catalog.py`` (:data:`TESTS_FOR`); update it as tests are added.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from catalog import MUTATIONS, TESTS_FOR, Mutation   # the mutations and their killers (data)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Not copied: version control, build outputs and caches (the copy needs sources, tests, docs and configs only).
IGNORE = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
                                ".benchmarks", "*.pyc")


# -- mechanics ---------------------------------------------------------------------------------------------------
class StaleMutation(RuntimeError):
    pass


def apply(mutation: Mutation, root: str) -> None:
    """Apply ``mutation`` to the copy at ``root``; raise :class:`StaleMutation` unless every snippet is found once."""
    path = os.path.join(root, mutation.file)
    if not os.path.isfile(path):
        raise StaleMutation(f"{mutation.name}: {mutation.file} does not exist")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for i, (old, new) in enumerate(mutation.edits):
        found = text.count(old)
        if found != 1:
            raise StaleMutation(f"{mutation.name}: snippet {i + 1} occurs {found} times in {mutation.file} (must be "
                                f"exactly once); the code changed, update the mutation:\n{old}")
        text = text.replace(old, new)
    compile(text, path, "exec")  # a mutation that does not parse would 'kill' every test: refuse it
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def copy_tree(prefix: str) -> str:
    root = tempfile.mkdtemp(prefix=f"hecate-mutation-{prefix}-")
    dst = os.path.join(root, "repo")
    shutil.copytree(REPO, dst, ignore=IGNORE, symlinks=True)
    return dst


def environment(root: str, extra: Dict[str, str]) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests")] +
                                              ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
                "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONDONTWRITEBYTECODE": "1"})
    env.update(extra)
    return env


def check_imports_copy(root: str, env: Dict[str, str]) -> None:
    """The copy's ds_hecate must be the one imported (an editable install of the original must not win)."""
    out = subprocess.run([sys.executable, "-c", "import ds_hecate, os; print(os.path.realpath(ds_hecate.__file__))"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    where = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    if not where.startswith(os.path.realpath(root)):
        raise RuntimeError(f"the copy at {root} imports ds_hecate from {where}, not from the copy")


@dataclass
class Outcome:
    name: str
    tests: List[str]
    failing: List[str]
    verdict: str          # killed / survived / killed (timeout) / ERROR: ...
    seconds: float
    tail: str = ""
    reason: str = ""      # the first assertion line (``E ...``) pytest printed: why the tests failed


def _failing_from_junit(path: str) -> List[str]:
    if not os.path.isfile(path):
        return []
    failing = []
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            module = case.get("classname", "").replace(".", "/")
            failing.append(f"{module}.py::{case.get('name')}")
    return failing


def stale_snippets(mutations: Sequence[Mutation]) -> List[str]:
    """A line for every snippet that does not occur exactly once in its file (the code moved under the mutation)."""
    stale = []
    for m in mutations:
        with open(os.path.join(REPO, m.file), encoding="utf-8") as f:
            text = f.read()
        stale += [f"{m.name}: snippet {i + 1} found {text.count(old)} times in {m.file}"
                  for i, (old, _) in enumerate(m.edits) if text.count(old) != 1]
    return stale


def run_tests(root: str, tests: Sequence[str], env: Dict[str, str], timeout_s: float, label: str) -> Outcome:
    junit = os.path.join(os.path.dirname(root), "junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # pytest and the ranks it spawned (its own session)
        out, _ = proc.communicate()
        timed_out = True
    seconds = time.monotonic() - start
    failing = _failing_from_junit(junit)
    tail = "\n".join((out or "").strip().splitlines()[-15:])
    if timed_out:
        verdict = "killed (suite timeout)"
    elif proc.returncode == 0:
        verdict = "survived"
    elif proc.returncode == 1:
        verdict = "killed"
    else:  # 2 interrupted / collection error, 4 usage error, 5 no tests collected: the selection is wrong
        verdict = f"ERROR: pytest exit code {proc.returncode}"
    if verdict == "killed" and any(line.startswith("E ") and "did not finish within" in line
                                   for line in (out or "").splitlines()):   # dist_utils' watchdog message
        verdict = "killed (hang caught by the watchdog)"
    # The first error line of the failure, skipping run_ranks' "rank N failed:" header (the rank's own traceback
    # follows it).
    lines = [line[1:].strip() for line in (out or "").splitlines() if line.startswith("E ") and line[1:].strip()]
    errors = [line for line in lines if ("Error" in line or "assert" in line or "Exception" in line)
              and not re.search(r"rank \d+ failed:$", line) and not line.startswith(("File ", "Traceback"))]
    reason = (errors or lines or [""])[0]
    return Outcome(label, list(tests), failing, verdict, seconds, tail, reason[:160])


def run_mutation(mutation: Mutation, tests: Sequence[str], timeout_s: float, keep: bool) -> Outcome:
    root = copy_tree(mutation.name)
    try:
        try:
            apply(mutation, root)
        except StaleMutation as exc:
            return Outcome(mutation.name, list(tests), [], f"ERROR: stale mutation ({exc})", 0.0)
        env = environment(root, mutation.env)
        check_imports_copy(root, env)
        return run_tests(root, tests, env, timeout_s, mutation.name)
    finally:
        if keep:
            print(f"  (copy kept at {root})", flush=True)
        else:
            shutil.rmtree(os.path.dirname(root), ignore_errors=True)


def baseline(tests: Sequence[str], timeout_s: float) -> Outcome:
    """The selected tests on an unmutated copy: they must pass for any kill to mean something."""
    root = copy_tree("baseline")
    try:
        env = environment(root, {})
        check_imports_copy(root, env)
        return run_tests(root, tests, env, timeout_s, "(baseline, no mutation)")
    finally:
        shutil.rmtree(os.path.dirname(root), ignore_errors=True)


def table(outcomes: Sequence[Outcome]) -> str:
    lines = ["| mutation | file | tests run | failing tests | result | time | first failure line |",
             "|---|---|---|---|---|---|---|"]
    files = {m.name: m.file for m in MUTATIONS}
    for o in outcomes:
        tests = "<br>".join(t.replace("tests/", "") for t in o.tests)
        failing = "<br>".join(t.replace("tests/", "") for t in o.failing) or "-"
        reason = o.reason.replace("|", "\\|").replace("`", "'") or "-"
        lines.append(f"| {o.name} | {files.get(o.name, '-')} | {tests} | {failing} | {o.verdict} | {o.seconds:.0f} s "
                     f"| `{reason}` |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this mutation (repeatable, or comma-separated)")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    parser.add_argument("--tests-from-map", action="store_true",
                        help="each mutation runs its node ids from TESTS_FOR (the default; --tests overrides it)")
    parser.add_argument("--tests", nargs="+", metavar="NODEID",
                        help="run these node ids against every selected mutation instead of TESTS_FOR's")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest run (default 3600)")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies (printed) for debugging")
    args = parser.parse_args(argv)

    names = [n for item in args.only for n in item.split(",") if n]
    known = {m.name: m for m in MUTATIONS}
    missing_map = sorted(set(known) ^ set(TESTS_FOR))
    if missing_map:
        print(f"MUTATIONS and TESTS_FOR disagree on: {missing_map}", file=sys.stderr)
        return 2
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"unknown mutation(s) {unknown}; known: {sorted(known)}", file=sys.stderr)
        return 2
    selected = [known[n] for n in names] if names else list(MUTATIONS)
    tests_of = {m.name: (list(args.tests) if args.tests else list(TESTS_FOR[m.name])) for m in selected}

    if args.list:
        for m in selected:
            print(f"{m.name}  ({m.file}{', env ' + str(m.env) if m.env else ''})\n    {m.what}")
            for t in tests_of[m.name]:
                print(f"    - {t}")
        return 0

    # Stale snippets fail before anything runs.
    stale = stale_snippets(selected)
    if stale:
        print("STALE MUTATIONS (update them to the code):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 2

    outcomes: List[Outcome] = []
    if not args.no_baseline:
        union = list(dict.fromkeys(t for m in selected for t in tests_of[m.name]))
        print(f"baseline: {len(union)} test id(s) on an unmutated copy ...", flush=True)
        base = baseline(union, args.timeout)
        print(f"  {base.verdict.replace('survived', 'passed')} in {base.seconds:.0f} s", flush=True)
        if base.verdict != "survived":
            print(f"the selected tests do not pass without a mutation; fix them first:\n{base.tail}", file=sys.stderr)
            return 2
    for m in selected:
        print(f"{m.name}: {m.file} -> {len(tests_of[m.name])} test id(s) ...", flush=True)
        outcome = run_mutation(m, tests_of[m.name], args.timeout, args.keep)
        print(f"  {outcome.verdict} in {outcome.seconds:.0f} s; failing: {outcome.failing or '-'}"
              f"{'; ' + outcome.reason if outcome.reason else ''}", flush=True)
        if outcome.verdict.startswith("ERROR") or outcome.verdict == "survived":
            print("  " + outcome.tail.replace("\n", "\n  "), flush=True)
        outcomes.append(outcome)
    print()
    print(table(outcomes))
    bad = [o.name for o in outcomes if o.verdict == "survived" or o.verdict.startswith("ERROR")]
    if bad:
        print(f"\n{len(bad)} mutation(s) not killed: {', '.join(bad)}")
        return 1
    print(f"\nall {len(outcomes)} mutation(s) killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
