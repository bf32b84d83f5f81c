"""Conversions that do not dispatch when there is nothing to convert.

``Tensor.to`` (and ``float()``) returns the tensor itself when its dtype already matches, but still dispatches an
``aten::to``: host time on every call and, in a layer call of a dozen such no-ops, a visible share of its op count.
The same values either way.
"""
from __future__ import annotations

import torch


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it is already, else ``t.to(dtype)``."""
    return t if t.dtype == dtype else t.to(dtype)


__all__ = ["cast"]
