"""What state each tag of a save directory is in: complete, incomplete (a save that did not finish), damaged, or
saved before digests. ``ds-hecate check`` prints it; nothing here loads a tensor or changes a file."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

from . import checkpoint_integrity as integrity
from .checkpoint import LEGACY_FORMAT, SUBDIR, read_meta
from ..errors import HecateError


@dataclass
class TagStatus:
    """One tag's verdict: ``state`` is ``complete``, ``legacy`` (before digests: loads with a warning),
    ``incomplete`` or ``damaged``; ``problems`` says what is wrong, ``leftovers`` lists temporary files."""

    tag: str
    state: str
    verified_files: int = 0
    problems: List[str] = field(default_factory=list)
    leftovers: List[str] = field(default_factory=list)

    @property
    def loadable(self) -> bool:
        return self.state in ("complete", "legacy")


def hecate_tags(save_dir: str) -> List[str]:
    """Tags under ``save_dir`` that hold Hecate state (a ``hecate/`` folder), sorted."""
    if not os.path.isdir(save_dir):
        raise HecateError(f"{save_dir} is not a directory")
    return sorted(name for name in os.listdir(save_dir) if os.path.isdir(os.path.join(save_dir, name, SUBDIR)))


def latest_tag(save_dir: str) -> Optional[str]:
    path = os.path.join(save_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def tag_status(save_dir: str, tag: str, verify: bool = True) -> TagStatus:
    """The state of ``save_dir/tag``; with ``verify`` every expert file is read and its digest checked."""
    tag_dir = os.path.join(save_dir, tag)
    leftovers = [rel for rel in _all_files(tag_dir) if integrity.is_temporary(os.path.basename(rel))]
    meta_path = os.path.join(tag_dir, SUBDIR, "meta.json")
    if not os.path.isfile(meta_path):
        return TagStatus(tag, "incomplete", leftovers=leftovers, problems=[
            f"{SUBDIR}/{integrity.MARKER} is missing (the save did not complete)", f"{SUBDIR}/meta.json is missing"])
    try:
        meta = read_meta(meta_path)
    except HecateError as exc:
        return TagStatus(tag, "damaged", problems=[str(exc)], leftovers=leftovers)
    if meta.get("format") == LEGACY_FORMAT:
        return TagStatus(tag, "legacy", leftovers=leftovers,
                         problems=["saved before expert-file digests: its expert files cannot be verified"])
    problems = integrity.completeness_problems(tag_dir, SUBDIR)
    if problems:
        return TagStatus(tag, "incomplete", problems=problems, leftovers=leftovers)
    listed = meta.get("files")
    files = listed if isinstance(listed, dict) else {}
    status = TagStatus(tag, "complete", leftovers=leftovers)
    if verify:
        for name, record in sorted(files.items()):
            try:
                integrity.read_verified(os.path.join(tag_dir, SUBDIR, name), record, f"{tag}")
                status.verified_files += 1
            except (HecateError, OSError) as exc:
                status.problems.append(str(exc))
        if status.problems:
            status.state = "damaged"
    return status


def _all_files(tag_dir: str) -> List[str]:
    out: List[str] = []
    for root, _dirs, files in os.walk(tag_dir):
        out.extend(os.path.relpath(os.path.join(root, name), tag_dir) for name in files)
    return sorted(out)
