"""Scratch virtual environments for tests, built from the interpreter the tests run in.

``python -m venv --system-site-packages`` chains to the *base* interpreter: run from inside a venv (or a conda
env) it does not see that environment's packages (DeepSpeed, torch, ...). :func:`chained_venv` makes a venv whose
own site-packages come first and whose fallback is exactly the running interpreter's site-packages, wherever
that interpreter lives.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

CHAIN_PTH = "_ds_hecate_tests_parent_env.pth"


def parent_site_dirs() -> List[str]:
    """The running interpreter's site-packages directories (venv, conda env, base or user site), in path order."""
    seen: List[str] = []
    for entry in sys.path:
        name = os.path.basename(os.path.normpath(entry)) if entry else ""
        if name in ("site-packages", "dist-packages") and os.path.isdir(entry) and entry not in seen:
            seen.append(entry)
    return seen


def venv_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def chained_venv(path: Path, timeout: float = 300) -> Path:
    """Create a venv at ``path`` that sees the running interpreter's packages; return its python.

    The chain is a .pth file calling ``site.addsitedir`` on each parent site directory, so the parent's own .pth
    files run too (as they would under --system-site-packages), after the venv's own site-packages.
    """
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=timeout)
    python = venv_python(path)
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True, timeout=120).stdout.strip()
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in parent_site_dirs())
    Path(own, CHAIN_PTH).write_text(lines, encoding="utf-8")
    return python
