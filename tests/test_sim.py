"""The cluster simulator (ds_hecate.sim): runs the real planner on modelled clusters, agrees with hand-computed
times on a trivial case, replays traces, and its CLI prints the table."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from typing import Any, Dict

import numpy as np
import pytest

from ds_hecate.errors import HecateError
from ds_hecate.sim.presets import CLUSTERS, MODELS, Cluster, ModelShape
from ds_hecate.sim import SYSTEMS, SimSettings, simulate
from ds_hecate.trace import TraceLayer, TraceWriter

TINY = ModelShape(name="tiny", moe_layers=2, hidden_size=64, ffn_size=128, num_experts=4, top_k=2, vocab_size=0,
                  seq_len=256, expert_bias=True)


def test_presets_match_published_sizes():
    assert abs(MODELS["deepseek-v3"].total_params / 671e9 - 1) < 0.01
    assert abs(MODELS["mixtral-8x7b"].total_params / 46.7e9 - 1) < 0.01
    for name, paper in (("gpt-moe-s", 1.84e9), ("gpt-moe-l", 7.36e9), ("bert-moe", 3.27e9),
                        ("bert-moe-deep", 6.54e9)):
        assert abs(MODELS[name].total_params / paper - 1) < 0.03, name
    assert CLUSTERS["v100-4x8"].world_size == CLUSTERS["a100-4x8"].world_size == 32
    assert CLUSTERS["h100-128x8"].world_size == 1024


def test_32_gpu_skewed_run_reports_speedup_and_fraction_of_ideal():
    result = simulate("v100-4x8", "gpt-moe-s", "W1", SimSettings(steps=4))
    r = result.systems
    assert set(r) == set(SYSTEMS)
    assert r["ep"].speedup_vs_ep == 1.0
    assert r["hecate"].speedup_vs_ep > 1.5 and r["hecate"].replicas_per_layer > 0
    assert r["hecate"].imbalance < r["ep"].imbalance
    for s in SYSTEMS:   # nothing beats the ideal bound
        assert r[s].step_time_s >= r["ideal"].step_time_s * (1 - 1e-12), s
        assert 0 < r[s].fraction_of_ideal <= 1.0 + 1e-12
    # re-materialization keeps fewer replicas resident, and pays a second gather
    assert r["hecate-rm"].peak_memory_bytes < r["hecate"].peak_memory_bytes
    assert r["hecate-rm"].breakdown_s["exposed_comm"] >= r["hecate"].breakdown_s["exposed_comm"]


def test_hecate_without_budget_is_expert_parallelism():
    """Budget 0: the scheduler returns the sharded placement, so Hecate and EP simulate identically (their host
    planning and per-call runtime overheads left out: those differ by design)."""
    result = simulate("a100-4x8", "bert-moe", "W2", SimSettings(steps=3, materialize_budget_mb=0.0,
                                                                charge_planning=False, charge_call_overhead=False),
                      systems=["ep", "hecate"])
    assert result.systems["hecate"].replicas_per_layer == 0
    assert result.systems["hecate"].step_times_s == result.systems["ep"].step_times_s
    balanced = simulate("a100-4x8", "bert-moe", "W0", SimSettings(steps=3), systems=["ep", "hecate"])
    assert balanced.systems["hecate"].replicas_per_layer == 0      # balanced routing: nothing worth replicating


def test_calibration_reacts_to_bursts():
    """W7's one-step bursts escape the load window; with hecate.calibration the runtime re-plans after the gate, and
    so does the simulator (the extra gather on the critical path)."""
    from ds_hecate.config import HecateConfig

    plain, calibrated = (simulate("v100-4x8", "gpt-moe-s", "W7", SimSettings(steps=12, hecate=HecateConfig(
        enabled=True, calibration=on, materialize_budget_mb=3276.8)), systems=["ep", "hecate"]) for on in (False, True))
    assert calibrated.systems["hecate"].step_time_s < plain.systems["hecate"].step_time_s
    assert calibrated.systems["hecate"].imbalance < plain.systems["hecate"].imbalance


def test_calibrated_two_rank_prediction_by_hand():
    """EP on W0 with measured costs: every term computed by hand."""
    measured = {"compute_s_per_pair": 2e-5, "link_gbps": 1.0, "non_moe_time_s": 3e-3}
    cluster = Cluster.from_measured(measured, world_size=2)
    tokens = 512
    result = simulate(cluster, TINY, "W0", SimSettings(steps=2, tokens_per_rank=tokens, precision="fp32"),
                      systems=["ep", "ideal"])
    pairs = tokens * TINY.top_k                         # per rank: W0 spreads them over 4 experts, 2 per owner
    compute = pairs * 2e-5                              # each owner processes half of both ranks' pairs
    rows_out = pairs / 2                                # half of a rank's pairs go to the other rank
    a2a = 4 * rows_out * TINY.hidden_size * 4 / 1e9
    non_moe = 3 * 3e-3 * TINY.moe_layers
    want = TINY.moe_layers * (compute + a2a) + non_moe
    assert result.systems["ep"].step_time_s == pytest.approx(want, rel=1e-12)
    assert result.systems["ideal"].step_time_s == pytest.approx(TINY.moe_layers * compute + non_moe, rel=1e-12)
    with pytest.raises(HecateError, match="measured costs lack"):
        Cluster.from_measured({"link_gbps": 1.0})


def test_trace_replay_and_cli(tmp_path):
    trace = tmp_path / "run.jsonl"
    rng = np.random.default_rng(0)
    with TraceWriter(str(trace), world_size=2, top_k=2, layers=[TraceLayer("l0", 4, 64, TINY.expert_params)]) as w:
        for step in range(3):
            counts = rng.integers(0, 50, size=(2, 4))
            counts[:, 0] += 400                          # a hot expert owned by rank 0
            w.write(step, 0, counts.tolist())
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps({k: getattr(TINY, k) for k in ("moe_layers", "hidden_size", "ffn_size",
                                                                "num_experts", "top_k", "vocab_size", "seq_len",
                                                                "expert_bias")}))
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "ds_hecate.tools.cli", "simulate", "--cluster", "cpu-2", "--model",
                           str(model), "--workload", str(trace), "--steps", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for s in SYSTEMS:
        assert f"\n{s} " in proc.stdout, proc.stdout
    assert "replayed cyclically" in proc.stdout
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and set(data["systems"]) == set(SYSTEMS)
    with pytest.raises(HecateError, match="recorded on 2 ranks"):
        simulate("cpu-2", TINY, str(trace), SimSettings(world_size=1, steps=2))
    with pytest.raises(HecateError, match="unknown system"):
        simulate("cpu-2", TINY, "W0", SimSettings(steps=2), systems=["zero3"])


def test_dispatch_flows_follow_the_dispatch_rule():
    """The vectorised dispatch the scheduler and the simulator use equals the rule of planning.dispatch
    (eligible_ranks, even split), and its cross-node part is what leaves the source's node."""
    import random

    from ds_hecate.planning.dispatch import eligible_ranks, node_of
    from ds_hecate.planning.dispatch import dispatch_flows

    rng = random.Random(3)
    for _ in range(200):
        rpn = rng.choice([1, 2, 3])
        world = rpn * rng.randint(1, 4)
        num_experts = rng.randint(1, 6)
        counts = [[rng.choice([0, 0, rng.randint(1, 50)]) for _ in range(num_experts)] for _ in range(world)]
        holders = [sorted(rng.sample(range(world), rng.randint(1, world))) for _ in range(num_experts)]
        mask = np.zeros((num_experts, world), dtype=bool)
        for e, hs in enumerate(holders):
            mask[e, hs] = True
        flows = dispatch_flows(np.asarray(counts, dtype=float).T, mask, rpn)
        processed = np.zeros((num_experts, world))
        sent, received, sent_x, received_x = (np.zeros(world) for _ in range(4))
        for src in range(world):
            for e in range(num_experts):
                n = counts[src][e]
                if not n:
                    continue
                cands = eligible_ranks(src, holders[e], rpn)
                if cands == [src]:
                    processed[e, src] += n
                    continue
                sent[src] += n
                crosses = node_of(cands[0], rpn) != node_of(src, rpn)
                sent_x[src] += n if crosses else 0
                for d in cands:
                    processed[e, d] += n / len(cands)
                    received[d] += n / len(cands)
                    received_x[d] += n / len(cands) if crosses else 0
        np.testing.assert_allclose(flows.processed, processed, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(flows.sent.sum(axis=0), sent, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(flows.received.sum(axis=0), received, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(flows.sent_inter.sum(axis=0), sent_x, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(flows.received_inter.sum(axis=0), received_x, rtol=1e-12, atol=1e-9)


def test_a_domain_larger_than_the_experts_and_ring_what_if():
    """64 ranks, 8 experts, one Hecate domain of all 64 ranks (``ep_size=64``, the layout before groups): Hecate
    starts from the expert-data-parallel layout when its budget allows (else says so), and its owner-sends
    SparseAllGather costs more exposed time than the ring-broadcast what-if."""
    base = SimSettings(steps=3, world_size=64, ep_size=64, materialize_budget_mb=16384.0)
    p2p = simulate("h100-128x8", "mixtral-8x7b", "W0", base, systems=["hecate"])
    ring = simulate("h100-128x8", "mixtral-8x7b", "W0", replace(base, spag="ring"), systems=["hecate"])
    assert p2p.systems["hecate"].replicas_per_layer == 64 - 8            # one expert per non-owner rank
    assert ring.systems["hecate"].breakdown_s["exposed_comm"] < p2p.systems["hecate"].breakdown_s["exposed_comm"]
    assert not p2p.notes
    starved = simulate("h100-128x8", "mixtral-8x7b", "W0", replace(base, materialize_budget_mb=100.0),
                       systems=["hecate"])
    assert any("replica budget (0 per layer per rank)" in n for n in starved.notes)
    assert starved.systems["hecate"].imbalance == pytest.approx(8.0)    # only the 8 owners compute


def test_a_calibrated_step_does_not_leak_its_exposed_gather_into_later_steps():
    """Stationary routing: only the first step (no prediction yet) is calibrated; later steps run the prefetched
    placement, with no gather after the gate, exactly as without calibration (the whole search in one call: a
    sliced search prefetches the calibrated placement meanwhile, by design, test_sliced_search)."""
    from ds_hecate.config import HecateConfig

    runs = {on: simulate("v100-4x8", "gpt-moe-s", "W1",
                         SimSettings(steps=5, charge_planning=False, hecate=HecateConfig(
                             enabled=True, calibration=on, materialize_budget_mb=3276.8, search_slice_us=0,
                             plan_budget_us=1e9)),   # not cut short by the default budget
                         systems=["hecate"])
            for on in (True, False)}
    with_cal, without = runs[True].systems["hecate"].step_times_s, runs[False].systems["hecate"].step_times_s
    assert with_cal[1:] == without[1:]
    assert with_cal[0] < without[0]   # the first step: calibration from the owners' placement beats plain EP


def test_host_planning_is_charged_to_hecate_only():
    """The simulator times the runtime's own planning (critical path and exposed search) and adds it to Hecate's
    step; without the charge the figures are what they were, and the difference is the reported host time."""
    base = SimSettings(steps=4, materialize_budget_mb=0.0)
    off = simulate("a100-4x8", "bert-moe", "W2", replace(base, charge_planning=False), systems=["ep", "hecate"])
    on = simulate("a100-4x8", "bert-moe", "W2", base, systems=["ep", "hecate"])
    planning = on.systems["hecate"].breakdown_s["host_planning"]
    assert planning > 0 and off.systems["hecate"].breakdown_s["host_planning"] == 0
    assert on.systems["ep"].step_times_s == off.systems["ep"].step_times_s
    assert on.systems["hecate"].step_time_s == pytest.approx(off.systems["hecate"].step_time_s + planning, rel=1e-9)


def test_thread_clock_charges_the_threads_cpu_time(monkeypatch):
    """``planning_clock: thread`` charges what the planning thread's CPU clock (``time.thread_time``) says its calls
    took, not the wall clock, which other processes stretch: with that clock replaced by one that advances one
    second (then two) per reading, the charge follows it, whatever the wall clock did."""
    from types import SimpleNamespace

    import ds_hecate.sim.systems as systems

    def charged(tick: float) -> float:
        readings = iter(range(1_000_000))
        clock = SimpleNamespace(thread_time=lambda: tick * next(readings), perf_counter=systems.time.perf_counter)
        monkeypatch.setattr(systems, "time", clock)
        result = simulate("a100-4x8", "gpt-moe-s", "W1", SimSettings(steps=3, force_balanced=False,
                                                                    planning_clock="thread"), systems=["hecate"])
        monkeypatch.undo()
        return result.systems["hecate"].breakdown_s["host_planning"]

    one, two = charged(1.0), charged(2.0)
    assert one > 0.5, one   # whole seconds per planning call: the replaced clock is the one read
    assert two > one + 0.5, (one, two)


def test_planning_charge_does_not_move_with_the_machines_load():
    """Issue 26, item 6: by default host planning is charged from what the planner did, in its work models'
    microseconds (``planning_clock: work``), so the same cell gives the same figures, to the bit, on an idle machine
    and beside CPU-burning processes (one per core: they take the cores, the simulation's wall time grows by about
    half on 2 cores). Charged in the thread's CPU time (``planning_clock: thread``) the figures move between hosts,
    between idle runs and beside the burners (a busy hyperthread sibling slows the thread itself); charged in wall
    time (``time.perf_counter``) the busy run's planning comes out about twice the idle one's."""
    import os
    import time

    work, thread = SimSettings(steps=12, force_balanced=False), SimSettings(steps=12, force_balanced=False,
                                                                          planning_clock="thread")
    idle = simulate("a100-4x8", "gpt-moe-s", "W6", work, systems=["hecate"])
    idle_thread = simulate("a100-4x8", "gpt-moe-s", "W6", thread, systems=["hecate"])
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(2, os.cpu_count() or 2))]
    try:
        time.sleep(0.3)   # the burners are running
        started = time.perf_counter(), time.process_time()
        busy = simulate("a100-4x8", "gpt-moe-s", "W6", work, systems=["hecate"])
        busy_thread = simulate("a100-4x8", "gpt-moe-s", "W6", thread, systems=["hecate"])
        while time.process_time() - started[1] < 0.5:   # half a second of CPU at least, however fast the cells ran
            pass
        wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert wall > 1.2 * cpu, f"the burners did not load the machine (wall {wall:.2f} s, CPU {cpu:.2f} s)"
    planning = [r.systems["hecate"].breakdown_s["host_planning"] for r in (idle, busy)]
    assert planning[0] > 0
    assert busy.systems["hecate"].step_times_s == idle.systems["hecate"].step_times_s
    assert planning[1] == planning[0]
    # the thread clock is not compared across loads: with the cores' hyperthread siblings busy a thread's CPU time
    # itself grows, which is why it is not the default. What holds whatever the load:
    # the rest of the step is the model's (the planner decides by its work model, not a clock)
    threads = [r.systems["hecate"].breakdown_s["host_planning"] for r in (idle_thread, busy_thread)]
    assert threads[0] > 0 and threads[1] > 0, threads
    steps = [r.systems["hecate"].step_time_s for r in (idle_thread, busy_thread)]
    assert steps[1] - threads[1] == pytest.approx(steps[0] - threads[0], rel=1e-9), (steps, threads)
    assert idle_thread.systems["hecate"].step_time_s - threads[0] == pytest.approx(
        idle.systems["hecate"].step_time_s - planning[0], rel=1e-9)


def test_work_clock_counts_what_the_planner_did():
    """The work clock charges the pieces the call ran: a call whose prediction held pays the per-call part alone;
    a burst the shadow move takes pays the per-call part, the imbalance estimate, the shadow move's two estimates
    and the new placement's dispatch tables."""
    from ds_hecate.planning.search.call_work import CALL_WORK
    from ds_hecate.sim import systems as sim_systems

    calls = []
    real = sim_systems.LayerPlanner.plan_call

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(out)
        return out

    import unittest.mock as mock
    with mock.patch.object(sim_systems.LayerPlanner, "plan_call", spy):
        simulate("a100-4x8", "gpt-moe-s", "W7", SimSettings(steps=12, force_balanced=False), systems=["hecate"])
    world, experts = 32, 64
    base = CALL_WORK.call_cost_us(world, experts)
    burst = (base + CALL_WORK.score_cost_us(world, experts) + 2 * CALL_WORK.estimate_cost_us(world, experts)
             + CALL_WORK.tables_cost_us(world, experts))
    shadowed = [c.work_us for c in calls if c.shadowed]
    held = [c.work_us for c in calls if c.extras is None and not c.searched]
    assert shadowed and all(w == pytest.approx(burst) for w in shadowed), (shadowed, burst)
    assert held and min(held) == pytest.approx(base)


# ---------------------------------------------------------------------------------------------------------------
# Hecate domains (hecate.ep_size): one planner per group, expert data parallelism across groups
# ---------------------------------------------------------------------------------------------------------------
EIGHT = ModelShape(name="eight", moe_layers=2, hidden_size=256, ffn_size=512, num_experts=8, top_k=2, vocab_size=0,
                   seq_len=512, expert_bias=True)


def _hot_group(world: int, steps: int, hot: bool) -> list:
    """counts[step][layer] for one group of ``world`` ranks: W1 (rank 0's experts hot) or balanced W0."""
    from ds_hecate.sim.workloads import routing_counts

    name = "W1" if hot else "W0"
    return [[np.asarray(routing_counts(name, s, world, EIGHT.num_experts, 512, EIGHT.top_k), dtype=float)] *
            EIGHT.moe_layers for s in range(steps)]


def test_default_group_size_is_the_runtime_rule():
    result = simulate("h100-128x8", EIGHT, "W0", SimSettings(steps=2, world_size=32), systems=["ep", "hecate"])
    assert (result.ep_size, result.edp_size) == (8, 4)        # 32 ranks > 8 experts: one node per group
    assert simulate("v100-4x8", "gpt-moe-s", "W0", SimSettings(steps=2), systems=["ep"]).ep_size == 32   # the world
    twelve = ModelShape(**{**vars(EIGHT), "num_experts": 12})
    with pytest.raises(HecateError, match="groups of 12 ranks do not align with nodes of 8"):
        simulate("h100-128x8", twelve, "W0", SimSettings(steps=2, world_size=24, ep_size=12), systems=["ep"])


@pytest.mark.parametrize("system", ["ep", "hecate"])
def test_groups_run_like_one_group_plus_the_edp_reduction(system):
    """Two identical groups of 8 (16 ranks, G = 8) time every layer call exactly as one group of 8 on its own:
    each group's planner sees only its group's ranks and counts. What the second group adds is the reduction of
    the owners' expert gradients over the 2 EDP peers, once per layer and step, exposed, computed here by hand:
    ZeRO-1 ring reduce-scatter of the gradients and all-gather of the weights, (R-1)/R of each through every rank,
    the 8 ranks of a node sharing its NICs, one latency per ring hop."""
    steps = 4
    one = _hot_group(8, steps, hot=True)
    two = [[np.concatenate([c, c]) for c in layers] for layers in one]
    base = SimSettings(steps=steps, charge_planning=False, force_balanced=False)
    alone = simulate("h100-128x8", EIGHT, "W1", replace(base, world_size=8), systems=[system],
                     counts=one).systems[system]
    paired = simulate("h100-128x8", EIGHT, "W1", replace(base, world_size=16, ep_size=8), systems=[system],
                      counts=two).systems[system]
    cluster = CLUSTERS["h100-128x8"]
    grad_b = 2   # DeepSpeed's bf16 gradients; Hecate's fp32 accumulators, sent in bf16 (reduce_dtype auto)
    moved = 0.5 * EIGHT.expert_params * (grad_b + 2)
    per_layer = moved * 8 / (cluster.inter_node_gbps * 1e9) + 2 * cluster.inter_latency_s
    assert alone.breakdown_s["edp_reduce"] == 0.0
    assert paired.breakdown_s["edp_reduce"] == pytest.approx(EIGHT.moe_layers * per_layer, rel=1e-12)
    for a, b in zip(alone.step_times_s, paired.step_times_s):
        assert b == pytest.approx(a + EIGHT.moe_layers * per_layer, rel=1e-12)
    assert paired.replicas_per_layer == pytest.approx(2 * alone.replicas_per_layer)


def test_each_group_is_planned_on_its_own_counts():
    """A hot group beside a balanced one: replicas go to the hot group's ranks only, and the layer waits for it."""
    steps = 4
    hot, cold = _hot_group(8, steps, hot=True), _hot_group(8, steps, hot=False)
    mixed = [[np.concatenate([c, h]) for c, h in zip(cl, hl)] for cl, hl in zip(cold, hot)]
    base = SimSettings(steps=steps, charge_planning=False, force_balanced=False)
    both = simulate("h100-128x8", EIGHT, "W1", replace(base, world_size=16, ep_size=8), systems=["hecate"],
                    counts=mixed).systems["hecate"]
    alone = simulate("h100-128x8", EIGHT, "W1", replace(base, world_size=8), systems=["hecate"],
                     counts=hot).systems["hecate"]
    assert alone.replicas_per_layer > 0
    assert both.replicas_per_layer == pytest.approx(alone.replicas_per_layer)   # none in the balanced group
    edp = both.breakdown_s["edp_reduce"]
    assert [t - edp for t in both.step_times_s] == pytest.approx(alone.step_times_s, rel=1e-12)


def test_edp_partitioned_memory():
    """ZeRO-1 over R = 4 peers: DeepSpeed's EP keeps bf16 params and grads whole and 1/R of master and Adam
    state; Hecate keeps bf16 weights whole, 1/R of the fp32 gradient, master and Adam state, and in the backward
    that ends the window the whole fp32 gradient rows of two layers (reduce-scattered layer by layer, then freed).
    ZeRO-0: every peer holds the whole expert state (Hecate: fp32 master, fp32 gradient accumulator, Adam state and
    the resident bf16 copy its calls compute from)."""
    from ds_hecate.sim.model_state import dense_state_bytes

    kw: Dict[str, Any] = dict(steps=2, world_size=32, materialize_budget_mb=0.0, force_balanced=False)
    numel, layers = EIGHT.expert_params, EIGHT.moe_layers     # one expert per rank and layer
    for stage, ep_per_param, hc_per_param, transient in ((1, 2 + 2 + 12 / 4, 2 + 4 / 4 + 12 / 4, 2 * numel * 4),
                                                         (0, 16, 16 + 2, 0)):
        r = simulate("h100-128x8", EIGHT, "W0", SimSettings(zero_stage=stage, **kw), systems=["ep", "hecate"]).systems
        dense = sum(dense_state_bytes(EIGHT.dense_params, 32, stage, "bf16", 8))
        assert r["ep"].peak_memory_bytes == pytest.approx(dense + layers * numel * ep_per_param, abs=64)
        assert r["hecate"].peak_memory_bytes == pytest.approx(dense + layers * numel * hc_per_param + transient,
                                                              abs=64)
