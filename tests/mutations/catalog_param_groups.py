"""Mutations of the experts' param groups and LR schedules (issue 56) and of the expert optimizer's step counts
(issue 53, defect 7): each breaks one promise tests/test_megatron_recipes.py, tests/test_expert_optimizer.py or
tests/test_grad_norm_tensor_parallel.py keeps. Appended to ``catalog.py``'s MUTATIONS and TESTS_FOR."""
from __future__ import annotations

from typing import Dict, List

from mutation import Mutation

PARAM_GROUP_MUTATIONS: List[Mutation] = [
    Mutation(
        "emptied-groups-not-scheduled", "ds_hecate/deepspeed_glue/param_groups.py",
        (("        emptied.drive_with(self.lr_scheduler)\n",
          "        pass  # MUTATION: the scheduler's steps never see the groups that held only experts\n"),),
        "groups pruning emptied are visible while the scheduler is built but not while it steps: experts stay at the "
        "settings of their group's first step (lr 0 under warmup)"),
    Mutation(
        "experts-in-the-first-group", "ds_hecate/deepspeed_glue/initialize.py",
        (("        segments[shard.layer_id] = layer_segments(layer, shard.kernel.names, shard.kernel.numels, index)\n",
          "        segments[shard.layer_id] = []  # MUTATION: every expert column in the first group\n"),),
        "a layer's expert biases step with its weights' settings (Megatron's no-weight-decay group ignored)"),
    Mutation(
        "emptied-settings-not-restored", "ds_hecate/deepspeed_glue/checkpoint.py",
        (("            _restore_emptied_settings(rt.optimizer, meta, checkpoint_dir)\n",
          "            pass  # MUTATION: the emptied groups keep the settings of before the load\n"),),
        "a resumed run's experts step with the settings their emptied groups had at initialize until the schedule "
        "sets them again"),
    Mutation(
        "step-count-read-back", "ds_hecate/deepspeed_glue/expert_optimizer.py",
        (("            count = (self._steps[g] or 0) + 1\n",
          "            count = max([int(s[\"step\"]) for s in states] or [(self._steps[g] or 0) + 1])  # MUTATION\n"),),
        "the group's step count is read back from every parameter's counter after each step (a device sync per "
        "parameter per step where the counter lives on the GPU)"),
    Mutation(
        "hecate-norm-first-peer-only", "ds_hecate/runtime/hecate.py",
        (("        counted = layout.edp_size == 1 or layout.partitioned or layout.edp_index == 0\n",
          "        counted = layout.edp_size == 1 or layout.edp_index == 0  # MUTATION: one peer's slices counted\n"),),
        "with expert state partitioned over the expert-data-parallel peers, the norm counts one peer's slices only"),
]

PARAM_GROUP_TESTS_FOR: Dict[str, List[str]] = {
    "emptied-groups-not-scheduled": ["tests/test_megatron_recipes.py"],
    "experts-in-the-first-group": ["tests/test_megatron_recipes.py"],
    "emptied-settings-not-restored": ["tests/test_megatron_recipes.py"],
    "step-count-read-back": ["tests/test_expert_optimizer.py::test_the_step_counts_are_set_without_a_host_read"],
    "hecate-norm-first-peer-only": ["tests/test_grad_norm_tensor_parallel.py"],
}
