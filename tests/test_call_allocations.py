"""A layer call allocates nothing the size of an expert once it is warm (issue 41, acceptance 3).

Before issue 41 every call cast and packed the owned experts into a new buffer, autograd concatenated the buffer's
gradient into another, and SparseReduceScatter zero-filled and added into the owners' accumulator: buffers of every
owned expert, allocated per call. Now the owned experts are computed from resident weights, their weight gradients
are written into an accumulator kept across steps, and nothing per call is expert-sized. Measured by the CPU
allocator (``torch.profiler`` with ``profile_memory``): over ten calls (forward, backward, the flush of the
reductions, gradients cleared as an optimizer step leaves them) after warm-up, the allocations of at least one
expert's bytes are counted. The shape makes every token-sized tensor smaller than one expert (128 routed rows of
256 values against an expert of 393,216), so only weight-sized buffers can reach the threshold.
"""
from __future__ import annotations

import os

import pytest
import torch

CALLS = 10
HIDDEN, FFN, EXPERTS, TOKENS = 256, 512, 16, 64


def _runtime(dtype: torch.dtype):
    """A 1-rank runtime over one ``ds_hecate.MoE`` layer of SwiGLU experts, built as deepspeed.initialize does."""
    import torch.distributed as dist

    import ds_hecate
    from ds_hecate.config import split_hecate_section
    from ds_hecate.deepspeed_glue.convert import convert_model
    from ds_hecate.deepspeed_glue.initialize import build_runtime

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    layer = ds_hecate.MoE(HIDDEN, ds_hecate.SwiGLUExpert(HIDDEN, FFN), num_experts=EXPERTS, k=2, drop_tokens=False)
    model = torch.nn.ModuleDict({"moe": layer})
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": dtype == torch.bfloat16},
              "zero_optimization": {"stage": 2, "hecate": {"enabled": True, "log_conversion": False}}}
    hcfg, stripped = split_hecate_section(config)
    assert hcfg is not None
    runtime = build_runtime(hcfg, stripped, model)
    convert_model(model, runtime)
    model.to(dtype)
    return runtime, layer


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expert_sized_allocations(dtype: torch.dtype) -> tuple:
    """(allocations of at least one expert's bytes over ``CALLS`` warm calls, the expert's bytes)."""
    from torch.profiler import ProfilerActivity, profile

    runtime, layer = _runtime(dtype)
    binding = layer.binding
    expert_bytes = binding.shard.kernel.numel * torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    gates, indices = logits.softmax(-1).topk(2, dim=-1)
    indices, gates = indices.t().contiguous(), gates.t().contiguous()
    grad = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)

    def call() -> None:
        runtime.on_model_forward()
        out = binding.run(x.detach().requires_grad_(True), indices, gates)
        out.backward(grad)
        runtime.flush_reductions()
        runtime.store.zero_grads()   # what the optimizer step leaves

    for _ in range(3):
        call()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(CALLS):
            call()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return sum(1 for n in sizes if n >= expert_bytes), expert_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_expert_sized_buffer_is_allocated_per_call(dtype):
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_utils import run_ranks

    count, expert_bytes = run_ranks(1, _worker, dtype, timeout=240)[0]
    assert count == 0, f"{count} allocation(s) of at least one expert ({expert_bytes} B) over {CALLS} warm calls"


def _worker(rank: int, world: int, dtype: torch.dtype) -> tuple:
    return expert_sized_allocations(dtype)
