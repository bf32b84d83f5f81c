"""Value types for the ``ds-hecate`` command line: every flag is checked by argparse itself, so a bad value ends
with argparse's usage line and ``ds-hecate <command>: error: argument --flag: <what is wrong>`` (exit status 2, no
traceback) before any work starts. Each type names what it accepts; the values the commands pass on are then within
what the code below them (``HecateConfig``, the simulator, the planner) accepts."""
from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Iterable

ArgType = Callable[[str], object]


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return int(value)


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text}")
    return int(value)


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def bounded_float(low: float, high: float, what: str) -> ArgType:
    """A number in ``[low, high]`` (``what``: its unit, for the message)."""
    def parse(text: str) -> float:
        value = _number(text, float)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g} {what}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


def _existing(test: Callable[[str], bool], what: str, kind: str) -> ArgType:
    """A path ``test`` accepts, else ``no <what> <kind> '<path>'``."""
    def parse(text: str) -> str:
        if not test(text):
            raise argparse.ArgumentTypeError(f"no {what}{kind} {text!r}")
        return text
    parse.__name__ = kind.strip() or "path"
    return parse


def existing_file(what: str) -> ArgType:
    return _existing(os.path.isfile, what, " file")


def existing_dir(what: str) -> ArgType:
    return _existing(os.path.isdir, what, " directory")


def file_or_dir(what: str) -> ArgType:
    return _existing(os.path.exists, what, "")


def writable_path(text: str) -> str:
    """A file to write: its directory must exist (the file itself is created or replaced)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no directory {folder!r}")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is a directory")
    return text


def new_directory(text: str) -> str:
    """A directory to create or fill: its parent must exist."""
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: no directory {parent!r}")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return text


def preset_or_file(presets: Iterable[str], what: str, file_kind: str) -> ArgType:
    """One of ``presets`` or the path of an existing file (``file_kind`` says which)."""
    names = list(presets)

    def parse(text: str) -> str:
        if text in names or os.path.isfile(text):
            return text
        raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; choose one of {', '.join(names)}, or the path of "
                                         f"{file_kind}")
    parse.__name__ = what
    return parse


def routing_workload(workloads: Iterable[str]) -> ArgType:
    """A named routing workload or the path of a routing trace (.jsonl); the message for a name that is neither
    is the one docs/troubleshooting.md lists."""
    names = list(workloads)

    def parse(text: str) -> str:
        if text in names or os.path.isfile(text):
            return text
        if text.endswith(".jsonl") or os.sep in text:
            raise argparse.ArgumentTypeError(f"no routing trace file {text!r} (or choose a routing workload: "
                                             f"{', '.join(names)})")
        raise argparse.ArgumentTypeError(f"unknown routing workload {text!r}; choose one of {', '.join(names)} (or "
                                         "the path of a routing trace, .jsonl)")
    parse.__name__ = "workload"
    return parse


def names_from(choices: Iterable[str], what: str) -> ArgType:
    """One or more of ``choices``, comma separated (the flag may also be repeated, ``nargs``)."""
    allowed = list(choices)

    def parse(text: str) -> str:
        unknown = [s for s in text.split(",") if s and s not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, unknown))}; choose from "
                                             f"{', '.join(allowed)}")
        return text
    parse.__name__ = what
    return parse
