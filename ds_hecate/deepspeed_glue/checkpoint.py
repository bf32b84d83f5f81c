"""Hecate's part of a DeepSpeed checkpoint: every expert, stored as a logical expert, never a per-rank blob.

Layout, next to DeepSpeed's own files in ``<save_dir>/<tag>/``::

    hecate/meta.json                      layers (names, parameter layout, sharding), scheduler state, format
    hecate/layer000_expert00003.pt        {"master": fp32 vector, "state": {optimizer state tensors}}

Each owner of the first group writes its experts (write to a temporary name, then rename; each file's SHA-256 and
size go into ``meta.json``, verified before anything loads: :mod:`.checkpoint_integrity`); with groups
(``hecate.ep_size``) every group holds the same experts, so one group's copy is the checkpoint, its expert-data-
parallel slices gathered first when the expert state is partitioned. All ranks meet at a barrier before DeepSpeed
writes its files; then ``hecate/complete.json`` marks the tag complete and, last, ``latest`` names it, so ``latest``
never names a checkpoint with files missing, and loading a tag without the mark is refused. Materialized
replicas are never saved. Loading reads the files of the experts a rank owns, whatever world size and group size
saved them (with the saved sharding when the group size is the same, else an even one; partitioned, each rank
keeps its slice), validates the model against ``meta.json`` and refuses to load partially: any missing, truncated
or mismatched file fails on every rank with a message naming the layer and expert. Files are read with
``torch.load(weights_only=True)``. Checkpoints without a group size (before groups) were one group of their world.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from . import checkpoint_integrity as integrity
from ..errors import HecateError
from ..logging_utils import logger
from ..planning import even_sharding

FORMAT = "ds_hecate/2"
#: Checkpoints written before expert-file digests and the completion mark: loaded unverified, with one warning.
LEGACY_FORMAT = "ds_hecate/1"
SUBDIR = "hecate"


def expert_file(layer_id: int, expert: int) -> str:
    return f"layer{layer_id:03d}_expert{expert:05d}.pt"


def _layer_meta(rt) -> List[Dict[str, Any]]:
    return [{"name": name, "num_experts": b.shard.num_experts, "numel": b.shard.kernel.numel,
             "param_names": b.shard.kernel.names, "param_shapes": [list(s) for s in b.shard.kernel.shapes],
             "owners": list(b.shard.owners), "load_history": b.planner.predictor.state_dict()["history"],
             "schedule": b.planner.schedule.state_dict(),
             **({"source_layout": b.shard.kernel.source_layout} if b.shard.kernel.source_layout else {})}
            for name, b in zip(rt.layer_names, rt.bindings)]


def _planner_state(rt) -> List[Dict[str, Any]]:
    """Per layer, this group's load window and schedule (each group plans on its own counts)."""
    return [{"load_history": b.planner.predictor.state_dict()["history"], "schedule": b.planner.schedule.state_dict()}
            for b in rt.bindings]


def save(rt, checkpoint_dir: str) -> None:
    """Write the first group's experts and (rank 0) the metadata, with every expert file's digest, into
    ``checkpoint_dir/hecate``. Collective. An old completion mark of the same tag is removed before any rank
    writes (:func:`.checkpoint_integrity.start_overwrite`)."""
    from ..runtime.edp import whole_masters

    rt.drop_pending()
    rt.flush_reductions()
    layout = rt.layout
    directory = os.path.join(checkpoint_dir, SUBDIR)
    os.makedirs(directory, exist_ok=True)
    if layout.global_rank == 0:
        integrity.start_overwrite(checkpoint_dir, SUBDIR)
    layout.world.barrier("checkpoint-save start barrier")
    with integrity.DigestingWriter() as writer:
        for binding in rt.bindings:
            shard = binding.shard
            masters, states = whole_masters(rt, shard, with_state=True)   # partitioned: collective over the peers
            if layout.edp_index != 0:   # every group holds the same experts: the first group's copy is saved
                continue
            for e in shard.owned:
                # Host copies: the files do not depend on which device (or how many) saved them.
                writer.save({"master": masters[e].detach().cpu().clone(),
                             "state": {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                       for k, v in states[e].items()}},
                            os.path.join(directory, expert_file(shard.layer_id, e)))
    # every group's planner state (the group's rank 0 holds it), for an exact resume on the same layout, and every
    # writer's file digests
    gathered = layout.world.all_gather_object((_planner_state(rt) if rt.rank == 0 else None, writer.records),
                                              "checkpoint planner-state gather")
    if layout.global_rank == 0:
        files = {name: record for _, records in gathered for name, record in records.items()}
        meta = {"format": FORMAT, "world_size": layout.groups.world_size, "ep_size": rt.ep_size,
                "layers": _layer_meta(rt), "groups": [g for g, _ in gathered if g is not None],
                "expert_param_groups": _param_group_meta(rt),
                "steps_applied": rt.steps_applied, "steps_skipped": rt.steps_skipped, "reshards": rt.reshards,
                "measured_costs": rt.measured, "files": dict(sorted(files.items()))}
        tmp = os.path.join(directory, "meta.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(directory, "meta.json"))
    layout.world.barrier("checkpoint-save barrier")


def mark_complete(rt, checkpoint_dir: str, tag: str) -> None:
    """Once every rank's files of the tag (DeepSpeed's and Hecate's) are written: rank 0 writes the completion
    mark and removes what interrupted saves of this tag left behind. Collective (ends with a barrier)."""
    if rt.layout.global_rank == 0:
        integrity.write_marker(checkpoint_dir, tag, SUBDIR)
        integrity.remove_leftovers(checkpoint_dir)
    rt.layout.world.barrier("checkpoint completion barrier")


def write_latest(rt, save_dir: str, tag: str, writer: bool) -> None:
    """Point ``save_dir/latest`` at ``tag`` (atomically, on the ``writer`` rank) once every rank's files of ``tag``
    are written; every rank returns after it is. Collective."""
    if writer:
        tmp = os.path.join(save_dir, f"latest.tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(tag)
        os.replace(tmp, os.path.join(save_dir, "latest"))
    rt.layout.world.barrier("checkpoint latest barrier")


CLIENT_STATE_KEY = "ds_hecate"


def expert_checkpoint_dir(load_dir: str, tag: str, universal: bool) -> str:
    """The checkpoint directory whose ``hecate/`` holds the experts for DeepSpeed checkpoint ``load_dir/tag``.

    Normally ``load_dir/tag`` itself. A universal checkpoint made by ``ds_to_universal`` has no ``hecate/``; its
    copy of DeepSpeed's model-state file names the tag the experts were saved with (Hecate's experts are stored
    as logical experts, so they load at any world size as they are). That file is a pickle, read here exactly as
    DeepSpeed reads it right after (``weights_only=False``), memory-mapped so no tensor is loaded.
    """
    direct = os.path.join(load_dir, tag)
    if not universal or os.path.isfile(os.path.join(direct, SUBDIR, "meta.json")):
        return direct
    import glob

    for path in sorted(glob.glob(os.path.join(direct, "mp_rank_*_model_states.pt")))[:1]:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        source = (state.get(CLIENT_STATE_KEY) or {}).get("expert_tag") if isinstance(state, dict) else None
        if source is not None:
            return os.path.join(load_dir, str(source))
    return direct


def read_meta(meta_path: str) -> Dict[str, Any]:
    """The checkpoint's meta.json: plain JSON (never unpickled), or an error saying it is damaged."""
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HecateError(f"{meta_path} is not a Hecate checkpoint index (not valid UTF-8 JSON: "
                          f"{type(exc).__name__}: {exc}); the checkpoint is damaged or was replaced") from None
    if not isinstance(meta, dict):
        raise HecateError(f"{meta_path} is not a Hecate checkpoint index (a JSON object was expected)")
    return meta


def check_format(meta: Dict[str, Any], checkpoint_dir: str, warn: bool = True) -> Optional[Dict[str, Any]]:
    """The file digests of a checkpoint whose save completed; None for a legacy checkpoint (no digests, no mark:
    read unverified, with a warning when ``warn``). Raises naming what is missing when the save did not complete."""
    form = meta.get("format")
    if form == LEGACY_FORMAT:
        if warn:
                logger.warning(f"{checkpoint_dir} was saved before ds_hecate recorded expert-file digests (format "
                           f"{LEGACY_FORMAT}); its expert files are loaded without verification")
        return None
    if form != FORMAT:
        raise HecateError(f"{checkpoint_dir}: unknown Hecate checkpoint format {form!r} (expected {FORMAT} or "
                          f"{LEGACY_FORMAT})")
    problems = integrity.completeness_problems(checkpoint_dir, SUBDIR, lambda rel: _describe_file(meta, rel))
    if problems:
        raise HecateError(f"{checkpoint_dir} is an incomplete save: {'; '.join(problems[:4])}"
                          f"{' ...' if len(problems) > 4 else ''}; load an earlier tag ('latest' names the last "
                          "complete one)")
    files = meta.get("files")
    if not isinstance(files, dict):
        raise HecateError(f"{checkpoint_dir}: {SUBDIR}/meta.json has no file digests; the checkpoint is damaged")
    return files


def _describe_file(meta: Dict[str, Any], rel: str) -> str:
    """A checkpoint file as the user knows it: an expert file names its expert and layer."""
    name = os.path.basename(rel)
    layers = meta.get("layers") or []
    if os.path.dirname(rel) == SUBDIR and name.startswith("layer") and "_expert" in name:
        try:
            layer_id, expert = int(name[5:8]), int(name[15:20])
            return f"expert {expert} of MoE layer '{layers[layer_id]['name']}' ({rel})"
        except (ValueError, IndexError, KeyError, TypeError):
            pass
    return rel


def _check_meta(rt, meta: Dict[str, Any], where: str) -> None:
    saved = meta["layers"]
    if len(saved) != len(rt.bindings):
        raise HecateError(f"{where}: checkpoint has {len(saved)} MoE layers, the model has {len(rt.bindings)}")
    for layer, name, binding in zip(saved, rt.layer_names, rt.bindings):
        kernel = binding.shard.kernel
        mine = {"name": name, "num_experts": binding.shard.num_experts, "param_names": kernel.names,
                "param_shapes": [list(s) for s in kernel.shapes]}
        for key, value in mine.items():
            if layer[key] != value:
                raise HecateError(f"{where}: MoE layer '{name}' differs from the checkpoint in {key}: "
                                  f"checkpoint {layer[key]!r}, model {value!r}")


def prepare_load(rt, checkpoint_dir: str, load_optimizer_states: bool = True) -> Callable[[], None]:
    """Read and validate every expert this rank will own from ``checkpoint_dir/hecate``; return the function that
    installs them. Collective: if any rank finds a problem, every rank raises and nothing has been modified, so
    the caller can check the expert state before DeepSpeed loads the dense state."""
    rt.drop_pending()
    directory = os.path.join(checkpoint_dir, SUBDIR)
    meta_path = os.path.join(directory, "meta.json")
    error: Optional[str] = None
    loaded: Dict[int, Dict[int, Dict[str, Any]]] = {}
    owners_per_layer: List[tuple] = []
    meta: Dict[str, Any] = {}
    try:
        if not os.path.isfile(meta_path) and os.path.isdir(directory):
            raise HecateError(f"{checkpoint_dir} is an incomplete save: {SUBDIR}/{integrity.MARKER} and "
                              f"{SUBDIR}/meta.json are missing; load an earlier tag ('latest' names the last complete "
                              "one)")
        if not os.path.isfile(meta_path):
            raise HecateError(f"{checkpoint_dir} has no Hecate expert state ({meta_path} is missing); it was not "
                              "saved by a Hecate engine, or the save did not complete")
        meta = read_meta(meta_path)
        digests = check_format(meta, checkpoint_dir, warn=rt.layout.global_rank == 0)   # once per job
        _check_meta(rt, meta, checkpoint_dir)
        if load_optimizer_states:
            _check_emptied_settings(rt.optimizer, meta, checkpoint_dir)
        same_group = _saved_ep_size(meta) == rt.ep_size
        for layer, binding in zip(meta["layers"], rt.bindings):
            shard = binding.shard
            owners = tuple(layer["owners"]) if same_group else even_sharding(shard.num_experts, rt.ep_size)
            owners_per_layer.append(owners)
            if same_group:
                binding.planner.check_saved_schedule(layer.get("schedule", {}), rt.ep_size, binding.shard.num_experts)
            for e, owner in enumerate(owners):
                if owner == rt.rank:
                    loaded.setdefault(shard.layer_id, {})[e] = _read_expert(directory, checkpoint_dir, shard, e,
                                                                            digests)
    except HecateError as exc:
        error = str(exc)
    gathered = rt.layout.world.all_gather_object((error, _state_keys(rt, loaded)), "checkpoint-load validation")
    errors = [m for m, _ in gathered if m]
    if not errors and load_optimizer_states:
        errors = _missing_state(gathered, checkpoint_dir)
    if errors:
        raise HecateError(errors[0])

    def install() -> None:
        for binding, owners, layer in zip(rt.bindings, owners_per_layer, meta["layers"]):
            shard = binding.shard
            for param in shard.masters.values():
                if rt.optimizer is not None:
                    rt.optimizer.remove(param)
            shard.owners = owners
            blobs = dict(sorted(loaded.get(shard.layer_id, {}).items()))
            shard.set_masters({e: blob["master"].to(device=rt.device, dtype=torch.float32)
                               for e, blob in blobs.items()},
                              rt.layout.partition_for(shard.kernel.numel), rt.compute_dtype)
            part = shard.partition
            for e, blob in blobs.items():
                numel = blob["master"].numel()
                # Per-element states follow the master to the working device (partitioned: this rank's slice);
                # scalars ('step') stay on the CPU.
                state = {k: ((part.slice_of(v.to(rt.device).float()) if part is not None else v.to(rt.device))
                             if torch.is_tensor(v) and v.numel() == numel else v)
                         for k, v in blob["state"].items()} if load_optimizer_states else {}
                if rt.optimizer is not None:
                    rt.optimizer.add(rt.layer_group[shard.layer_id], shard.masters[e], state)
            history = _group_history(meta, layer, rt, binding)
            binding.planner.predictor.load_state_dict({"history": history})
        if load_optimizer_states and rt.optimizer is not None:
            _restore_emptied_settings(rt.optimizer, meta, checkpoint_dir)
        rt.steps_applied = meta["steps_applied"]
        rt.steps_skipped = meta["steps_skipped"]
        rt.reshards = meta["reshards"]
        rt.measured = dict(meta["measured_costs"])
        same = _same_layout(meta, rt)
        for i, (layer, binding) in enumerate(zip(meta["layers"], rt.bindings)):   # after owners and costs
            group = _group_state(meta, rt)
            saved = (group[i]["schedule"] if group is not None else layer.get("schedule", {})) if same else {}
            # the reuse decisions of the run that did not stop
            binding.planner.restore_schedule(saved, binding.plan_inputs())
    return install


def _jsonable(value: Any) -> Any:
    """A param-group setting as JSON (tuples as lists, one-element tensors as numbers); None where it has no JSON
    form (left out of the checkpoint)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        items = [_jsonable(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    return None


def _param_group_meta(rt) -> Dict[str, Any]:
    """The settings of the expert param groups whose source group pruning emptied: no optimizer of DeepSpeed's holds
    them, so DeepSpeed's checkpoint does not (the others are in DeepSpeed's optimizer state)."""
    optimizer = rt.optimizer
    if optimizer is None:
        return {"groups": 0, "emptied": {}}
    emptied = {}
    for i in getattr(optimizer, "emptied", []):
        settings = {k: _jsonable(v) for k, v in optimizer.current_hyperparameters()[i].items()}
        emptied[str(i)] = {k: v for k, v in settings.items() if v is not None}
    return {"groups": len(optimizer.param_groups), "emptied": emptied}


def _check_emptied_settings(optimizer, meta: Dict[str, Any], checkpoint_dir: str) -> None:
    """Raises if the checkpoint's expert param groups are not this run's (validation, before anything loads)."""
    saved = meta.get("expert_param_groups")
    if saved is None or optimizer is None:
        return
    mine = sorted(getattr(optimizer, "emptied", []))
    theirs = sorted(int(i) for i in saved.get("emptied", {}))
    if saved.get("groups") != len(optimizer.param_groups) or theirs != mine:
        raise HecateError(f"{checkpoint_dir}: the experts were saved following {saved.get('groups')} param groups "
                          f"(emptied by the experts' move: {theirs}), this run's follow {len(optimizer.param_groups)} "
                          f"(emptied: {mine}); build the optimizer's param groups as the saving run did")


def _restore_emptied_settings(optimizer, meta: Dict[str, Any], checkpoint_dir: str) -> None:
    """Give the emptied source groups the settings they had at the save (DeepSpeed restores the other groups from
    its optimizer state; an LR schedule restored by DeepSpeed may set them again at its next step)."""
    saved = meta.get("expert_param_groups")
    mine = sorted(getattr(optimizer, "emptied", []))
    if saved is None:   # saved before the settings were recorded
        if mine:
            logger.warning(f"{checkpoint_dir} records no settings of the expert param groups; the groups the experts "
                           "follow outside DeepSpeed's optimizer keep their current settings until the LR schedule "
                           "sets them")
        return
    for i in mine:
        source = optimizer.sources[i]
        for key, value in saved["emptied"][str(i)].items():
            current = source.get(key)
            source[key] = tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value


def _saved_ep_size(meta: Dict[str, Any]) -> int:
    """The group size a checkpoint was saved with (before groups: one group of its world)."""
    return int(meta.get("ep_size", meta["world_size"]))


def _same_layout(meta: Dict[str, Any], rt) -> bool:
    return meta["world_size"] == rt.layout.groups.world_size and _saved_ep_size(meta) == rt.ep_size


def _group_state(meta: Dict[str, Any], rt) -> Optional[List[Dict[str, Any]]]:
    """This rank's group's saved planner state (same layout only), or None where the checkpoint has none."""
    groups = meta.get("groups")
    if not _same_layout(meta, rt) or not groups:
        return None
    return groups[rt.layout.edp_index]


def _group_history(meta: Dict[str, Any], layer: Dict[str, Any], rt, binding) -> list:
    """The load window this group resumes with: its own on the same layout; otherwise the expert totals of the
    saved window spread over this group's ranks (per-source counts do not map to new ranks)."""
    group = _group_state(meta, rt)
    if group is not None:
        return group[binding.shard.layer_id]["load_history"]
    history = layer["load_history"]
    if _same_layout(meta, rt):
        return history
    world = rt.ep_size
    return [[[sum(row[e] for row in m) / world for e in range(len(m[0]))]] * world for m in history]


def _state_keys(rt, loaded: Dict[int, Dict[int, Dict[str, Any]]]) -> Dict[tuple, str]:
    """(layer, optimizer-state keys) -> one expert of this rank whose file holds exactly those keys."""
    names = dict(zip((b.shard.layer_id for b in rt.bindings), rt.layer_names))
    keys: Dict[tuple, str] = {}
    for layer_id, blobs in sorted(loaded.items()):
        for e, blob in sorted(blobs.items()):
            keys.setdefault((layer_id, tuple(sorted(map(str, blob["state"])))),
                            f"expert {e} of MoE layer '{names[layer_id]}'")
    return keys


def _missing_state(gathered: List[tuple], checkpoint_dir: str) -> List[str]:
    """A layer's experts all step together, so every expert file of a layer holds the same optimizer-state keys; one
    with fewer lost its state (every rank computes the same answer from the gathered keys)."""
    every = {k: where for _, keys in gathered for k, where in keys.items()}
    errors = []
    for (layer_id, keys), where in sorted(every.items()):
        union = {name for (other, k) in every if other == layer_id for name in k}
        if set(keys) != union:
            errors.append(f"{checkpoint_dir}: {where} has no optimizer state {sorted(union - set(keys))} in its "
                          "file, which the layer's other experts have; the checkpoint is damaged")
    return errors


def expert_record(digests: Optional[Dict[str, Any]], name: str, where: str) -> Optional[Dict[str, Any]]:
    """The recorded digest of expert file ``name`` (None: a legacy checkpoint). A file the manifest does not list
    is refused: it was not written by the save."""
    if digests is None:
        return None
    record = digests.get(name)
    if not isinstance(record, dict) or integrity.DIGEST not in record or "bytes" not in record:
        raise HecateError(f"{where}: {SUBDIR}/meta.json records no digest for {name}; the checkpoint is damaged")
    return record


def _read_expert(directory: str, checkpoint_dir: str, shard, expert: int,
                 digests: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    name = expert_file(shard.layer_id, expert)
    path = os.path.join(directory, name)
    where = f"{checkpoint_dir}: expert {expert} of MoE layer '{shard.name}'"
    try:
        data = integrity.read_verified(path, expert_record(digests, name, where), where)
        blob = integrity.load_tensor_file(data)
    except HecateError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported by layer and expert
        raise HecateError(f"{where} cannot be loaded from {path}: {type(exc).__name__}: {exc}") from None
    master = blob.get("master") if isinstance(blob, dict) else None
    if not torch.is_tensor(master) or tuple(master.shape) != (shard.kernel.numel,):
        raise HecateError(f"{where} in {path} has master weights of shape {getattr(master, 'shape', None)}, "
                          f"expected ({shard.kernel.numel},)")
    if not isinstance(blob.get("state"), dict):
        raise HecateError(f"{where} in {path} has no optimizer state dict")
    return blob
