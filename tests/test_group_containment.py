"""Hecate's layer-call collectives stay inside a rank's group; only the expert-data-parallel (EDP) step work crosses
groups, and only between peers (issue 25).

Every collective Hecate issues is recorded per rank by wrapping the communicators' two entry points to the
transports (``Communicator.all_to_all``, which every sparse collective and token exchange goes through, and the
count exchange's all-gather), with the global ranks of the process group it ran on. Then:

- 4 ranks, DeepSpeed layers built with ``ep_size=2`` (so 2 groups of 2): every count exchange, SparseAllGather,
  SparseReduceScatter and token all-to-all involved exactly the rank's own group; the gradient reduction and the
  weights' all-gather involved exactly its EDP peers (ranks ``r mod 2 + 2k``); replicas did move (not vacuous);
  and (ZeRO-2: partitioned state) by the end of each backward every layer's whole fp32 gradient rows were
  released, reduce-scattered into this rank's slices layer by layer during backward;
- 2 ranks, 8 experts (the default rule: one group, today's whole-world FSSDP): every collective ran over the whole
  world, and no EDP communicator exists.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from dist_utils import run_ranks
from moe_training import Spec

HOT = (3.0, 3.0) + (0.0,) * 6
LAYER_CALL = {"token-count exchange", "SparseAllGather", "SparseReduceScatter", "token all-to-all"}


def _record(rank: int, world: int, spec: Spec) -> Dict[str, object]:
    import deepspeed
    import torch.distributed as dist

    import ds_hecate  # noqa: F401  (patches deepspeed.initialize)
    from ds_hecate.comm.collectives import Communicator
    from moe_training import TinyMoE, ds_config, rank_batch

    records: List[Tuple[str, Tuple[int, ...]]] = []

    def ranks_of(transport) -> Tuple[int, ...]:
        group = getattr(transport, "group", None)
        return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))

    all_to_all, exchange_counts = Communicator.all_to_all, Communicator.exchange_counts

    def recorded_all_to_all(self, *args, **kwargs):
        collective = kwargs.setdefault("collective", "token all-to-all")
        transport = kwargs.setdefault("transport", None)
        if self.world_size > 1:
            records.append((collective, ranks_of(transport or self.transport)))
        return all_to_all(self, *args, **kwargs)

    def recorded_counts(self, local_counts):
        if self.world_size > 1:
            records.append(("token-count exchange", ranks_of(self.transport)))
        return exchange_counts(self, local_counts)
    setattr(Communicator, "all_to_all", recorded_all_to_all)
    setattr(Communicator, "exchange_counts", recorded_counts)
    for name in ("all_reduce", "reduce_scatter", "all_gather_into"):   # the EDP step work, by collective name
        original = getattr(Communicator, name)

        def recorded(self, tensor, *args, _original=original, _name=name, **kwargs):
            if self.world_size > 1:
                records.append((kwargs.get("collective", _name), ranks_of(self.transport)))
            return _original(self, tensor, *args, **kwargs)
        setattr(Communicator, name, recorded)

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(spec.seed)
    model = TinyMoE(spec)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(spec))
    released = []   # after each backward: every layer's whole gradient rows released, its slices there
    for step in range(spec.steps):
        x, y, used = rank_batch(spec, step, 0, rank, world, torch.float32)
        engine.backward(engine(x, y, used))
        shards = [b.shard for b in engine.hecate.bindings]
        released.append(all(s.grads is None and s.slice_grads is not None for s in shards if s.owned))
        engine.step()
    stats = engine.hecate.stats()
    return {"records": records, "replicas": sum(layer["replicas"] for layer in stats["layers"]),
            "edp": engine.hecate.layout.edp is not None, "ep_size": stats["ep_size"], "released": released}


def test_layer_calls_stay_in_the_group_and_edp_work_between_peers():
    spec = Spec(hecate={"enabled": True}, ep_size=2, gate_bias=HOT, steps=3, tokens=16)
    outs = run_ranks(4, _record, spec)
    assert sum(out["replicas"] for out in outs) > 0, "no replica moved: the gathers were empty"
    for rank, out in enumerate(outs):
        group = tuple(range(rank // 2 * 2, rank // 2 * 2 + 2))
        peers = tuple(range(rank % 2, 4, 2))
        kinds = {name for name, _ in out["records"]}
        assert LAYER_CALL <= kinds, kinds
        outside = [(name, ranks) for name, ranks in out["records"] if name in LAYER_CALL and ranks != group]
        assert not outside, f"rank {rank}: layer-call collectives outside its group {group}: {outside[:5]}"
        edp = [(name, ranks) for name, ranks in out["records"] if name.startswith("expert-data-parallel")]
        assert edp and all(ranks == peers for _, ranks in edp), f"rank {rank}: {edp[:5]} (peers {peers})"
        assert out["edp"] and out["ep_size"] == 2
        # ZeRO-2 with groups: the EDP reduce-scatter ran layer by layer inside backward, the whole fp32 rows are gone
        assert out["released"] == [True] * spec.steps, out["released"]


def test_one_group_issues_only_whole_world_collectives():
    spec = Spec(hecate={"enabled": True}, gate_bias=HOT, steps=3, tokens=16)
    for rank, out in enumerate(run_ranks(2, _record, spec)):
        assert out["ep_size"] == 2 and not out["edp"]
        assert {ranks for _, ranks in out["records"]} == {(0, 1)}, out["records"][:5]
        assert not any(name.startswith("expert-data-parallel") for name, _ in out["records"])
