"""Mutations of the layer call's lean paths (issue 41): DeepSpeed's gate computed without its capacity slots
(``ds_hecate/ops/topk_gate.py``), the zero row after the expert outputs only when a slot is dropped, the
permutations a rank alone skips, the accumulator views made once per accumulator, the send order and count row
built from fewer ops, and l_aux's gradient added in the routes' backward. Appended to ``catalog.py``'s MUTATIONS and TESTS_FOR."""
from __future__ import annotations

from typing import Dict, List

from mutation import Mutation

LAYER_CALL_MUTATIONS: List[Mutation] = [
    Mutation(
        "gate-denominator-summed-over-k", "ds_hecate/ops/topk_gate.py",
        (("        gates_sum = torch.sum(gates * mask, dim=-1, keepdim=True)\n",
          "        gates_sum = gates.gather(1, top_idx).sum(-1, keepdim=True)  # MUTATION: k terms, not the row\n"),),
        "the top-k gate's denominator summed over the k routes instead of DeepSpeed's dense row sum: the same "
        "value up to its rounding, so the weights drift from DeepSpeed's by an ulp"),
    Mutation(
        "top2-second-expert-unsampled", "ds_hecate/ops/topk_gate.py",
        (("    if gate.top2_2nd_expert_sampling:\n",
          "    if False:  # MUTATION: the second expert without DeepSpeed's Gumbel draw\n"),),
        "the top-2 gate picks its second expert without DeepSpeed's sampling: other routes, and the global random "
        "stream one draw behind DeepSpeed's"),
    Mutation(
        "no-zero-row-with-dropped-slots", "ds_hecate/runtime/dispatcher.py",
        (("        return int(self.routed < self.top_k * self.num_tokens)\n",
          "        return 0  # MUTATION: no zero row, even when a dropped slot's position points at it\n"),),
        "the expert outputs come back without the zero row though a slot was dropped: its position reads past the "
        "rows (or, alone, the next layer's memory), the combine fails or adds a stranger's output"),
    Mutation(
        "accumulator-views-outlive-accumulator", "ds_hecate/runtime/shard_store.py",
        (("        if name == \"grads\":   # the views would keep a replaced or freed accumulator alive\n"
          "            object.__setattr__(self, \"_grad_columns\", {})\n",
          "        pass  # MUTATION: the cached column views survive the accumulator they view\n"),),
        "the expert compute's cached column views of the fp32 accumulator are kept when the accumulator is freed "
        "or replaced: weight gradients land in the old rows, the optimizer reads the new, uninitialized ones"),
    Mutation(
        "identity-permutation-skipped-on-n-ranks", "ds_hecate/runtime/sharded_experts.py",
        (("        in_order = alone and sources == 1",
          "        in_order = True and sources == 1"),),
        "a rank of N skips the permutations whenever its rows happen to arrive expert-major: the same outputs, but "
        "the 1-rank measurement without the one-rank shortcuts no longer times the N-rank path"),
    Mutation(
        "send-order-not-by-destination", "ds_hecate/runtime/dispatcher.py",
        (("    by_destination = np.argsort(np.asarray(dispatch.send_dst), kind=\"stable\")\n",
          "    by_destination = np.arange(len(dispatch.send_dst))  # MUTATION: the route order, not by destination\n"),),
        "the host-built send order keeps the plan's route order (expert, then destination) instead of grouping the "
        "rows by destination: on N ranks rows go to ranks that do not hold their expert"),
    Mutation(
        "count-row-keeps-dropped-slots", "ds_hecate/runtime/dispatcher.py",
        (("    hist[num_experts + 1] = torch.isnan((values - values).sum())\n",
          "    hist[num_experts + 1] += torch.isnan((values - values).sum())  # MUTATION: the dropped slots' count stays\n"),),
        "the count row's last bin keeps the dropped slots' count under the non-finite flag: a rank whose gate "
        "drops a route reports non-finite gates and every rank stops"),
    Mutation(
        "l-aux-gradient-not-added", "ds_hecate/ops/topk_gate.py",
        (("        if grad_me is not None:\n",
          "        if False:  # MUTATION: l_aux's gradient of the gates left out\n"),),
        "the top-k gate's routes backward leaves out l_aux's mean gradient it took over from autograd: the router "
        "trains without the load-balancing loss"),
]

#: mutation -> pytest node ids expected to kill it, cheapest first (as catalog.TESTS_FOR)
LAYER_CALL_TESTS_FOR: Dict[str, List[str]] = {
    "gate-denominator-summed-over-k": ["tests/test_topk_gate.py"],
    "top2-second-expert-unsampled": ["tests/test_topk_gate.py"],
    "no-zero-row-with-dropped-slots": [
        "tests/test_dispatcher.py::test_a_zero_row_follows_the_outputs_only_when_a_slot_is_dropped",
        "tests/test_oracle.py::test_follows_deepspeed_step_by_step[2-drop-top2]"],
    "accumulator-views-outlive-accumulator": [
        "tests/test_resident_copies.py::test_accumulator_column_views_follow_a_replaced_or_freed_accumulator"],
    "identity-permutation-skipped-on-n-ranks": [
        "tests/test_dispatcher.py::test_the_permutations_are_skipped_only_by_a_rank_alone_whose_rows_arrive_"
        "expert_major"],
    "send-order-not-by-destination": [
        "tests/test_dispatch_plan.py::test_dispatch_plan_matches_explicit_routes"],
    "count-row-keeps-dropped-slots": [
        "tests/test_dispatcher.py::test_the_count_row_flags_every_non_finite_gate_and_counts_every_route"],
    "l-aux-gradient-not-added": ["tests/test_topk_gate.py"],
}
