"""Set-up errors said once per job, not once per rank.

An invalid ``hecate`` section, an unsupported mode or a model Hecate cannot take over is found by every rank alike,
from the same config and the same model code, before any collective. Python's default would print the same
traceback from every rank of the job (dozens of copies on one node). :func:`same_on_every_rank` marks such errors;
when one ends a launched multi-rank process (``RANK`` / ``WORLD_SIZE`` set by the deepspeed launcher, torchrun or
mpirun), rank 0 prints ``ds_hecate: error: <message>`` once, without the traceback, the other ranks nothing, and every
rank exits with status 1 as usual. Any other exception, or ``DS_HECATE_TRACEBACK=1``, keeps Python's report. A
single process (and code that catches the error) sees the ordinary exception.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Optional, Tuple

from ..errors import HecateError

_MARK = "_hecate_same_on_every_rank"
_RANK_KEYS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_SIZE_KEYS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_installed = False


def launched_rank() -> Tuple[int, int]:
    """(rank, world size) a launcher gave this process through its environment; (0, 1) when none did."""
    def first(keys) -> Optional[int]:
        for key in keys:
            value = os.environ.get(key, "")
            if value.isdigit():
                return int(value)
        return None
    return first(_RANK_KEYS) or 0, first(_SIZE_KEYS) or 1


@contextlib.contextmanager
def same_on_every_rank() -> Iterator[None]:
    """Mark a :class:`~ds_hecate.errors.HecateError` raised in this block as one every rank raises alike, and make
    an uncaught one end a multi-rank job with one message from rank 0 (see the module docstring)."""
    try:
        yield
    except HecateError as exc:
        setattr(exc, _MARK, True)
        _install_hook()
        raise


def _install_hook() -> None:
    global _installed
    if _installed or launched_rank()[1] <= 1:
        return
    previous = sys.excepthook

    def report_once(kind, value, traceback) -> None:
        if getattr(value, _MARK, False) and os.environ.get("DS_HECATE_TRACEBACK", "0") in ("", "0"):
            if launched_rank()[0] == 0:
                print(f"ds_hecate: error: {value}\n(every rank stopped with this error; rank 0 reports it. "
                      "DS_HECATE_TRACEBACK=1 prints each rank's traceback)", file=sys.stderr, flush=True)
            return
        previous(kind, value, traceback)

    sys.excepthook = report_once
    _installed = True
