"""Tests that build environments build them from the interpreter they run in (issue 18): the scratch venv of
``test_autoload`` must see DeepSpeed whether the suite runs on a plain interpreter, in a venv or in a conda env.

Checked both ways: from the interpreter running this test, and from inside a venv that holds a package the base
interpreter does not have (where ``--system-site-packages`` loses it, which is the bug this guards against).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from venv_utils import chained_venv, venv_python

HERE = Path(__file__).resolve().parent
MARKER = "ds_hecate_env_marker"


def _imports(python: Path, module: str) -> bool:
    proc = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    return proc.returncode == 0


def test_chained_venv_sees_the_running_interpreters_packages(tmp_path):
    python = chained_venv(tmp_path / "env")
    probe = "import sys, deepspeed, torch; print(sys.prefix)"
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("env"), proc.stdout  # the scratch venv is the prefix, not the parent


def test_chained_venv_from_inside_a_venv_sees_that_venv(tmp_path):
    outer = chained_venv(tmp_path / "outer")  # a user's venv: it holds a package nothing else has
    site = subprocess.run([str(outer), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True, timeout=120).stdout.strip()
    Path(site, f"{MARKER}.py").write_text("VALUE = 18\n", encoding="utf-8")
    assert _imports(outer, MARKER)
    # From inside that venv, build a scratch env the way the tests do, and the way they used to.
    build = ("import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
             "from venv_utils import chained_venv; chained_venv(Path(sys.argv[2]))")
    subprocess.run([str(outer), "-c", build, str(HERE), str(tmp_path / "inner")], check=True, timeout=600)
    inner = venv_python(tmp_path / "inner")
    assert _imports(inner, MARKER), "a venv built from inside a venv must see that venv's packages"
    assert _imports(inner, "deepspeed")
    subprocess.run([str(outer), "-m", "venv", "--system-site-packages", str(tmp_path / "old")], check=True,
                   timeout=300)
    assert not _imports(venv_python(tmp_path / "old"), MARKER), \
        "--system-site-packages from a venv was expected to chain to the base interpreter (the bug guarded here)"
