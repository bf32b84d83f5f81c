"""Row index vectors of a buffer cut into segments, built on the host from a plan's tables (numpy only).

The token all-to-all delivers a rank's rows source-major, one segment per (source, expert); the grouped GEMMs want
them expert-major. Both permutations come from the segment table in a few vectorised numpy ops, so the device gets
finished index vectors in one copy each, never an expansion or a scatter of one index per row.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np


def segment_rows(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The rows of consecutive segments (segment ``i``: ``lengths[i]`` rows from ``starts[i]``) as one index
    vector: each row is its segment's start plus its offset in it (one ``repeat`` and one ``arange``)."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    first_out = np.cumsum(lengths) - lengths
    return np.repeat(starts - first_out, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def segment_permutation(starts: np.ndarray, lengths: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(order, inverse) for a buffer cut into segments (segment ``i``: ``lengths[i]`` rows from ``starts[i]``;
    together they cover the buffer): ``order`` takes the segments' rows one segment after another in the given
    order (:func:`segment_rows`), ``inverse`` puts them back. The received rows of an all-to-all (source-major) to
    expert-major and back: both are built from the segment table, not by scattering one index per row."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    positions = np.cumsum(lengths) - lengths    # where each segment lands in ``order``
    by_start = np.argsort(starts, kind="stable")   # the segments in the buffer's order
    return segment_rows(starts, lengths), segment_rows(positions[by_start], lengths[by_start])


__all__ = ["segment_permutation", "segment_rows"]
