"""Reproducer (plain DeepSpeed, no ds_hecate): with a model-parallel unit, DeepSpeed's ZeRO-1/2 global gradient norm
leaves out expert gradients.

4 ranks: tensor-parallel size 2 (an ``mpu`` laid out as Megatron's: tensor-parallel groups {0, 1} and {2, 3},
data-parallel groups {0, 2} and {1, 3}), one ``deepspeed.moe.layer.MoE`` of 4 experts with ``ep_size`` 2, ZeRO stage 1
or 2, fp32, one step. The script prints the norm ``engine.get_global_grad_norm()`` reports and the norm of every unique
gradient gathered on rank 0 (each dense parameter once, each expert once, from ``safe_get_full_grad``), and where the
difference goes: DeepSpeed's expert-parallel groups are consecutive world ranks ({0, 1} and {2, 3}), so experts 2 and 3
live only on ranks 1 and 3, both of tensor-parallel rank 1, and ``DeepSpeedZeroOptimizer.get_grad_norm_direct``
counts a parameter that is not tensor-parallel only on model-parallel rank 0. The reported norm equals the gathered
norm without those experts. Clipping (``gradient_clipping``) then uses the smaller norm.

Run (CPU; on GPUs drop ``DS_ACCELERATOR=cpu``)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 examples/deepspeed_tp_moe_grad_norm.py --stage 2
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

HIDDEN, EXPERTS, EP_SIZE, TP_SIZE = 8, 4, 2, 2


class MPU:
    """Megatron's layout: tensor-parallel groups of consecutive ranks, data-parallel groups across them."""

    def __init__(self) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.rank = rank
        for first in range(0, world, TP_SIZE):
            group = dist.new_group(list(range(first, first + TP_SIZE)))
            if first <= rank < first + TP_SIZE:
                self.tp_group = group
        for tp in range(TP_SIZE):
            group = dist.new_group(list(range(tp, world, TP_SIZE)))
            if rank % TP_SIZE == tp:
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return self.rank % TP_SIZE

    def get_model_parallel_world_size(self) -> int:
        return TP_SIZE

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.rank // TP_SIZE

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size() // TP_SIZE

    def get_data_parallel_group(self):
        return self.dp_group


def gather_on_gloo() -> None:
    """DeepSpeed's MoE all-gathers its tensor-parallel token shares into a flat buffer; gloo wants the input shaped
    like one slot of it (NCCL takes any shape): the same elements, flattened."""
    import deepspeed.comm as ds_comm

    original = ds_comm.all_gather_into_tensor

    def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, **kwargs):
        if output_tensor.dim() == 1 and tensor.dim() > 1:
            tensor = tensor.reshape(-1)
        return original(output_tensor, tensor, group=group, async_op=async_op, **kwargs)
    ds_comm.all_gather_into_tensor = all_gather_into_tensor


def main() -> None:
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups, safe_get_full_grad

    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2))
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed()
    if dist.get_backend() == "gloo":
        gather_on_gloo()
    torch.manual_seed(0)
    mpu = MPU()
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN),
                          MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, ep_size=EP_SIZE, k=1))
    experts = model[1].deepspeed_moe.experts.deepspeed_experts
    for p in experts.parameters():   # distinct experts: expert e's values depend on e only
        nn.init.normal_(p, std=0.3)
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": args.stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config, mpu=mpu)
    device = engine.device
    gen = torch.Generator().manual_seed(mpu.get_data_parallel_rank())   # a tensor-parallel slice shares its data
    x = torch.randn(16, HIDDEN, generator=gen).to(device)
    out, l_aux, _ = engine(x)
    engine.backward(out.pow(2).mean() + 0.01 * l_aux)

    ep_rank = groups._get_expert_parallel_rank(model[1].expert_group_name)
    grads = {}
    for name, p in engine.module.named_parameters():   # every full gradient (collective), one key per parameter
        grad = safe_get_full_grad(p)
        if "deepspeed_experts" in name:   # local expert i is global expert ep_rank * num_local + i
            local, rest = name.split("deepspeed_experts.")[1].split(".", 1)
            name = f"expert {ep_rank * len(experts) + int(local)} {rest}"
        grads[name] = grad.detach().double().pow(2).sum().item()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (mpu.get_model_parallel_rank(), grads))
    engine.step()
    if dist.get_rank() == 0:
        every, tp0 = {}, set()
        for tp_rank, part in parts:
            every.update(part)
            tp0.update(part if tp_rank == 0 else ())
        held = {}
        for rank, (tp_rank, part) in enumerate(parts):
            for key in part:
                held.setdefault(key.rsplit(" ", 1)[0] if key.startswith("expert") else key, set()).add(rank)
        only_tp1 = sorted(k for k, ranks in held.items() if all(r % TP_SIZE for r in ranks))
        reported = float(engine.get_global_grad_norm())
        print(f"ZeRO {args.stage}, tensor-parallel size {TP_SIZE}, ep_size {EP_SIZE}, {EXPERTS} experts")
        print(f"  engine.get_global_grad_norm():                       {reported:.6f}")
        print(f"  norm of every unique gradient, gathered on rank 0:   {sum(every.values()) ** 0.5:.6f}")
        print(f"  the same without what only tensor-parallel rank 1 holds: "
              f"{sum(v for k, v in every.items() if k in tp0) ** 0.5:.6f}")
        print(f"  held only by ranks of tensor-parallel rank 1: {only_tp1}")


if __name__ == "__main__":
    main()
