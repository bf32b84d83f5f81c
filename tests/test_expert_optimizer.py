"""The expert optimizer (ds_hecate.deepspeed_glue.expert_optimizer): each piece of an expert steps with its own
group's settings, read at every step; a master's state moves as whole vectors and comes back intact; and the step
counts are kept without ever reading one back from its tensor (issue 53, defect 7: a ``float(state["step"])`` per
parameter per step was a device sync whenever the counter lives on the GPU, as with fused or capturable Adam).

The unit tests run in this process (no DeepSpeed engine, a fraction of a second); the host-read test trains a
1-rank DeepSpeed engine with Hecate over an optimizer whose step counters are stand-ins for device tensors that
count every host read (about 5 s).
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from dist_utils import run_ranks
from ds_hecate.deepspeed_glue.expert_optimizer import ExpertOptimizer, Segment

# what reads a tensor's value back to the host: on a device tensor each is a sync
HOST_READS = {"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu"}


class DeviceStep(torch.Tensor):
    """A step counter standing in for one on the GPU: counts every host read of its value."""

    reads: List[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


class StepOnDeviceSGD(torch.optim.Optimizer):
    """SGD with weight decay whose step counter is a :class:`DeviceStep` tensor, incremented (like DeepSpeed's
    FusedAdam) only in the state of the last parameter of each group that had a gradient."""

    def __init__(self, params, lr: float = 0.1, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            state = None
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(()).as_subclass(DeviceStep)
                p.add_(p.grad + group["weight_decay"] * p, alpha=-group["lr"])
            if state is not None:
                state["step"] += 1


def test_each_piece_steps_with_its_groups_settings_read_at_every_step():
    weights = {"lr": 0.1, "weight_decay": 0.0}
    biases = {"lr": 0.2, "weight_decay": 0.5}
    opt = ExpertOptimizer(StepOnDeviceSGD, [weights, biases])
    opt.register_layer(0, [Segment(0, 0, 3), Segment(1, 3, 5)])
    master = nn.Parameter(torch.ones(5), requires_grad=False)
    opt.add(0, master, {})
    master.grad = torch.ones(5)
    opt.step(1.0, opt.current_hyperparameters())
    assert torch.allclose(master, torch.tensor([0.9, 0.9, 0.9, 0.7, 0.7]))
    biases["lr"] = 0.0   # a scheduler sets the source group: the next step follows it
    weights["weight_decay"] = 1.0
    master.grad = torch.ones(5)
    opt.step(1.0, opt.current_hyperparameters())
    assert torch.allclose(master, torch.tensor([0.9 - 0.1 * 1.9] * 3 + [0.7, 0.7]))


def _adam_with(master: nn.Parameter, offset: int) -> ExpertOptimizer:
    opt = ExpertOptimizer(torch.optim.Adam, [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.02, "weight_decay": 0.0}])
    opt.register_layer(7, [Segment(0, 0, 5), Segment(1, 5, 8)], offset)
    return opt


def test_a_partitioned_masters_state_moves_whole_and_steps_on_as_before():
    """A peer's slice (columns 3..7 of an 8-column expert, cut by the segment boundary at 5) stepped twice, its
    state taken whole and given to another optimizer: both then take the same third step."""
    torch.manual_seed(0)
    master = nn.Parameter(torch.randn(4), requires_grad=False)
    opt = _adam_with(master, offset=3)
    opt.add(7, master, {})
    grads = [torch.randn(4) for _ in range(3)]
    for grad in grads[:2]:
        master.grad = grad.clone()
        opt.step(1.0, opt.current_hyperparameters())
    state = opt.state_of(master)
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"] and state["exp_avg"].shape == (4,)
    assert float(state["step"]) == 2
    moved = nn.Parameter(master.detach().clone(), requires_grad=False)
    other = _adam_with(moved, offset=3)
    other.add(7, moved, state)
    opt.remove(master)
    opt.add(7, master, state)   # and back: the same state again
    for param, optimizer in ((master, opt), (moved, other)):
        param.grad = grads[2].clone()
        optimizer.step(1.0, optimizer.current_hyperparameters())
    assert torch.equal(master, moved)
    assert all(torch.equal(a, b) for a, b in zip(opt.state_of(master).values(), other.state_of(moved).values()))


# -- defect 7: no host read of a step counter ---------------------------------------------------------------------
def _train(rank: int, split_biases: bool) -> Dict[str, object]:
    import deepspeed
    from moe_training import Spec, TinyMoE, batch

    spec = Spec(steps=4, tokens=16)
    torch.manual_seed(spec.seed)
    model = TinyMoE(spec)
    named = list(model.named_parameters())
    groups = ([{"params": [p for n, p in named if not n.endswith(".bias")], "weight_decay": 0.1},
               {"params": [p for n, p in named if n.endswith(".bias")], "weight_decay": 0.0}] if split_biases else
              [{"params": [p for _, p in named], "weight_decay": 0.1}])
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0, "hecate": {"enabled": True}},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=StepOnDeviceSGD(groups, lr=0.05), config=config)
    reads = []
    for step in range(spec.steps):
        x, y, used = batch(spec, step, 0, rank, torch.float32)
        engine.backward(engine(x, y, used))
        DeviceStep.reads.clear()
        engine.step()
        reads.extend(DeviceStep.reads)
    expert_steps = sorted({int(s["step"]) for s in engine.hecate.optimizer.optimizer.state.values()})
    return {"reads": reads, "expert_steps": expert_steps, "groups": len(engine.hecate.optimizer.param_groups)}


def _train_reading_nothing(rank: int, world: int) -> Dict[str, Dict[str, object]]:
    import deepspeed
    import ds_hecate  # noqa: F401  (patches deepspeed.initialize)

    deepspeed.init_distributed(dist_backend="gloo")
    return {"one group": _train(rank, False), "weights and biases": _train(rank, True)}


def test_the_step_counts_are_set_without_a_host_read():
    """Four engine steps, the experts in one param group and in two (weights, biases), over an optimizer that
    increments only the last parameter's counter: no step counter is read back (each would be a device sync on a
    GPU), and every expert piece ends with its group's count."""
    results = run_ranks(1, _train_reading_nothing, timeout=200)[0]
    for name, groups in (("one group", 1), ("weights and biases", 2)):
        result = results[name]
        assert result["reads"] == [], f"{name}: host reads of step counters during engine.step: {result['reads']}"
        assert result["groups"] == groups and result["expert_steps"] == [4], (name, result)
