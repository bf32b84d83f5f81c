"""A DeepSpeed-MoE training script that never imports ds_hecate and probes for DeepSpeed before importing it.

Libraries look for DeepSpeed before they use it (transformers and accelerate call
``importlib.util.find_spec("deepspeed")``, others read ``importlib.metadata`` or use ``pkgutil``), and many
scripts first import a submodule (``deepspeed.accelerator``). Run with the ``deepspeed`` launcher and a config
holding ``zero_optimization.hecate``; the installed autoload hook must still make ``deepspeed.initialize``
Hecate-aware. Prints ``autoload probe: ...`` lines for tests/test_autoload.py.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import pkgutil
import sys


def probe() -> None:
    """Every way of looking for DeepSpeed without executing it; none of them may import it (or torch)."""
    assert importlib.util.find_spec("deepspeed") is not None
    assert importlib.util.find_spec("deepspeed") is not None  # twice: a probe must not use anything up
    assert importlib.metadata.version("deepspeed")
    assert importlib.metadata.distribution("deepspeed").read_text("METADATA")
    if hasattr(pkgutil, "find_loader"):  # deprecated since 3.12, removed in 3.14
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert pkgutil.find_loader("deepspeed") is not None
    assert any(m.name == "deepspeed" for m in pkgutil.iter_modules())
    loaded = sorted(m for m in ("deepspeed", "torch", "ds_hecate") if m in sys.modules)
    print(f"autoload probe: loaded after probing {loaded}", flush=True)


def main() -> None:
    probe()
    import deepspeed.accelerator  # a submodule first: the package itself is imported on the way
    import torch
    from torch import nn
    import deepspeed
    from deepspeed.moe.layer import MoE

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=2)
    args = deepspeed.add_config_arguments(parser).parse_args()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.moe = MoE(16, expert=nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)),
                           num_experts=4, ep_size=1, k=2, drop_tokens=False, use_rts=False)
            self.out = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, l_aux, _ = self.moe(self.inp(x))
            return self.out(y).pow(2).mean() + 0.01 * l_aux

    deepspeed.init_distributed(dist_backend=deepspeed.accelerator.get_accelerator().communication_backend_name())
    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    generator = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(args.steps):
        loss = engine(torch.randn(8, 8, generator=generator))
        engine.backward(loss)
        engine.step()
    if torch.distributed.get_rank() == 0:
        print(f"autoload probe: engine.hecate={'yes' if hasattr(engine, 'hecate') else 'no'}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
