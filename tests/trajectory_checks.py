"""Compare a run under test with the data-parallel oracle (both from :func:`moe_training.train`).

:func:`assert_same_steps` checks after every optimizer step, :func:`assert_same_trajectory` the losses and norms of
every step and the weights at the end. Pure functions of the runs' result dicts: no process group, no DeepSpeed.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch


def full_experts_of_oracle(results: List[dict]) -> Dict[str, torch.Tensor]:
    """Assemble [E, numel] expert weights from the oracle's per-rank local experts."""
    out = {}
    for name in results[0]["local_experts"]:
        merged: Dict[int, torch.Tensor] = {}
        for r in results:
            for e, flat in r["local_experts"][name].items():
                merged.setdefault(e, flat)
        out[name] = torch.stack([merged[e] for e in sorted(merged)])
    return out


def assert_same_trajectory(oracle: List[dict], mine: List[dict], loss_rtol: float = 1e-5,
                           param_atol: float = 1e-4, label: str = "") -> None:
    """Hecate's run follows the data-parallel run: per-rank per-step losses, grad norms, dense and expert weights."""
    for rank, (o, m) in enumerate(zip(oracle, mine)):
        lo, lm = torch.tensor(o["losses"], dtype=torch.float64), torch.tensor(m["losses"], dtype=torch.float64)
        rel = ((lo - lm).abs() / lo.abs().clamp_min(1e-12)).max().item()
        assert rel <= loss_rtol, \
            f"{label} rank {rank}: loss rel diff {rel:.3e} > {loss_rtol}: {o['losses']} vs {m['losses']}"
        no, nm = torch.tensor(o["norms"]), torch.tensor(m["norms"])
        reported = ~torch.isnan(no)  # DeepSpeed's ZeRO stage 0 reports no norm; Hecate does
        assert torch.allclose(no[reported], nm[reported], rtol=max(loss_rtol, 1e-5) * 10, atol=1e-6), \
            f"{label} rank {rank}: grad norms differ: {o['norms']} vs {m['norms']}"
        assert o["dense"].keys() == m["dense"].keys(), f"{label}: dense parameter names differ"
        for name in o["dense"]:
            diff = (o["dense"][name] - m["dense"][name]).abs().max().item()
            assert diff <= param_atol, f"{label} rank {rank}: dense '{name}' differs by {diff:.3e}"
    full_oracle = full_experts_of_oracle(oracle)
    for rank, m in enumerate(mine):
        assert m["experts"].keys() == full_oracle.keys(), f"{label}: expert layers differ"
        for name, full in full_oracle.items():
            diff = (full - m["experts"][name]).abs().max().item()
            assert diff <= param_atol, f"{label} rank {rank}: experts of '{name}' differ by {diff:.3e}"


def oracle_experts_at(oracle: List[dict], step: int) -> Dict[str, torch.Tensor]:
    """The oracle's ``[E, numel]`` expert weights after ``step`` (from every rank's ``states``; the fp32 masters
    where recorded), as :func:`full_experts_of_oracle` assembles the final ones."""
    states = [r["states"][step] for r in oracle]
    key = "local_experts_fp32" if all("local_experts_fp32" in s for s in states) else "local_experts"
    return full_experts_of_oracle([{"local_experts": s[key]} for s in states])


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    """Both finite and close, or both non-finite (an overflow step: Inf or NaN, as each optimizer reports it)."""
    if math.isfinite(a) and math.isfinite(b):
        return abs(a - b) <= atol + rtol * abs(a)
    return not math.isfinite(a) and not math.isfinite(b)


def assert_same_steps(oracle: List[dict], mine: List[dict], loss_rtol: float = 1e-5, param_atol: float = 1e-4,
                      norm_rtol: Optional[float] = None, label: str = "", zero3_vs_stage2: bool = False) -> None:
    """Hecate's run follows the oracle's after EVERY optimizer step, on every rank.

    Both runs need ``Spec(per_step_state=True)`` (and best ``master_state`` and ``independent_norm``: fp32 masters
    compared in fp16/bf16 runs, a norm compared under ZeRO stage 0); ``oracle`` should be plain DeepSpeed
    (``deepspeed.moe.layer.MoE``, no ``hecate`` section) run in processes of its own. Per step and rank it compares:
    every micro-step's loss (relative ``loss_rtol``); the global gradient norm DeepSpeed reports (both finite and
    within ``norm_rtol``, or both non-finite on an overflow step), and, where the run recorded one (ZeRO stage 0, see
    :func:`independent_grad_norm`), the norm the test computed itself; the loss scale and the skipped-step count;
    every dense parameter and every expert's weights (absolute ``param_atol``). Every step must have at least one
    norm compared. The first mismatch raises, naming step (0-based: "step 0" is after the first optimizer step),
    micro-step, rank, parameter or layer and expert.

    ``zero3_vs_stage2``: the run under test is ZeRO stage 3 and the oracle stage 2 (DeepSpeed's MoE refuses stage
    3). DeepSpeed 0.19.8's stage-3 optimizer reports the norm divided by the loss scale AFTER its update, stage 1/2
    by the one before it, so on an fp16 step where the dynamic scale grew the oracle's norm is converted to stage-3
    units (``* scale_before / scale_after``). Both stages unscale the gradients by the scale after the update, so
    the weights need no conversion.
    """
    norm_rtol = max(loss_rtol, 1e-5) * 10 if norm_rtol is None else norm_rtol
    assert len(oracle) == len(mine), f"{label}: {len(oracle)} oracle ranks, {len(mine)} ranks under test"
    steps = len(oracle[0]["states"])
    assert steps, f"{label}: no per-step states (run both with Spec(per_step_state=True))"
    for rank, (o, m) in enumerate(zip(oracle, mine)):
        assert len(o["states"]) == len(m["states"]) == steps, \
            f"{label} rank {rank}: {len(o['states'])} oracle steps, {len(m['states'])} steps under test"
        assert len(o["losses"]) == len(m["losses"]), f"{label} rank {rank}: different numbers of micro-steps"
        assert o["skipped"] == m["skipped"], \
            f"{label} rank {rank}: oracle skipped {o['skipped']} steps, Hecate's run {m['skipped']}"
    gas = len(oracle[0]["losses"]) // steps
    expert_names = None
    for step in range(steps):
        for rank, (o, m) in enumerate(zip(oracle, mine)):
            where = f"{label} step {step} rank {rank}"
            for micro in range(gas):
                i = step * gas + micro
                lo, lm = o["losses"][i], m["losses"][i]
                rel = abs(lo - lm) / max(abs(lo), 1e-12)
                assert rel <= loss_rtol or (lo != lo and lm != lm), \
                    f"{where} micro-step {micro}: loss {lm!r} vs oracle {lo!r} (rel diff {rel:.3e} > {loss_rtol})"
            compared = 0
            for key, what in (("norms", "grad norm reported by DeepSpeed"),
                              ("independent_norms", "grad norm computed by the test")):
                no = o.get(key, [])[step] if len(o.get(key, [])) > step else float("nan")
                nm = m.get(key, [])[step] if len(m.get(key, [])) > step else float("nan")
                if no != no:
                    continue  # the oracle has none (DeepSpeed's stage 0 reports no norm unless it clips)
                if key == "norms" and zero3_vs_stage2:
                    no = no * o["scales_before"][step] / o["scales"][step]
                assert _close(no, nm, norm_rtol, 1e-6), f"{where}: {what} {nm!r} vs oracle {no!r} (rtol {norm_rtol})"
                compared += 1
            assert compared, f"{where}: no gradient norm to compare (oracle reports none and none was recorded)"
            assert o["scales"][step] == m["scales"][step], \
                f"{where}: loss scale {m['scales'][step]} vs oracle {o['scales'][step]}"
            key = "dense_fp32" if "dense_fp32" in o["states"][step] and "dense_fp32" in m["states"][step] else "dense"
            od, md = o["states"][step][key], m["states"][step][key]
            assert od.keys() == md.keys(), \
                f"{where}: dense parameter names differ: {sorted(set(od) ^ set(md))}"
            for name in od:
                diff = (od[name] - md[name]).abs().max().item() if od[name].numel() else 0.0
                assert diff <= param_atol, f"{where}: dense '{name}' ({key}) differs by {diff:.3e} > {param_atol}"
        full = oracle_experts_at(oracle, step)
        expert_names = expert_names or sorted(full)
        for rank, m in enumerate(mine):
            experts = m["states"][step]["experts"]
            assert experts is not None, f"{label}: rank {rank}'s run has no Hecate experts (not a Hecate run?)"
            assert sorted(experts) == expert_names, \
                f"{label} step {step} rank {rank}: expert layers {sorted(experts)} vs oracle {expert_names}"
            for name in expert_names:
                assert experts[name].shape == full[name].shape, \
                    f"{label} step {step} rank {rank}: experts of '{name}' shaped {tuple(experts[name].shape)} vs " \
                    f"oracle {tuple(full[name].shape)}"
                per_expert = (full[name] - experts[name]).abs().amax(dim=1)
                worst = int(per_expert.argmax())
                assert per_expert[worst].item() <= param_atol, \
                    f"{label} step {step} rank {rank}: expert {worst} of '{name}' differs by " \
                    f"{per_expert[worst].item():.3e} > {param_atol} " \
                    f"({int((per_expert > param_atol).sum())} of {len(per_expert)} experts over)"
