"""A prefetch still in flight when the optimizer steps is completed before the expert weights change.

A layer's SparseAllGather is issued ahead of its call (after the previous layer's). When a forward skips that layer
(a conditional block, the last layer of an early-exit model), the prefetch is still pending at the step. On a
stream-ordered transport (NCCL on CUDA) its relayed stages read the owners' resident weight rows on a side stream,
asynchronously: the optimizer step and the refresh of the resident rows must not run before it has completed, or
replicas receive torn weights. The CPU cannot show the race itself (gloo completes when waited), so the test pins
the order: the pending gather is waited for before the expert optimizer steps and the resident rows are refreshed.
"""
from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch import nn

from dist_utils import run_ranks


def _order_at_step(rank: int, world: int) -> List[str]:
    import torch.distributed as dist

    import ds_hecate
    from ds_hecate.comm.backend import build_communicator
    from ds_hecate.comm.buffers import PendingGather
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.runtime import edp
    from ds_hecate.runtime.hecate import HecateRuntime

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.ModuleDict({f"moe{i}": ds_hecate.MoE(8, ds_hecate.SwiGLUExpert(8, 16), num_experts=4, k=2)
                           for i in range(2)})
    cfg = parse_hecate_section({"enabled": True, "reshard_interval": 0, "compute_s_per_pair": 1e-6,
                                "link_gbps": 1.0, "non_moe_time_s": 1e-3})
    rt = HecateRuntime(cfg, build_communicator("torch", dist.group.WORLD, rank, world, torch.device("cpu")),
                       torch.float32, world)
    convert_model(model, rt)
    events: List[str] = []
    skipped = rt.bindings[1]   # its prefetch was issued, its call never came
    placement = skipped.planner.prefetch(skipped.plan_inputs(), rank)
    waited: Callable[[], Any] = lambda: events.append("prefetch waited")   # stands in for the gathered experts
    skipped.gathers.pending = PendingGather(placement, waited)

    class Stepper:
        param_groups: list = [{"lr": 1e-3}]

        def step(self, grad_scale, hyperparameters):
            events.append("optimizer step")

    rt.optimizer = Stepper()   # type: ignore[assignment]
    refresh = edp.refresh_weights

    def refreshed(runtime, shards=None):
        events.append("resident rows refreshed")
        refresh(runtime, shards)
    edp.refresh_weights = refreshed
    import ds_hecate.runtime.hecate as hecate_module
    hecate_module.refresh_weights = refreshed
    rt.apply_step(True, world, 1.0, 0.0, [{"lr": 1e-3}])
    rt.after_step(1)
    return events


def test_a_prefetch_pending_at_the_step_completes_before_the_weights_change():
    (events,) = run_ranks(1, _order_at_step)
    assert events[:3] == ["prefetch waited", "optimizer step", "resident rows refreshed"], events
