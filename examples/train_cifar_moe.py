"""DeepSpeed's MoE tutorial (DeepSpeedExamples training/cifar, ``run_ds_moe.sh``) with Hecate.

Same network, MoE layer arguments (ep_size 2, two experts, top-1, noisy gate ``RSample``), separate MoE parameter
groups and DeepSpeed config (fp16, dynamic loss scale, ZeRO stage 0: ``ds_configs/ds_cifar_moe.json``, the tutorial's
configuration plus the ``hecate`` key). Trains, then runs the tutorial's test pass (``engine.eval()``,
``torch.no_grad()``, batches of 4). Data: CIFAR-10 with ``--data cifar`` (torchvision, downloads), synthetic
CIFAR-shaped images otherwise. ``--no-hecate`` runs plain DeepSpeed data parallelism (ep_size 1, no hecate key),
the trajectory Hecate's run follows::

    deepspeed --num_gpus 2 examples/train_cifar_moe.py --deepspeed_config ds_configs/ds_cifar_moe.json

``python -m ds_hecate.tools.launch`` in place of ``deepspeed`` (the same arguments) also removes the job's CPU
all-reduce buffers from /dev/shm when it ends, which ``deepspeed`` leaves for a ``--no-hecate`` run
(docs/troubleshooting.md).
"""
from __future__ import annotations

import argparse
import copy
import json
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

import ds_hecate  # noqa: F401  (makes deepspeed.initialize Hecate-aware)


class Net(nn.Module):
    """The tutorial's network; ``width`` shrinks the convolutions for fast tests (6 = the tutorial's)."""

    def __init__(self, num_experts: List[int], ep_size: int, top_k: int = 1,
                 noisy_gate_policy: Optional[str] = "RSample", width: int = 6, hidden: int = 84) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(width, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, hidden)
        fc3 = nn.Linear(hidden, hidden)
        self.moe_layer_list = nn.ModuleList([
            deepspeed.moe.layer.MoE(hidden_size=hidden, expert=fc3, num_experts=n, ep_size=ep_size, k=top_k,
                                    min_capacity=0, noisy_gate_policy=noisy_gate_policy)
            for n in num_experts])
        self.fc4 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc1(x.view(-1, 16 * 5 * 5)))
        x = F.relu(self.fc2(x))
        for layer in self.moe_layer_list:
            x, _, _ = layer(x)
        return self.fc4(x)


def load_config(path: str, hecate: bool) -> dict:
    """The tutorial config; without Hecate the ``hecate`` key is removed (plain DeepSpeed)."""
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if not hecate:
        cfg = copy.deepcopy(cfg)
        cfg.get("zero_optimization", {}).pop("hecate", None)
    return cfg


def synthetic_cifar(n: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-shaped images in [-1, 1] (the tutorial's normalization) whose label depends on the image."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 3, 32, 32, generator=g) * 2 - 1
    labels = (images[:, 0, :8, :8].mean((1, 2)) * 40 + images[:, 1, 8:16, 8:16].mean((1, 2)) * 40).long() % 10
    return images, labels


def train_and_test(cfg: dict, ep_size: int, steps: int, seed: int = 1234, width: int = 6, test_images: int = 64,
                   test_batch_size: int = 4, data: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Dict:
    """Train ``steps`` steps on this rank's share, then the tutorial's test pass; returns per-step losses and
    test accuracy/outputs (every rank tests every batch, as the tutorial does)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = get_accelerator().current_device_name()
    torch.manual_seed(seed)
    net = Net([2], ep_size=ep_size, width=width)
    parameters = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in net.parameters()], "name": "parameters"})
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=parameters, config=cfg)
    dtype = torch.half if engine.fp16_enabled() else torch.bfloat16 if engine.bfloat16_enabled() else None
    micro = engine.train_micro_batch_size_per_gpu()
    images, labels = data if data is not None else synthetic_cifar(steps * micro * world + test_images, seed)
    criterion = nn.CrossEntropyLoss()
    torch.manual_seed(seed + 1)  # the noisy gate and random token selection draw from here, in both runs alike
    losses = []
    for step in range(steps):
        start = (step * world + rank) * micro
        x, y = images[start:start + micro], labels[start:start + micro]
        outputs = engine((x.to(dtype) if dtype else x).to(device))
        loss = criterion(outputs, y.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    test_x, test_y = images[-test_images:], labels[-test_images:]
    engine.eval()
    correct, outs = 0, []
    with torch.no_grad():
        for i in range(0, test_images, test_batch_size):
            x = test_x[i:i + test_batch_size]
            out = engine((x.to(dtype) if dtype else x).to(device)).float().cpu()
            outs.append(out)
            correct += int((out.argmax(1) == test_y[i:i + test_batch_size]).sum())
    return {"losses": losses, "accuracy": correct / test_images, "test_outputs": torch.cat(outs),
            "scales": float(getattr(engine.optimizer, "loss_scale", 1.0))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", default="ds_configs/ds_cifar_moe.json")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--no-hecate", action="store_true", help="plain DeepSpeed, ep_size 1 (the reference)")
    parser.add_argument("--data", choices=["synthetic", "cifar"], default="synthetic")
    args = parser.parse_args()
    deepspeed.init_distributed()
    cfg = load_config(args.deepspeed_config, hecate=not args.no_hecate)
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and cfg.get("fp16", {}).get("enabled"):
        # DeepSpeed refuses fp16 on CPUs without native fp16 matmul; torch emulates it, so let it run (slowly).
        accelerator.is_fp16_supported = lambda: True
        if torch.float16 not in accelerator.supported_dtypes():
            supported = accelerator.supported_dtypes
            accelerator.supported_dtypes = lambda: supported() + [torch.float16]
    data = None
    if args.data == "cifar":
        import torchvision
        from torchvision import transforms

        tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
        sets = [torchvision.datasets.CIFAR10(root="./data", train=train, download=True, transform=tf)
                for train in (True, False)]
        pairs = [sets[0][i] for i in range(min(len(sets[0]), args.steps * 16))] + [sets[1][i] for i in range(64)]
        data = (torch.stack([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs]))
    out = train_and_test(cfg, ep_size=1 if args.no_hecate else 2, steps=args.steps, data=data)
    if torch.distributed.get_rank() == 0:
        losses = out["losses"]
        for i in range(0, len(losses), 10):
            print(f"step {i + 1:4d} loss {sum(losses[i:i + 10]) / len(losses[i:i + 10]):.4f}")
        print(f"Accuracy of the network on the 64 test images: {100 * out['accuracy']:.0f} %")


if __name__ == "__main__":
    main()
