"""The ``ds_hecate`` logger: INFO to stderr unless the application configured logging itself.

DeepSpeed quiets its own logger in launched ranks, so Hecate's one-line setup report goes through its own logger.
Set ``DS_HECATE_LOG_LEVEL`` (e.g. WARNING) to change the level.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("ds_hecate")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[ds_hecate] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(os.environ.get("DS_HECATE_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


def log_rank0(message: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message)
