"""Deterministic character-level corpus for the MoE example, built from Python's own stdlib.

Why the stdlib: the example must run on air-gapped machines with nothing downloaded, and
every rank must see the same text without any file being shipped to it. The source of a
fixed list of standard-library modules satisfies both.

Determinism guarantees:

* The vocabulary is fixed (``string.printable`` plus one UNK id, ``VOCAB_SIZE == 101``)
  and does not depend on the corpus at all, so it is identical on every rank and every
  machine; in particular it is identical for any two machines with the same Python minor
  version, which is the guarantee the training script relies on.
* The corpus text (and hence ``len(corpus_ids())``) is the concatenation of the module
  sources in ``CORPUS_MODULES`` order. It is identical for the same Python minor version;
  different minor versions ship different stdlib sources and so give different batches.
* ``get_batch`` depends only on its arguments and the corpus, never on global RNG state.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import string

import torch

CORPUS_MODULES: tuple[str, ...] = (
    "json",
    "json.decoder",
    "json.encoder",
    "textwrap",
    "argparse",
    "collections",
    "string",
    "functools",
    "heapq",
    "bisect",
)

# Printable ASCII (incl. whitespace such as "\n" and "\t"); everything else maps to UNK.
_CHARS: str = string.printable
UNK_ID: int = len(_CHARS)
VOCAB_SIZE: int = len(_CHARS) + 1
_CHAR_TO_ID: dict[str, int] = {ch: i for i, ch in enumerate(_CHARS)}


def corpus_text() -> str:
    """Concatenate the stdlib module sources in a fixed order (a separator line marks each file)."""
    parts = []
    for name in CORPUS_MODULES:
        path = inspect.getsourcefile(importlib.import_module(name))
        if path is None:
            raise RuntimeError(f"no Python source available for stdlib module {name!r}")
        with open(path, encoding="utf-8") as f:
            parts.append(f"# ==== {name} ====\n{f.read()}")
    return "\n".join(parts)


def encode(text: str) -> torch.Tensor:
    """Map characters to ids, sending anything outside printable ASCII to ``UNK_ID``."""
    return torch.tensor([_CHAR_TO_ID.get(ch, UNK_ID) for ch in text], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    """Inverse of :func:`encode`; UNK ids come back as ``"?"``."""
    return "".join(_CHARS[i] if i < UNK_ID else "?" for i in ids.tolist())


@functools.lru_cache(maxsize=1)
def corpus_ids() -> torch.Tensor:
    """The encoded corpus, built once per process (every training step samples from it)."""
    return encode(corpus_text())


def _batch_seed(seed: int, step: int, rank: int) -> int:
    """Mix (seed, step, rank) into one 63-bit seed; a hash avoids collisions between ranks/steps."""
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def get_batch(step: int, rank: int, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x, y)`` LongTensors of shape ``(batch_size, seq_len)``, with ``y`` = ``x`` shifted by one.

    Windows are drawn from a private generator seeded by ``(seed, step, rank)``, so each rank
    gets a different but reproducible micro-batch and the global RNG is left untouched.
    """
    data = corpus_ids()
    if len(data) <= seq_len + 1:
        raise ValueError(f"seq_len={seq_len} is too long for a corpus of {len(data)} characters")
    gen = torch.Generator().manual_seed(_batch_seed(seed, step, rank))
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size, ), generator=gen)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
