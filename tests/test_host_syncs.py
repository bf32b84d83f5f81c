"""One host read of the device per MoE layer call (the count exchange), none in backward (issue 24).

On CUDA every host read of a device tensor (``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``, a shape that
depends on the data, ``repeat_interleave`` without ``output_size``, ``bincount``) blocks the host until the device
has run everything queued before it; a layer call that reads more than its counts serialises the host's planning
and launches with the GPU's work. Only the counts must cross: the planner runs on them.

Under the CUDA stand-in (tests/device_shim.py), which records every such read (a grouped GEMM whose kernel would
read its offsets on the host among them: everything but bf16 on sm90/sm100), two real gloo ranks train a model
with two ``ds_hecate.MoE`` layers (top-2, token dropping, biased and bias-free experts) for a few steps, plain, with
re-materialization, with activation checkpointing (the recompute is a layer call too) and with both, in fp32, and
in bf16 on an H100's and an A100's capability. Counted:
reads inside each layer call, reads elsewhere in the forward (prefetch, hooks; DeepSpeed's gate is left out: its
own ``exp_counts`` copy is DeepSpeed's), and every read in backward outside the recomputed calls, including
the flush of the SparseReduceScatters.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from dist_utils import run_ranks

HIDDEN, EXPERTS, TOKENS, STEPS = 16, 4, 24, 3


class Block(nn.Module):
    def __init__(self, expert: nn.Module, checkpointed: bool) -> None:
        super().__init__()
        import ds_hecate
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        # No random routing (second-expert sampling, random token selection): the stand-in's random numbers come
        # from the CPU generator, which checkpoint's recompute does not restore for "cuda" tensors.
        self.moe = ds_hecate.MoE(HIDDEN, expert, num_experts=EXPERTS, k=2, capacity_factor=0.75, use_rts=False,
                                 top2_2nd_expert_sampling=False)
        self.checkpointed = checkpointed

    def forward(self, x):
        def body(h):
            y, l_aux, _ = self.moe(torch.tanh(self.inp(h)))
            return y, l_aux
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint
            return checkpoint(body, x, use_reentrant=False)
        return body(x)


class Net(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        import ds_hecate
        self.blocks = nn.ModuleList([
            Block(nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN)), checkpointed),
            Block(ds_hecate.SwiGLUExpert(HIDDEN, 2 * HIDDEN), checkpointed)])

    def forward(self, x):
        aux = 0.0
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        return x.float().pow(2).mean() + 0.01 * aux


def _count_reads(rank: int, world: int, rematerialize: bool, checkpointed: bool, dtype: torch.dtype = torch.float32,
                 capability=(9, 0)) -> Dict[str, List]:
    import torch.distributed as dist

    import device_shim
    from device_shim import cuda_shim
    from ds_hecate.comm.backend import build_communicator
    from ds_hecate.config import parse_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.runtime.hecate import HecateRuntime
    from ds_hecate.runtime.layer import LayerBinding

    dist.init_process_group("gloo", rank=rank, world_size=world)
    device_shim.CAPABILITY.append(capability)
    torch.manual_seed(0)
    model = Net(checkpointed)
    out: Dict[str, Any] = {"call_reads": [], "forward_other": [], "backward_other": []}
    with cuda_shim() as shim:
        reads = shim.host_reads
        dev = torch.device("cuda", 0)
        cfg = parse_hecate_section({"enabled": True, "reshard_interval": 0, "compute_s_per_pair": 1e-6,
                                    "link_gbps": 1.0, "non_moe_time_s": 1e-3, "rematerialize": rematerialize})
        rt = HecateRuntime(cfg, build_communicator("torch", dist.group.WORLD, rank, world, dev), dtype, world)
        convert_model(model, rt)
        model.to(dev, dtype)
        model.register_forward_pre_hook(lambda module, args: rt.on_model_forward())
        inside: List[int] = []   # reads made inside layer calls and gates, per phase

        def counted(fn, record):
            def call(*args, **kwargs):
                start = len(reads)
                try:   # a recompute may end early by an exception (checkpoint's early stop once all is recomputed)
                    return fn(*args, **kwargs)
                finally:
                    inside.append(len(reads) - start)
                    if record:
                        out["call_reads"].append(reads[start:])
            return call
        run = LayerBinding.run
        setattr(LayerBinding, "run", lambda self, *a, **k: counted(run, True)(self, *a, **k))
        block: Any
        for block in model.blocks:
            block.moe.gate.forward = counted(block.moe.gate.forward, False)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dev, dtype)
            inside.clear()
            start = len(reads)
            loss = model(x)
            out["forward_other"].append((len(reads) - start - sum(inside), reads[start:]))
            inside.clear()
            start = len(reads)
            loss.backward()
            rt.flush_reductions()
            out["backward_other"].append((len(reads) - start - sum(inside), reads[start:]))
            rt.store.zero_grads()
            for p in model.parameters():
                p.grad = None
        setattr(LayerBinding, "run", run)
    out["calls"] = len(out["call_reads"])
    return out


@pytest.mark.parametrize("rematerialize,checkpointed", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "rematerialize", "checkpointing", "rematerialize+checkpointing"])
def test_one_host_read_per_layer_call_and_none_in_backward(rematerialize, checkpointed):
    for rank, out in enumerate(run_ranks(2, _count_reads, rematerialize, checkpointed)):
        # two layers; a recompute is a call too (non-reentrant checkpointing recomputes the first block twice:
        # once for its l_aux, once for the main path)
        assert out["calls"] == STEPS * 2 if not checkpointed else out["calls"] >= STEPS * 4, out["calls"]
        assert all(r == ["device-to-host copy"] for r in out["call_reads"]), \
            f"rank {rank}: host reads inside layer calls: {out['call_reads']}"
        assert [n for n, _ in out["forward_other"]] == [0] * STEPS, \
            f"rank {rank}: forward reads outside the calls (all the forward's reads: {out['forward_other']})"
        assert [n for n, _ in out["backward_other"]] == [0] * STEPS, \
            f"rank {rank}: backward reads outside recomputed calls (all: {out['backward_other']})"


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)], ids=["sm90", "sm80"])
def test_bf16_layer_calls_read_only_their_counts(capability):
    """bf16: grouped GEMMs where their kernel takes the offsets on the device (sm90), the GEMMs over the host sizes
    where it would copy them to the host (sm80); the biased experts take the per-expert loop. One read per call
    either way (fp32, above, always loops over the host sizes on CUDA)."""
    for rank, out in enumerate(run_ranks(2, _count_reads, False, False, torch.bfloat16, capability)):
        assert out["calls"] == STEPS * 2, out["calls"]
        assert all(r == ["device-to-host copy"] for r in out["call_reads"]), \
            f"rank {rank}: host reads inside layer calls: {out['call_reads']}"
        assert [n for n, _ in out["backward_other"]] == [0] * STEPS, \
            f"rank {rank}: backward reads outside recomputed calls (all: {out['backward_other']})"
