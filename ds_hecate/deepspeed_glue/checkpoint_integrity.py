"""Integrity of a Hecate checkpoint: content digests of the expert files, and the mark of a completed save.

**Digests.** Every expert file's SHA-256 and size are recorded in ``hecate/meta.json`` (``files``) and verified
before anything is loaded (the engine, ``ds-hecate consolidate``, ``export-hf`` and ``check``): a flipped byte
inside a tensor's data loads without complaint otherwise, since ``torch.load`` checks the archive's structure, not
its numbers. A worker thread digests each file while the next one is written (hashlib and file I/O release the
GIL), so a save costs about what its writes cost; it runs only inside ``save_checkpoint``, never in a training
step.

**Completion.** ``hecate/complete.json`` is written by global rank 0 after every rank's DeepSpeed files and Hecate's
files are written, before ``latest``: a tag without it is a save that did not complete (a rank killed midway, a
full disk). It lists the tag's files with their sizes, so a file cut short afterwards is named too. A new save of
the same tag removes the old mark first (an interrupted overwrite is recognisable) and, once it completes, the
temporary files an interrupted save left behind. Checkpoints written before digests (format ``ds_hecate/1``) have
neither; they load with one warning.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
from typing import Any, Callable, Dict, List, Optional

import torch

from ..errors import HecateError

MARKER = "complete.json"
DIGEST = "sha256"
#: Where the temporary names of interrupted writes end: ``<file>.tmp<pid>`` (expert files, ``latest``) and
#: ``meta.json.tmp``.
TMP_INFIX = ".tmp"

FileRecord = Dict[str, Any]   # {"sha256": hex digest, "bytes": size}


class DigestingWriter:
    """Writes objects to files with ``torch.save`` (each atomically: a temporary name, then a rename) and digests
    each file on a worker thread, reading it back from the page cache while the next file is serialized: the
    digests cost the save about one file's hashing, not a second pass over everything. Use as a context manager;
    after the ``with`` block :attr:`records` maps each written file's basename to its :data:`FileRecord`."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_hecate_digest")
        self._pending: Dict[str, "concurrent.futures.Future"] = {}
        self.records: Dict[str, FileRecord] = {}

    def __enter__(self) -> "DigestingWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            for name, future in self._pending.items():
                self.records[name] = future.result()
        finally:
            self._pending.clear()
            self._pool.shutdown(wait=True)

    def save(self, obj: Any, path: str) -> None:
        """``torch.save(obj)`` to ``path``; its digest follows on the worker thread."""
        tmp = f"{path}{TMP_INFIX}{os.getpid()}"
        torch.save(obj, tmp)
        os.replace(tmp, path)
        self._pending[os.path.basename(path)] = self._pool.submit(file_record, path)


def file_record(path: str) -> FileRecord:
    """A file's SHA-256 and size, read in 4 MiB pieces."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            piece = f.read(1 << 22)
            if not piece:
                break
            digest.update(piece)
            size += len(piece)
    return {DIGEST: digest.hexdigest(), "bytes": size}


def read_verified(path: str, record: Optional[FileRecord], where: str) -> bytes:
    """The bytes of ``path``, checked against its recorded size and digest (``record`` None: a checkpoint from
    before digests, read unchecked). Raises :class:`HecateError` naming the file, the expected and the found value."""
    with open(path, "rb") as f:
        data = f.read()
    if record is None:
        return data
    if len(data) != int(record["bytes"]):
        raise HecateError(f"{where}: {path} has {len(data)} bytes, the checkpoint recorded {record['bytes']}; the file "
                          "was cut short or replaced")
    found = hashlib.sha256(data).hexdigest()
    if found != record[DIGEST]:
        raise HecateError(f"{where}: {path} does not match its recorded digest (sha256 expected {record[DIGEST]}, "
                          f"found {found}); the file is damaged")
    return data


def load_tensor_file(data: bytes) -> Any:
    """A verified expert file's content: tensors and plain containers only (never unpickles objects)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


# -- completion --------------------------------------------------------------------------------------------------
def tag_files(tag_dir: str) -> Dict[str, int]:
    """Every file under ``tag_dir`` (relative path -> size), the mark and temporary files excluded."""
    out = {}
    for root, _dirs, files in os.walk(tag_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), tag_dir)
            if name == MARKER or is_temporary(name):
                continue
            out[rel] = os.path.getsize(os.path.join(root, name))
    return dict(sorted(out.items()))


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file of an interrupted write (``x.pt.tmp1234``, ``meta.json.tmp``)."""
    head, sep, tail = name.rpartition(TMP_INFIX)
    return bool(sep) and bool(head) and (tail == "" or tail.isdigit())


def write_marker(tag_dir: str, tag: str, subdir: str) -> None:
    """Mark ``tag_dir`` complete (global rank 0, after every rank's files are written)."""
    marker = {"tag": tag, "files": tag_files(tag_dir)}
    path = os.path.join(tag_dir, subdir, MARKER)
    tmp = f"{path}{TMP_INFIX}{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(marker, f)
    os.replace(tmp, path)


def start_overwrite(tag_dir: str, subdir: str) -> None:
    """Before a save into ``tag_dir`` (global rank 0, before any rank writes): an old mark goes, so a save that
    is interrupted while overwriting a complete tag is recognisable as incomplete."""
    marker = os.path.join(tag_dir, subdir, MARKER)
    if os.path.isfile(marker):
        os.remove(marker)


def remove_leftovers(tag_dir: str) -> List[str]:
    """After a completed save: remove the temporary files interrupted saves left in ``tag_dir`` (relative paths)."""
    removed = []
    for root, _dirs, files in os.walk(tag_dir):
        for name in files:
            if is_temporary(name):
                path = os.path.join(root, name)
                try:
                    os.remove(path)
                    removed.append(os.path.relpath(path, tag_dir))
                except OSError:
                    pass
    return sorted(removed)


def completeness_problems(tag_dir: str, subdir: str,
                          describe: Callable[[str], str] = lambda rel: rel) -> List[str]:
    """What makes ``tag_dir`` an incomplete save (empty: complete). Checks the mark and that every file it lists is
    there with its size; ``describe`` names a file (relative path) in the messages."""
    path = os.path.join(tag_dir, subdir, MARKER)
    if not os.path.isfile(path):
        return [f"{os.path.join(subdir, MARKER)} is missing (the save did not complete)"]
    try:
        with open(path, encoding="utf-8") as f:
            marker = json.load(f)
        files = dict(marker["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{os.path.join(subdir, MARKER)} is damaged ({type(exc).__name__})"]
    problems = []
    for rel, size in files.items():
        full = os.path.join(tag_dir, rel)
        if not os.path.isfile(full):
            problems.append(f"{describe(rel)} is missing")
        elif os.path.getsize(full) != int(size):
            problems.append(f"{describe(rel)} has {os.path.getsize(full)} bytes, the save wrote {size}")
    return problems
