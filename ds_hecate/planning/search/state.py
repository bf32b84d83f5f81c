"""The greedy search's state, vectorised with numpy: the holders so far, each expert's dispatch columns and
transfers, and the rank times they give (:func:`~.cost_model.rank_seconds`, the formula
:func:`~.cost_model.estimate_layer` uses), so that a move is evaluated by swapping one expert's columns.

Kept apart from the search loop (:mod:`.greedy`) and the moves it weighs (:mod:`.moves`): both read this state.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from ..cost_model import StepCostModel, rank_seconds
from ..dispatch import dispatch_flows
from ..fanout import relay_transfers
from ..plan import Materialized, holders_matrix, materialized_of


class SearchState:
    """State of the greedy search (:func:`~.greedy.schedule_materialization`).

    Per expert it keeps the dispatch columns (pairs processed, rows sent and received per rank, and the part of
    those that crosses nodes), so a candidate move, which changes the holders of one expert only, is evaluated by
    replacing that expert's columns; all candidate moves of a search step are evaluated in one batch. Rank times
    are :func:`~.cost_model.rank_seconds`, the formula :func:`~.cost_model.estimate_layer` uses.
    """

    def __init__(self, counts, owners, costs: StepCostModel, ranks_per_node: int, start, prefetched) -> None:
        self.counts = np.asarray(counts, dtype=np.float64).reshape(len(counts), len(owners))
        self.world, self.num_experts = self.counts.shape
        self.owners = np.asarray(owners, dtype=np.int64)
        self.costs = costs
        self.rpn = ranks_per_node
        self.mat = np.zeros((self.world, self.num_experts), dtype=bool)
        self.mat[self.owners, np.arange(self.num_experts)] = True
        if start is not None:
            self.mat |= holders_matrix(start, self.world, self.num_experts)
        if prefetched is None:
            self.early = np.ones_like(self.mat)
        else:
            self.early = holders_matrix(prefetched, self.world, self.num_experts).copy()
        self.owner_mask = np.zeros_like(self.mat)
        self.owner_mask[self.owners, np.arange(self.num_experts)] = True
        flows = dispatch_flows(self.counts.T, self.mat.T, ranks_per_node)
        # [experts, world] each: processed, sent, received, sent across nodes, received across nodes
        self.cols = [flows.processed, flows.sent, flows.received, flows.sent_inter, flows.received_inter]
        early_cols, late_cols = self._transfer_columns(np.arange(self.num_experts), self.mat.T)
        # kept and updated in place by add_many: writable copies where the walk returned read-only zero views
        self.early_cols = early_cols if early_cols.flags.writeable else np.array(early_cols)
        self.late_cols = late_cols if late_cols.flags.writeable else np.array(late_cols)
        self.refresh()

    def refresh(self) -> None:
        self.early_xfer = self.early_cols.sum(axis=1)   # [4, world]
        self.late_xfer = self.late_cols.sum(axis=1)
        self.tot = [c.sum(axis=0) for c in self.cols]
        self.times = self.rank_times(self.tot, self.early_xfer, self.late_xfer)

    def _transfer_columns(self, experts, holders):
        """Expert transfers of ``experts`` with holder rows ``holders`` (``[k, world]``), hidden-capable and
        exposed: two ``[4, k, world]`` arrays (in-intra, out-intra, in-inter, out-inter), the relay trees included:
        the first level of the prefetched copies, then their deeper levels (run at the wait, with their pipeline's
        fill) and every level of the copies gathered after the gate (:func:`~.fanout.relay_transfers`)."""
        early = self.early[:, experts].T
        owners = self.owners[experts]
        relays = self.costs.relays
        first, deeper, _ = relay_transfers(holders & early, owners, self.rpn, *relays)
        late = holders & ~early
        if not late.any():   # nothing gathered after the gate (every search before it): no second tree walk
            return first, deeper
        late_first, late_deeper, _ = relay_transfers(late, owners, self.rpn, *relays)
        return first, deeper + late_first + late_deeper

    @property
    def proc(self):
        return self.cols[0]

    def rank_times(self, tot, early, late):
        """Rank times for ``tot``: processed, sent, received, sent and received across nodes; ``early``/``late``:
        expert transfers (in-intra, out-intra, in-inter, out-inter), stacked on the first axis. Arrays may carry a
        leading move axis."""
        processed, sent, received, sent_i, received_i = tot
        tokens = (received - received_i, sent - sent_i, received_i, sent_i)
        return rank_seconds(self.costs, self.rpn, processed, tokens, tuple(early), tuple(late))

    def _moved_columns(self, experts, added):
        holders = added | self.mat[:, experts].T
        flows = dispatch_flows(self.counts[:, experts].T, holders, self.rpn)
        return [flows.processed, flows.sent, flows.received, flows.sent_inter, flows.received_inter]

    def evaluate(self, moves: Sequence[Tuple[int, Tuple[int, ...]]]):
        """Rank times ``[len(moves), world]`` after each move (expert e added on a rank set), all in one batch."""
        k = len(moves)
        experts = np.fromiter((e for e, _ in moves), dtype=np.int64, count=k)
        added = np.zeros((k, self.world), dtype=bool)
        for i, (_, ranks) in enumerate(moves):
            added[i, list(ranks)] = True
        new = self._moved_columns(experts, added)
        tot = [t - c[experts] + n for t, c, n in zip(self.tot, self.cols, new)]
        early, late = self._transfer_columns(experts, added | self.mat[:, experts].T)
        return self.rank_times(tot, self.early_xfer[:, None, :] - self.early_cols[:, experts] + early,
                               self.late_xfer[:, None, :] - self.late_cols[:, experts] + late)

    def evaluate_many(self, pairs: Sequence[Tuple[int, int]]):
        """Rank times ``[world]`` after adding every (expert, rank) of ``pairs`` at once (several experts: their
        dispatch columns are independent, so the changed columns are summed in one batch)."""
        experts, added = self._grouped(pairs)
        new = self._moved_columns(experts, added)
        tot = [t - c[experts].sum(axis=0) + n.sum(axis=0) for t, c, n in zip(self.tot, self.cols, new)]
        early, late = self._transfer_columns(experts, added | self.mat[:, experts].T)
        return self.rank_times(tot, self.early_xfer - self.early_cols[:, experts].sum(axis=1) + early.sum(axis=1),
                               self.late_xfer - self.late_cols[:, experts].sum(axis=1) + late.sum(axis=1))

    def _grouped(self, pairs: Sequence[Tuple[int, int]]):
        by_expert: dict = {}
        for e, d in pairs:
            by_expert.setdefault(int(e), []).append(int(d))
        experts = np.array(sorted(by_expert), dtype=np.int64)
        added = np.zeros((len(experts), self.world), dtype=bool)
        for i, e in enumerate(experts.tolist()):
            added[i, by_expert[e]] = True
        return experts, added

    def add(self, e: int, ranks: Tuple[int, ...]) -> None:
        self.add_many([(e, d) for d in ranks])

    def add_many(self, pairs: Sequence[Tuple[int, int]]) -> None:
        experts, added = self._grouped(pairs)
        for i, e in enumerate(experts.tolist()):
            self.mat[added[i], e] = True
        flows = dispatch_flows(self.counts[:, experts].T, self.mat[:, experts].T, self.rpn)
        for c, n in zip(self.cols, (flows.processed, flows.sent, flows.received, flows.sent_inter,
                                    flows.received_inter)):
            c[experts] = n
        self.early_cols[:, experts], self.late_cols[:, experts] = self._transfer_columns(experts,
                                                                                         self.mat[:, experts].T)
        self.refresh()

    def frozen(self, mat=None) -> Materialized:
        return materialized_of(self.mat if mat is None else mat)
