"""The :class:`Mutation` record the catalogs (``catalog.py``, ``catalog_resident.py``) fill and ``run.py`` applies."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str                          # relative to the repository root
    edits: Tuple[Tuple[str, str], ...]  # (exact old text, new text), each old text must occur exactly once
    what: str                          # the bug, in words
    env: Dict[str, str] = field(default_factory=dict)   # extra environment (e.g. a shorter hang watchdog)


# A hang is a kill too; dist_utils' watchdog (DS_HECATE_TEST_TIMEOUT, 300 s by default) turns it into a failure.
SHORT_WATCHDOG = {"DS_HECATE_TEST_TIMEOUT": "120"}
