"""``ds_hecate.initialize``: ``deepspeed.initialize`` with Hecate taking over the experts.

Same signature and return value as ``deepspeed.initialize``. Without an enabled ``hecate`` section it is a pure
pass-through. With one: validate, refuse unsupported combinations, convert the MoE layers (experts leave the
model and go to the shard store), prune expert parameters from the optimizer inputs, call DeepSpeed with the
section removed, then swap the engine class to :class:`HecateEngine` and finish the expert-side setup.

:func:`patch_deepspeed` (run by ``import ds_hecate``) rebinds ``deepspeed.initialize`` to this function and lets
DeepSpeed's ZeRO config model accept the nested ``zero_optimization.hecate`` key (so HF's ``zero.Init`` and other
places that build a DeepSpeed config do not reject it).
"""
from __future__ import annotations

import copy
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..comm.exit_guard import release_gloo_works_at_exit
from ..config import HecateConfig, parse_hecate_section, split_hecate_section
from ..errors import HecateConfigError, HecateUnsupportedError
from ..logging_utils import log_rank0, quiet_renamed_all_gather_warning
from .model_parallel import refuse_unsupported_mpu
from .setup_errors import same_on_every_rank
from .shm_buffers import unlink_own_buffer_after_attach

if TYPE_CHECKING:
    from ..runtime.hecate import HecateRuntime

_ORIGINAL_INITIALIZE = None


def _load_config(args: Any, config: Any, config_params: Any) -> Tuple[Optional[Dict[str, Any]], str]:
    """Resolve the DeepSpeed config the way deepspeed.initialize does; returns (dict or None, where)."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    if config is None and config_params is not None:
        config = config_params
    where = "config"
    if config is None and getattr(args, "deepspeed_config", None) is not None:
        config, where = args.deepspeed_config, "args.deepspeed_config"
    if config is None:
        return None, where
    return (config if isinstance(config, dict) else load_ds_config(config)), where


def _refuse_unsupported(cfg: Dict[str, Any], model: Any) -> None:
    """Fail fast on DeepSpeed modes Hecate does not support yet, never train them wrongly (the mpu's:
    :func:`.model_parallel.refuse_unsupported_mpu`)."""
    from deepspeed.runtime.pipe.module import PipelineModule

    def enabled(section: str) -> bool:
        value = cfg.get(section)
        return isinstance(value, dict) and bool(value.get("enabled", False))

    if enabled("expert_parallel"):
        raise HecateConfigError("hecate cannot be combined with DeepSpeed's expert_parallel (AutoEP): both would own "
                                "the experts; set expert_parallel.enabled to false or remove the hecate section")
    zero = cfg.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    problems = []
    if stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage {stage}")
    if stage == 0 and enabled("fp16") and isinstance(cfg.get("optimizer"), dict) and cfg["optimizer"].get(
            "legacy_fusion"):
        problems.append("fp16 with ZeRO stage 0 and optimizer.legacy_fusion (FP16_Optimizer's legacy fused-Adam "
                        "step; remove legacy_fusion)")
    if isinstance(zero, dict) and any(zero.get(k) for k in ("offload_optimizer", "offload_param")):
        problems.append("ZeRO-Offload (offload_optimizer / offload_param)")
    if isinstance(zero, dict) and zero.get("zenflow"):
        problems.append("ZenFlow")
    if enabled("hybrid_engine"):
        problems.append("the hybrid engine")
    if isinstance(cfg.get("compile"), dict) and cfg["compile"].get("deepcompile"):
        problems.append("DeepCompile (compile.deepcompile)")
    if enabled("torch_autocast"):
        problems.append("torch_autocast")
    if (cfg.get("tensor_parallel") or {}).get("autotp_size", 0) not in (0, 1, None):
        problems.append("AutoTP (tensor_parallel.autotp_size > 1)")
    if cfg.get("sequence_parallel_size", 1) not in (1, None):
        problems.append("sequence parallelism (sequence_parallel_size > 1)")
    if isinstance(model, PipelineModule):
        problems.append("the pipeline engine (PipelineModule)")
    if problems:
        raise HecateUnsupportedError("hecate does not support " + "; ".join(problems) + " yet")


def _compute_dtype(cfg: Dict[str, Any]) -> torch.dtype:
    """The dtype DeepSpeed runs the model in, which Hecate materializes experts in (masters stay fp32)."""
    bf16 = cfg.get("bf16") or cfg.get("bfloat16") or {}
    if isinstance(bf16, dict) and bf16.get("enabled"):
        return torch.bfloat16
    fp16 = cfg.get("fp16") or {}
    return torch.float16 if isinstance(fp16, dict) and fp16.get("enabled") else torch.float32


def _ranks_per_node(hcfg: HecateConfig, world_size: int) -> int:
    if hcfg.ranks_per_node is not None:
        if world_size % hcfg.ranks_per_node:
            raise HecateConfigError(f"hecate.ranks_per_node={hcfg.ranks_per_node} does not divide the world size "
                                    f"{world_size}")
        return hcfg.ranks_per_node
    # The deepspeed launcher, torchrun, Open MPI and MPICH (hydra) each name it differently. LOCAL_SIZE first:
    # under the deepspeed launcher accelerate (HF Trainer) sets LOCAL_WORLD_SIZE=1 on CPU when it finds none of
    # the variables it knows.
    for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        local = os.environ.get(key)
        if local and local.isdigit() and int(local) > 0 and world_size % int(local) == 0:
            return int(local)
    return world_size


def _prepare(args: Any, config: Any, config_params: Any, passthrough: Dict[str, Any], model: Any, mpu: Any):
    """Everything decided from the config and the model before any set-up: None without a hecate section, else
    (the validated section, the config without it, DeepSpeed's call). Raises on an invalid section and on modes,
    models or model-parallel units Hecate cannot run: before DeepSpeed builds anything."""
    ds_config, where = _load_config(args, config, config_params)
    if ds_config is None:
        return None
    hcfg, stripped = split_hecate_section(ds_config)
    if hcfg is None:
        return None
    if where == "args.deepspeed_config":
        args = copy.copy(args)
        args.deepspeed_config = None
    call = dict(passthrough, args=args, config=stripped, config_params=None)
    if hcfg.enabled:
        _refuse_unsupported(stripped, model)
        if model is None:
            raise HecateConfigError("deepspeed.initialize requires a model")
        from .convert import check_convertible
        refuse_unsupported_mpu(mpu, check_convertible(model))
    return hcfg, stripped, call


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: Optional[bool] = None,
               collate_fn: Any = None, config: Any = None, mesh_param: Any = None, config_params: Any = None):
    """Drop-in for ``deepspeed.initialize`` that lets Hecate own the experts when the config enables it."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    original = _ORIGINAL_INITIALIZE or deepspeed.initialize
    passthrough = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                       training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                       mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                       mesh_param=mesh_param, config_params=config_params)
    with same_on_every_rank():   # errors of the config and the model: every rank raises the same, before set-up
        prepared = _prepare(args, config, config_params, passthrough, model, mpu)
    if prepared is None:
        return original(**passthrough)
    hcfg, stripped, call = prepared
    if not hcfg.enabled:
        return original(**call)
    assert model is not None   # _prepare refuses an enabled section without a model

    quiet_renamed_all_gather_warning()  # before DeepSpeed's first ZeRO all-gather
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=distributed_port, dist_init_required=dist_init_required)
    unlink_own_buffer_after_attach()   # DeepSpeed's CPU all-reduce files in /dev/shm: freed when the ranks exit
    runtime = build_runtime(hcfg, stripped, model, mpu)
    from .convert import convert_model
    from .expert_optimizer import group_settings
    from .param_groups import building_engine, prune_expert_params
    removed = convert_model(model, runtime)
    names = dict(enumerate(runtime.layer_names))
    model_parameters, sources = prune_expert_params(optimizer, model_parameters, removed, names)
    call.update(model_parameters=model_parameters)
    emptied = sources.emptied_groups()
    settings_at_build = {id(g): group_settings(g) for g in emptied.groups()}   # before any DeepSpeed scheduler

    with building_engine(emptied):   # its LR scheduler sees the emptied groups (param_groups.EmptiedGroups)
        engine, engine_optimizer, dataloader, scheduler = original(**call)
    attach_engine(engine, runtime, sources, emptied, settings_at_build)
    hf_takeover = model.__dict__.get("_hecate_hf")  # HF model: keep save_model / state_dict / counts whole
    if hf_takeover is not None:
        hf_takeover.attach(engine)
    if hcfg.log_conversion:
        log_rank0(runtime.summary())
    return engine, engine_optimizer, dataloader, scheduler


def build_runtime(hcfg: HecateConfig, ds_config: Dict[str, Any], model: Optional[torch.nn.Module] = None,
                  mpu: Any = None, one_rank_shortcuts: bool = True) -> HecateRuntime:
    """Hecate's process groups (its own communicators, with their own timeout) and an empty runtime with its
    observers (step metrics, routing trace) installed.

    The group size ``G`` (``hecate.ep_size``, else the rule of :func:`ds_hecate.planning.groups.resolve_ep_size` on
    ``model``'s MoE layers) splits the world into groups of consecutive ranks; with a model-parallel unit ``mpu`` of
    tensor-parallel size above 1, into groups of consecutive data-parallel ranks of each tensor-parallel rank
    (:mod:`.model_parallel`). Per group two process groups: token traffic, and weight traffic on its own (its own
    NCCL communicator and stream, so token traffic never queues behind it: ds_hecate.comm.collectives); with more
    than one group also the world's and, per local rank, its expert-data-parallel peers' (``ds_hecate.runtime.edp``);
    with tensor parallelism, per data-parallel slice, its tensor-parallel peers'. ``new_group`` is collective over
    the whole world, so every rank creates every group, in the same order. ``one_rank_shortcuts=False`` makes a
    1-rank group's communicator issue its collectives through the transport like N ranks (benchmarks only: see
    :class:`~ds_hecate.comm.collectives.Communicator`)."""
    from deepspeed.accelerator import get_accelerator

    from ..planning.groups import ExpertGroups
    from ..runtime.hecate import HecateRuntime
    from .model_parallel import hecate_rank_order, read_mpu
    from .monitor import install_recorders

    world = dist.get_world_size()
    with same_on_every_rank():
        rpn = _ranks_per_node(hcfg, world)
    parallel = read_mpu(mpu, world)
    with same_on_every_rank():   # from the config, the model and the world: every rank raises alike
        groups = ExpertGroups(world, _group_size(hcfg, model, parallel, rpn), rpn)
    device = working_device(get_accelerator())
    comm, layout, name = _build_groups(hcfg, ds_config, groups, hecate_rank_order(parallel, groups.ep_size),
                                       parallel, device, one_rank_shortcuts)
    runtime = HecateRuntime(hcfg, comm, _compute_dtype(ds_config), rpn, layout)
    runtime.expert_group_name = name
    install_recorders(runtime)
    return runtime


def _group_size(hcfg: HecateConfig, model: Optional[torch.nn.Module], parallel: Any, rpn: int) -> int:
    """``G``: ``hecate.ep_size``, else the rule on the MoE layers, over the data-parallel ranks of one
    tensor-parallel rank (the world without tensor parallelism). DeepSpeed's expert-parallel groups span
    tensor-parallel ranks when its experts are not tensor-parallel; Hecate's cannot, so a layer's ``ep_size`` counts
    for its part inside one tensor-parallel rank's data-parallel ranks."""
    import math

    from ..planning.groups import resolve_ep_size
    from .convert import moe_layer_shapes
    from ..planning.groups import data_parallel_ranks_per_node

    ep_sizes, experts = moe_layer_shapes(model) if model is not None else ([], [])
    dp, tp = parallel.dp_size, parallel.tp_size
    if not experts:
        return hcfg.ep_size or dp
    declared = [math.gcd(int(e), dp) for e in ep_sizes] if tp > 1 else ep_sizes
    if declared != ep_sizes and hcfg.ep_size is None and any(int(e) > 1 for e in ep_sizes):
        log_rank0(f"warning: the MoE layers' ep_size {sorted(set(ep_sizes))} spans tensor-parallel ranks; Hecate's "
                  f"groups lie inside the {dp} data-parallel ranks of each of the {tp} tensor-parallel ranks, so the "
                  f"layers' groups count as {sorted(set(declared))} there (set hecate.ep_size to choose)")
    try:
        size, warning = resolve_ep_size(hcfg.ep_size, declared, dp, experts, data_parallel_ranks_per_node(rpn, tp))
    except HecateConfigError as exc:
        if tp == 1:
            raise
        raise HecateConfigError(f"with the model-parallel unit's tensor-parallel size {tp}, Hecate's groups lie inside "
                                f"the {dp} data-parallel ranks of each tensor-parallel rank (the 'world size' "
                                f"below): {exc}") from None
    if warning:
        log_rank0(f"warning: {warning}")
    return size


def _build_groups(hcfg: HecateConfig, ds_config: Dict[str, Any], groups: Any, order: Tuple[int, ...],
                  parallel: Any, device: torch.device, one_rank_shortcuts: bool = True):
    """(the group's communicator, the GroupLayout, DeepSpeed's registry name of the groups): every process group
    Hecate uses, created on every rank in the same order; ``order`` is the global rank at each position of
    ``groups`` (:func:`.model_parallel.hecate_rank_order`). Every communicator names its ranks in messages by their
    global rank (and, with several groups, group and index: ``ExpertGroups.describe``)."""
    from ..comm.backend import build_communicator
    from ..comm.collectives import Communicator
    from ..runtime.edp import GroupLayout
    from .model_parallel import register_with_deepspeed

    rank, world, size = dist.get_rank(), groups.world_size, groups.ep_size
    timeout = timedelta(seconds=hcfg.collective_timeout_s)

    def communicator(group, group_rank: int, group_size: int) -> Communicator:
        return Communicator(group, group_rank, group_size, timeout_s=hcfg.collective_timeout_s, device=device)

    if groups.num_groups == 1:
        group = dist.new_group(ranks=list(range(world)), timeout=timeout)
        weight_group = dist.new_group(ranks=list(range(world)), timeout=timeout)
        comm = build_communicator(hcfg.comm_backend, group, rank, world, device,
                                  timeout_s=hcfg.collective_timeout_s, weight_group=weight_group,
                                  device_kernels=hcfg.device_kernels, one_rank_shortcuts=one_rank_shortcuts)
        comm.name_ranks(lambda i: groups.describe(i, order))
        alone = dist.new_group(ranks=[rank], timeout=timeout, use_local_synchronization=True)
        release_gloo_works_at_exit([group, weight_group, alone])
        return (comm, GroupLayout.single(comm, groups.ranks_per_node),
                register_with_deepspeed(size, group, range(world), alone, [rank]))
    group_ranks = [[order[p] for p in r] for r in groups.all_groups()]
    peer_ranks = [[order[p] for p in groups.edp_peers(local)] for local in range(size)]
    tokens = [dist.new_group(ranks=r, timeout=timeout) for r in group_ranks]
    weights = [dist.new_group(ranks=r, timeout=timeout) for r in group_ranks]
    peers = [dist.new_group(ranks=r, timeout=timeout) for r in peer_ranks]
    world_group = dist.new_group(ranks=list(range(world)), timeout=timeout)
    slices = ([dist.new_group(ranks=list(r), timeout=timeout) for r in parallel.tp_groups]
              if parallel.tp_size > 1 else [])
    position = order.index(rank)
    mine, local = groups.group_of(position), groups.local_rank(position)
    comm = build_communicator(hcfg.comm_backend, tokens[mine], local, size, device,
                              timeout_s=hcfg.collective_timeout_s, weight_group=weights[mine],
                              device_kernels=hcfg.device_kernels)
    comm.name_ranks(lambda i: groups.describe(groups.global_rank(mine, i), order))
    tensor_parallel = None
    if slices:
        index = next(i for i, r in enumerate(parallel.tp_groups) if rank in r)
        tensor_parallel = communicator(slices[index], parallel.tp_groups[index].index(rank), parallel.tp_size)
    world_comm = communicator(world_group, rank, world).name_ranks(
        lambda r: groups.describe(order.index(r), order))
    edp = communicator(peers[local], mine, groups.num_groups).name_ranks(
        lambda g: groups.describe(groups.global_rank(g, local), order))
    layout = GroupLayout(groups, rank, world_comm, edp,
                         partitioned=_zero_stage(ds_config) >= 1,
                         ranks=None if order == tuple(range(world)) else order, tensor_parallel=tensor_parallel)
    release_gloo_works_at_exit(tokens + weights + peers + [world_group] + slices)
    return comm, layout, register_with_deepspeed(size, tokens[mine], group_ranks[mine], peers[local],
                                                 peer_ranks[local])


def _zero_stage(cfg: Dict[str, Any]) -> int:
    zero = cfg.get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


def working_device(accelerator: Any) -> torch.device:
    """Where Hecate's tensors live: the accelerator of this rank's ``LOCAL_RANK``, the device DeepSpeed's engine
    selects later (set now, so every rank of a node gets its own GPU, not the current device, ``cuda:0``)."""
    name = accelerator.device_name()
    if name == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accelerator.set_device(local_rank)
    return torch.device(accelerator.device_name(local_rank))


def attach_engine(engine: Any, runtime: Any, sources: Any, emptied: Any,
                  settings_at_build: Optional[Dict[int, Dict[str, Any]]] = None) -> None:
    """Swap in HecateEngine, hook the gradient norm, and build the expert optimizer: one expert param group per
    param group the experts' parameters came from (``sources``: :class:`.param_groups.ExpertSources`), following
    that group, live in DeepSpeed's optimizer or emptied by pruning (``emptied``: :class:`.param_groups.EmptiedGroups`,
    driven by the LR schedule; ``settings_at_build``: their settings before DeepSpeed's engine was built)."""
    from .engine import HecateEngine, install_norm_hook
    from .expert_optimizer import attach_expert_optimizer
    from .param_groups import layer_segments

    engine.__class__ = HecateEngine
    engine.hecate = runtime
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        install_norm_hook(engine, runtime)  # stage 0 fp32 instead clips in HecateEngine.clip_fp32_gradients

    basic = engine.basic_optimizer
    dense_groups = basic.param_groups
    if not dense_groups:
        raise HecateUnsupportedError("the DeepSpeed optimizer has no dense parameter group to follow")
    followed: list = []   # the groups the expert groups follow, in expert-group order
    index: Dict[int, int] = {}   # id of a source (None: DeepSpeed's default group) -> its expert group
    segments = {}
    for shard in runtime.store.layers:
        layer = sources.layers.get(shard.layer_id) or {None: None}
        for source in layer.values():
            if id(source) in index:
                continue
            group = _followed_group(source, dense_groups, emptied, shard.name)
            position = next((i for i, g in enumerate(followed) if g is group), None)
            if position is None:
                position = len(followed)
                followed.append(group)
            index[id(source)] = position
        segments[shard.layer_id] = layer_segments(layer, shard.kernel.names, shard.kernel.numels, index)
    optimizer = attach_expert_optimizer(runtime, type(basic), followed, segments, like=basic)
    optimizer.emptied = [i for i, g in enumerate(followed) if emptied.is_emptied(g)]
    initial = getattr(engine.optimizer, "_hecate_initial_hyperparameters", None)
    if initial is not None:  # ZeRO stage 0 fp16/bf16: DeepSpeed's wrapper stepped the dense groups once at build
        at_build = settings_at_build or {}
        optimizer.add_initial_step([at_build[id(g)] if emptied.is_emptied(g) else
                                    initial[next(i for i, d in enumerate(dense_groups) if d is g)] for g in followed])
    engine.module.register_forward_pre_hook(lambda module, args: runtime.on_model_forward())


def _followed_group(source: Optional[Dict[str, Any]], dense_groups: list, emptied: Any, layer: str) -> Dict[str, Any]:
    """The param group an expert group follows: DeepSpeed's own (its default group when the user gave none), or the
    user's group that pruning emptied."""
    if source is None:
        return dense_groups[0]
    if emptied.is_emptied(source):
        return source
    live = next((g for g in dense_groups if g is source), None)
    if live is None:
        raise HecateUnsupportedError(
            f"the param group {source.get('name', '')!r} holding expert parameters of MoE layer '{layer}' is not "
            "among the groups of DeepSpeed's optimizer (it copied or rebuilt them); Hecate cannot follow its "
            "settings")
    return live


def _record_initial_optimizer_step() -> None:
    """DeepSpeed's ZeRO stage-0 wrappers (FP16_Optimizer, FP16_UnfusedOptimizer) step their optimizer once with
    zero gradients when built; record the group settings of that step, so the experts can take the same step."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from .expert_optimizer import group_settings

    for cls in (FP16_Optimizer, FP16_UnfusedOptimizer):
        original = cls.initialize_optimizer_states
        if getattr(original, "_hecate_wrapped", False):
            continue

        def initialize_optimizer_states(self, _original=original):
            self._hecate_initial_hyperparameters = [group_settings(g) for g in self.optimizer.param_groups]
            return _original(self)
        setattr(initialize_optimizer_states, "_hecate_wrapped", True)
        cls.initialize_optimizer_states = initialize_optimizer_states


def patch_deepspeed() -> None:
    """Route ``deepspeed.initialize`` through Hecate and accept ``zero_optimization.hecate``. Idempotent."""
    global _ORIGINAL_INITIALIZE
    import deepspeed
    import deepspeed.runtime.zero.config as zero_config
    from pydantic import field_validator

    if _ORIGINAL_INITIALIZE is None:
        _ORIGINAL_INITIALIZE = deepspeed.initialize
        deepspeed.initialize = initialize
    _record_initial_optimizer_step()
    from .param_groups import patch_lr_scheduler_setup
    from .zero_init import patch_experts
    patch_lr_scheduler_setup()
    patch_experts()   # DeepSpeed MoE layers built under zero.Init keep their experts' values
    if not getattr(zero_config.DeepSpeedZeroConfig, "_hecate_aware", False):
        base = zero_config.DeepSpeedZeroConfig

        class HecateAwareZeroConfig(base):  # type: ignore[misc, valid-type]  # a base class found at run time
            """DeepSpeed's ZeRO config plus a ``hecate`` section, validated by ds_hecate's own schema wherever DeepSpeed
            parses a config (``deepspeed.zero.Init`` under a Hugging Face ZeRO-3 ``from_pretrained``, a
            ``DeepSpeedConfig`` built by hand): a bad key fails there, before the model is built."""

            hecate: Optional[Dict[str, Any]] = None
            _hecate_aware = True

            @field_validator("hecate")
            @classmethod
            def _valid_hecate_section(cls, value: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
                if value is not None:
                    parse_hecate_section(value)
                return value

        HecateAwareZeroConfig.__name__ = base.__name__
        zero_config.DeepSpeedZeroConfig = HecateAwareZeroConfig
