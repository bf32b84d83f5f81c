"""Mutations of the resident compute-dtype expert copies (``LayerShard.weight_rows``: refreshed after every applied
step, checkpoint load and re-shard) and of the persistent fp32 gradient accumulator (``LayerShard.grads``: the first
contribution of a window written, later ones added), issue 41. With fp32 compute and whole masters the rows are the
masters, so the staleness mutations bite only in bf16/fp16 compute or with masters partitioned over the
expert-data-parallel peers: their killers run those. Appended to ``catalog.py``'s MUTATIONS and TESTS_FOR."""
from __future__ import annotations

from typing import Dict, List

from mutation import Mutation

RESIDENT_MUTATIONS: List[Mutation] = [
    Mutation(
        "compute-copy-stale-after-step", "ds_hecate/runtime/hecate.py",
        (("            refresh_weights(self)   # the resident compute copies from the updated masters, before the next "
          "call\n",
          "            pass  # MUTATION: the resident compute copies keep the weights of before the step\n"),),
        "the optimizer updates the experts' fp32 masters but the compute-dtype copies the layer calls compute from "
        "(and SparseAllGather sends) are not refreshed: bf16/fp16 (or partitioned) runs train on the initial weights"),
    Mutation(
        "compute-copy-stale-after-load", "ds_hecate/runtime/shard_store.py",
        (("        self.weight_rows = self._rows([whole[e] for e in expected], device)\n",
          "        if self.weight_rows is None or self.shares_weights:\n"
          "            self.weight_rows = self._rows([whole[e] for e in expected], device)\n"
          "        elif self.weight_rows.shape[0] != len(expected):  # MUTATION: a load re-lays the masters out but\n"
          "            self.weight_rows = self._rows([], device, len(expected))  # keeps (or never fills) the rows\n"),),
        "a checkpoint load installs the loaded masters but the resident compute-dtype rows are not refilled from "
        "them: a resumed bf16/fp16 (or partitioned) run computes with its pre-load weights"),
    Mutation(
        "compute-copy-stale-after-reshard", "ds_hecate/runtime/resharding.py",
        (("    refresh_weights(rt, [rt.bindings[i].shard for i in changed])\n    return True\n",
          "    return True  # MUTATION: the re-laid-out resident rows are never refreshed\n"),),
        "after a re-shard the resident compute-dtype rows of the changed layers are not refreshed: partitioned "
        "masters (whose relayout leaves the rows to the peers' all-gather) compute the moved experts from "
        "uninitialized rows"),
    Mutation(
        "first-microstep-adds-stale", "ds_hecate/comm/buffers.py",
        (("    elif fresh == [(0, rows.shape[1])] or sum(hi - lo for lo, hi in fresh) == rows.shape[1]:\n"
          "        rows.copy_(grads)\n",
          "    elif fresh == [(0, rows.shape[1])] or sum(hi - lo for lo, hi in fresh) == rows.shape[1]:\n"
          "        rows.add_(grads)  # MUTATION: the window's first contribution adds onto what the rows held\n"),),
        "the first contribution of an accumulation window is added to the persistent accumulator instead of "
        "written: each step's expert gradients carry the previous window's sums (or the uninitialized rows')"),
]

T = "tests/test_resident_copies.py::"   # the killers live there

#: mutation -> pytest node ids expected to kill it, cheapest first (as catalog.TESTS_FOR)
RESIDENT_TESTS_FOR: Dict[str, List[str]] = {
    "compute-copy-stale-after-step": [T + "test_bf16_compute_copies_follow_every_optimizer_step"],
    "compute-copy-stale-after-load": [T + "test_bf16_resume_refills_compute_copies"],
    "compute-copy-stale-after-reshard": [T + "test_partitioned_reshard_gathers_compute_copies"],
    "first-microstep-adds-stale": [T + "test_accumulation_windows_start_from_nothing[generic]"],
}
