"""Generated blocks in hand-written markdown: the text between a BEGIN and an END marker line belongs to a script.

benchmarks/run.py and benchmarks/simulated.py each own one block of docs/benchmarks.md; everything around it stays
as written by hand.
"""
from __future__ import annotations

import os
from typing import Optional


def read_with_markers(path: str, begin: str, end: str, where: str) -> Optional[str]:
    """The text of ``path`` (None if the file does not exist), or SystemExit naming the marker lines to add ``where``
    (both once, in that order)."""
    if not os.path.exists(path):
        return None
    with open(path, "r", encoding="utf-8") as f:
        text = f.read()
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{path}: no generated section (or more than one); add the lines\n{begin}\n{end}\nonce, in "
                         f"that order, {where}")
    return text


def replace_block(path: str, block: str, begin: str, end: str, where: str) -> None:
    """Write ``block`` (which starts with ``begin`` and ends with ``end``) in place of the file's generated block;
    a file that does not exist gets just the block. Reads the file right before writing."""
    text = read_with_markers(path, begin, end, where)
    if text is None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(block + "\n")
        return
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + block + tail)
