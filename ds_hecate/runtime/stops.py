"""Stops every rank agrees on: a bad gate (NaN/Inf values, expert ids out of range) ends the run on every rank of
every group, with the same error naming the layer and the global ranks.

A layer's health flags travel with its count exchange, which spans the rank's group. With one group (the world)
every rank learns of a bad rank at that exchange and all raise there, at the same collective. With several groups
(``hecate.ep_size``) the exchange reaches only the group: raising there would let the other groups run on into the
next collective that spans the world (DeepSpeed's gradient reduction, ZeRO-3's parameter gathers) and fail there
with an unrelated error, or wait out a timeout. So a group that sees a bad gate notes the problem and finishes the
forward with the bad routes dropped (they are out of every count, so every collective of the call still matches),
and at the end of the forward every rank joins one world all-reduce of a flag (:meth:`Stops.agree`; one scalar
per micro-step, only with groups, nothing added to the layer call); if any rank noted a problem, the notes are
gathered and every rank raises the same :class:`~ds_hecate.errors.HecateError`.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np
import torch

from ..errors import HecateError


def gate_problem(flags: np.ndarray, layer: str, num_experts: int, rank_name: Callable[[int], str]) -> Optional[str]:
    """What is wrong with a layer call's gates (``flags``: the exchanged ``[ranks, 2]`` non-finite and out-of-range
    flags of the group), naming ranks by ``rank_name``; None when nothing is. One reduction on the healthy path: a
    loop over 1,024 ranks would cost the critical path a millisecond."""
    if not flags.any():
        return None
    nonfinite = [rank_name(int(r)) for r in np.flatnonzero(flags[:, 0])]
    out_of_range = [rank_name(int(r)) for r in np.flatnonzero(flags[:, 1])]
    problems = []
    if nonfinite:
        problems.append(f"non-finite gate values (NaN/Inf) on {', '.join(nonfinite)}")
    if out_of_range:
        problems.append(f"expert indices outside [0, {num_experts}) on {', '.join(out_of_range)}")
    return f"MoE layer '{layer}': " + " and ".join(problems)


#: problems named in one error (a NaN input runs on through every later layer: the first is the origin)
SHOWN_PROBLEMS = 3


def _error(problems: List[str], where: str) -> HecateError:
    more = len(problems) - SHOWN_PROBLEMS
    text = "; ".join(problems[:SHOWN_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")
    return HecateError(f"{text}; every rank stops {where} (check the inputs and the learning rate of this layer)")


class Stops:
    """One rank's record of the problems its groups found, until the whole world has agreed on them."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.noted: List[str] = []

    @property
    def deferred(self) -> bool:
        """Whether problems wait for :meth:`agree` (several groups) instead of stopping at the layer."""
        return self.layout.edp_size > 1

    def check_gate(self, flags: np.ndarray, layer: str, num_experts: int, rank_name: Callable[[int], str]) -> None:
        """After a layer's count exchange: raise at once (one group: every rank saw the same flags), or note the
        problem for :meth:`agree` (several groups)."""
        problem = gate_problem(flags, layer, num_experts, rank_name)
        if problem is None:
            return
        if not self.deferred:
            raise _error([problem], "here")
        if problem not in self.noted:
            self.noted.append(problem)

    def agree(self) -> None:
        """End of a forward: with several groups, one world all-reduce of a flag; if any rank noted a problem every
        rank raises the same error (the notes of every rank, gathered, in global rank order). Collective over the
        world; a no-op with one group."""
        if not self.deferred:
            return
        world = self.layout.world
        flag = torch.tensor([1.0 if self.noted else 0.0], device=world.device)
        if float(world.all_reduce(flag, collective="stop agreement all-reduce").item()) == 0.0:
            return
        notes = world.all_gather_object(list(self.noted), "stop agreement gather")
        problems: List[str] = []
        for rank_notes in notes:
            problems.extend(p for p in rank_notes if p not in problems)
        self.noted = []
        raise _error(problems, "at the end of this forward, every group included")
