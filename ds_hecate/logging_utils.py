"""The ``ds_hecate`` logger: INFO to stderr unless the application configured logging itself.

DeepSpeed quiets its own logger in launched ranks, so Hecate's one-line setup report goes through its own logger.
Set ``DS_HECATE_LOG_LEVEL`` (e.g. WARNING) to change the level.
"""
from __future__ import annotations

import logging
import os
import warnings

logger = logging.getLogger("ds_hecate")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[ds_hecate] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(os.environ.get("DS_HECATE_LOG_LEVEL", "INFO").upper())
    logger.propagate = False

# torch 2.13 renamed torch.distributed.all_gather_into_tensor to all_gather_single; the old name still works and
# only forwards, with a FutureWarning. DeepSpeed 0.19.8 calls the old name for ZeRO's partition all-gather (through
# deepspeed.comm) on every step, and no setting of ours or the user's avoids it (ds_hecate's TorchTransport called
# it too), so each rank of every Hecate run printed it: noise a user can do nothing about. This filter drops exactly that message, and only once Hecate
# takes over (a run without Hecate keeps DeepSpeed's behaviour).
_RENAMED_ALL_GATHER = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"
_quieted = False


def quiet_renamed_all_gather_warning() -> None:
    """Ignore torch's FutureWarning for the renamed all-gather (see above); once per process: adding a filter
    resets Python's record of warnings already shown, so a second identical filter would show them again."""
    global _quieted
    if not _quieted:
        warnings.filterwarnings("ignore", message=_RENAMED_ALL_GATHER, category=FutureWarning)
        _quieted = True


def log_rank0(message: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message)
