"""Hecate with a working device that is not the CPU (issue 15), on CPU-only machines.

The device shim (tests/device_shim.py) gives tensors that say ``cuda:0`` but compute on the CPU, refuses every op
that mixes them with CPU tensors the way CUDA does, and lets torch.distributed's collectives take only tensors on
the working device (as NCCL does). Under it, real gloo ranks run Hecate's take-over, forward, backward, step, cost
measurement, re-sharding with optimizer state, checkpoint save/load and consolidation, in fp32, bf16 and fp16, and
the losses must equal the same run on the CPU bit for bit.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Dict

import pytest
import torch
from torch import nn

from dist_utils import run_ranks

HIDDEN, EXPERTS, TOKENS, STEPS = 16, 4, 24, 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _one_expert_path(monkeypatch):
    """The CPU run and the stand-in CUDA run must compute alike: on the CPU, calls with few experts take the
    per-expert loop and "cuda" takes grouped GEMM (ops/grouped_experts), so both runs are held to grouped GEMM (what
    a GPU runs; the ranks inherit the environment)."""
    monkeypatch.setenv("DS_HECATE_GROUPED_MM", "1")


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        import ds_hecate
        expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.ReLU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        if kind == "deepspeed":
            from deepspeed.moe.layer import MoE
            self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, k=2, drop_tokens=False)
        else:
            self.moe = ds_hecate.MoE(HIDDEN, expert, num_experts=EXPERTS, k=2, drop_tokens=False)

    def forward(self, x):
        y, l_aux, _ = self.moe(self.inp(x))
        return y.float().pow(2).mean() + 0.01 * l_aux.float()


def _train(rank: int, world: int, device: str, kind: str, dtype_name: str, reshard_to):
    """One Hecate training run on this rank's ``device`` ("cuda" = the shim); returns losses, final masters and
    what the checks saw."""
    import contextlib

    import torch.distributed as dist

    from device_shim import cuda_shim
    import ds_hecate  # noqa: F401  (patches deepspeed)
    from ds_hecate.deepspeed_glue import checkpoint
    from ds_hecate.runtime import resharding
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.deepspeed_glue.expert_optimizer import attach_expert_optimizer
    from ds_hecate.comm.backend import build_communicator
    from ds_hecate.runtime.hecate import HecateRuntime

    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    model = Net(kind)
    shim = cuda_shim() if device == "cuda" else contextlib.nullcontext()
    out: Dict[str, Any] = {"losses": []}
    with shim as active:
        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        # configured costs win over the measured ones (still measured, and checked): the placements, and so the
        # float summation order, must not depend on how fast this machine happened to be in each run
        cfg = parse_hecate_section({"enabled": True, "reshard_interval": 0, "compute_s_per_pair": 1e-6,
                                    "link_gbps": 1.0, "non_moe_time_s": 0.0})
        comm = build_communicator("torch", dist.group.WORLD, rank, world, dev)
        rt = HecateRuntime(cfg, comm, dtype, world)
        convert_model(model, rt)
        out["master_devices"] = sorted({str(p.device) for p in rt.store.parameters()})
        model.to(dtype).to(dev)   # dtype first: the shim cannot follow `.data =` on its tensors
        dense = torch.optim.SGD(model.parameters(), lr=0.05)
        attach_expert_optimizer(rt, torch.optim.AdamW, [dense.param_groups[0]])
        model.register_forward_pre_hook(lambda module, args: rt.on_model_forward())
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(1, STEPS + 1):
            x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dev).to(dtype)
            loss = model(x)
            loss.backward()
            rt.flush_reductions()
            norm = rt.expert_grad_norm(world)
            for p in model.parameters():
                if p.grad is not None:
                    comm.all_reduce(p.grad, collective="test dense all-reduce")
                    p.grad.div_(world)
            dense.step()
            dense.zero_grad()
            rt.last_total_norm = norm
            assert rt.optimizer is not None
            rt.apply_step(True, world, 1.0, 0.0, rt.optimizer.current_hyperparameters())
            rt.after_step(step)   # measures the cost model at step 1
            if step == 2 and reshard_to is not None:   # heterogeneous re-sharding with optimizer state
                resharding.heterogeneous_sharding = lambda *a, **k: [tuple(reshard_to)]
                assert resharding.reshard(rt)
            out["losses"].append(float(loss.detach().float()))
        out["measured"] = sorted(rt.measured)
        out["owned"] = rt.bindings[0].shard.owned
        full = rt.full_expert_weights()   # consolidation (collective)
        out["full"] = {k: v.cpu() for k, v in full.items()}
        # checkpoint round trip: save, perturb, load, same masters and optimizer state
        directory = os.path.join(tempfile.gettempdir(), f"hecate_dev_ckpt_{os.environ['MASTER_PORT']}")
        checkpoint.save(rt, directory)
        checkpoint.mark_complete(rt, directory, "tag")   # as the engine does once DeepSpeed's files are written
        before = {e: p.detach().cpu().clone() for e, p in rt.bindings[0].shard.masters.items()}
        for p in rt.store.parameters():
            p.data.add_(1.0)
        checkpoint.prepare_load(rt, directory, True)()
        shard = rt.bindings[0].shard
        out["ckpt_equal"] = all(torch.equal(shard.masters[e].detach().cpu(), before[e]) for e in before)
        assert rt.optimizer is not None
        out["ckpt_devices"] = sorted({str(p.device) for p in rt.store.parameters()} |
                                     {str(v.device) for p in rt.store.parameters()
                                      for v in rt.optimizer.state_of(p).values()
                                      if torch.is_tensor(v) and v.dim() > 0})
        out["collectives"] = sorted(set(active.collectives)) if active is not None else []
    return out


def _worlds(world, kind, dtype_name, reshard_to=None):
    cpu = run_ranks(world, _train, "cpu", kind, dtype_name, reshard_to)
    cuda = run_ranks(world, _train, "cuda", kind, dtype_name, reshard_to)
    return cpu, cuda


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16", "fp16"])
def test_training_on_a_cuda_working_device_matches_cpu(dtype_name):
    """Take-over (ds_hecate.MoE), forward, backward, step, cost measurement, re-sharding with optimizer state,
    checkpoint save/load and consolidation with every tensor on the working device; same losses as the CPU run."""
    cpu, cuda = _worlds(2, "hecate", dtype_name, reshard_to=(1, 1, 0, 0))
    for c, g in zip(cpu, cuda):
        assert g["master_devices"] == ["cuda:0"]
        assert g["losses"] == c["losses"]
        assert g["owned"] == c["owned"] and g["owned"] == ([2, 3] if g is cuda[0] else [0, 1])
        assert "compute_s_per_pair" in g["measured"] and "link_gbps" in g["measured"]
        assert all(torch.equal(g["full"][k], c["full"][k]) for k in c["full"])
        assert g["ckpt_equal"] and g["ckpt_devices"] == ["cuda:0"]
        assert {"all_to_all_single", "all_reduce", "broadcast"} <= set(g["collectives"])
        assert {"all_gather_into_tensor", "all_gather_single"} & set(g["collectives"])


def test_deepspeed_moe_take_over_puts_masters_on_the_working_device():
    """A deepspeed.moe MoE built on the CPU (as in the examples): masters land on the working device (one expert
    per rank has nothing to send at take-over), and training matches the CPU run."""
    cpu, cuda = _worlds(2, "deepspeed", "fp32")
    for c, g in zip(cpu, cuda):
        assert g["master_devices"] == ["cuda:0"] and g["losses"] == c["losses"]


def test_grad_norm_on_a_rank_that_owns_no_expert():
    """Fewer experts than ranks: the rank without experts reduces a zero on the working device (not a CPU zero)."""
    results = run_ranks(2, _one_expert_norm)
    assert results == [("cuda", 0.0), ("cuda", 0.0)]


def _one_expert_norm(rank, world):
    import torch.distributed as dist

    from device_shim import cuda_shim
    from ds_hecate.comm.backend import build_communicator
    from ds_hecate.runtime.shard_store import ExpertShardStore

    dist.init_process_group("gloo", rank=rank, world_size=world)
    with cuda_shim():
        comm = build_communicator("torch", dist.group.WORLD, rank, world, torch.device("cuda", 0))
        sq = ExpertShardStore(comm.device).grad_sq_sum()   # owns nothing
        comm.all_reduce(sq.reshape(1), collective="expert gradient-norm all-reduce")
        return sq.device.type, float(sq.cpu())


def test_cost_measurement_on_the_working_device():
    """The link probe and the agreed cost figures travel on the working device, through the communicator."""
    results = run_ranks(2, _measure)
    assert results[0] == results[1] and "link_gbps" in results[0]


def _measure(rank, world):
    import torch.distributed as dist

    from device_shim import cuda_shim
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.comm.backend import build_communicator
    from ds_hecate.runtime.hecate import HecateRuntime

    dist.init_process_group("gloo", rank=rank, world_size=world)
    with cuda_shim() as shim:
        comm = build_communicator("torch", dist.group.WORLD, rank, world, torch.device("cuda", 0))
        rt = HecateRuntime(parse_hecate_section({"enabled": True}), comm, torch.float32, world)
        rt.measure_costs()
        assert "broadcast" in shim.collectives
    return sorted(rt.measured)
