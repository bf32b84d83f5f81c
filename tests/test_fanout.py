"""Tree fan-out of the sparse collectives (ds_hecate.planning.fanout, ds_hecate.comm.relay).

The trees' rule once explicit (what the runtime runs) and once vectorised (what the scheduler and the simulator
charge) must count the same transfers; every replica must receive its expert from a rank that holds it one stage
earlier; a rank forwards at most ``fanout`` copies across nodes and ``fanout`` inside its node; and on real gloo
processes the relayed SparseAllGather delivers the owners' experts bit for bit and the relayed SparseReduceScatter
returns the exact sum of every copy's gradient (integer-valued, so a lost or doubled hop changes it). The
training-level check is in tests/test_exactness.py (4 ranks on 2 nodes, fan-out 1, against DeepSpeed).
"""
from __future__ import annotations

import random
from collections import Counter
from typing import Any, Dict, cast

import numpy as np
import pytest
import torch

from dist_utils import run_ranks
from ds_hecate.comm.buffers import TensorAccumulator
from ds_hecate.planning import Placement
from ds_hecate.planning.cost_model import StepCostModel, estimate_layer
from ds_hecate.planning.fanout import RelayPlan, node_fanout, relay_parents, relay_transfers, tree_transfers


def _random_holders(rng: np.random.Generator):
    world = int(rng.choice([2, 4, 8, 16, 32, 48]))
    rpn = int(rng.choice([w for w in (1, 2, 4, 8, 16) if world % w == 0]))
    k = 6
    owners = rng.integers(0, world, size=k)
    holders = rng.random((k, world)) < rng.random()
    return world, rpn, owners, holders


@pytest.mark.parametrize("seed", range(4))
def test_vectorised_counts_are_the_explicit_trees(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        world, rpn, owners, holders = _random_holders(rng)
        fanout, chunks = int(rng.choice([0, 1, 2, 3, 4, 8])), int(rng.choice([1, 2, 4, 16]))
        stream = bool(rng.random() < 0.5)
        got = tree_transfers(holders, owners, rpn, fanout, chunks, stream)
        expected = [np.zeros(holders.shape) for _ in range(4)]
        for i in range(len(owners)):
            parents = relay_parents(int(owners[i]), np.flatnonzero(holders[i]).tolist(), rpn, fanout, chunks,
                                    stream)
            replicas = set(np.flatnonzero(holders[i]).tolist()) - {int(owners[i])}
            assert set(parents) == replicas
            for child, parent in parents.items():
                across = child // rpn != parent // rpn
                expected[2 if across else 0][i, child] += 1
                expected[3 if across else 1][i, parent] += 1
            sends = Counter((p, c // rpn != p // rpn) for c, p in parents.items())
            if fanout and len(parents) > fanout:
                assert max(sends.values()) <= fanout, (sends, fanout)       # the fan-out bound
                leaders = {c for c, p in parents.items() if c // rpn != p // rpn}
                assert len({c // rpn for c in leaders}) == len(leaders)     # one copy across the NICs per node
            else:
                assert set(parents.values()) <= {int(owners[i])}            # flat: the owner sends all
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)


def test_relay_plan_stages_forward_only_what_arrived():
    rng = random.Random(5)
    for _ in range(200):
        world, experts = rng.choice([4, 8, 16]), rng.choice([2, 6])
        rpn = rng.choice([w for w in (1, 2, 4) if world % w == 0])
        owners = tuple(rng.randrange(world) for _ in range(experts))
        mat = tuple(tuple(sorted({e for e in range(experts) if owners[e] == r or rng.random() < 0.6}))
                    for r in range(world))
        placement = Placement(owners, mat)
        plan = RelayPlan.of(placement, rpn, rng.choice([1, 2]))
        holds = {(e, owners[e]) for e in range(experts)}
        received: Counter = Counter()
        for stage in plan.stages:
            assert all((e, src) in holds for e, src, _ in stage), "a rank forwards an expert it does not hold yet"
            holds |= {(e, dst) for e, _, dst in stage}
            received.update((e, dst) for e, _, dst in stage)
        assert set(received) == set(placement.gather_pairs) and set(received.values()) <= {1}
        for r in range(world):
            assert sorted(plan.received_order(r)) == sorted(e for e, d in placement.gather_pairs if d == r)
        flat = RelayPlan.of(placement, rpn, 0)
        assert len(flat.stages) <= 1 and all(owners[e] == src for e, src, _ in (flat.stages or ((),))[0])
        for r in range(world):    # flat rows: owner ascending, then expert, as SparseAllGather always had them
            recvs = placement.gather_recvs(r)
            assert flat.received_order(r) == [e for s in sorted(recvs) for e in recvs[s]]


def test_scheduler_charges_the_tree_not_the_flat_fan_out():
    """One expert on all 32 ranks of 4 nodes: flat, its owner's node sends 24 copies through its NICs; relayed
    with fan-out 4, 3 (one per other node), and the estimate falls accordingly."""
    world, rpn = 32, 8
    owners = tuple(e * world // 64 for e in range(64))
    counts = np.full((world, 64), 10.0)
    mat = tuple(tuple(sorted({e for e, o in enumerate(owners) if o == r} | {0})) for r in range(world))
    base: Dict[str, Any] = dict(compute_s_per_pair=1e-9, token_transfer_s=1e-9, expert_transfer_s=1e-4,
                token_transfer_inter_s=1e-8, expert_transfer_inter_s=8e-3)
    flat = estimate_layer(counts, owners, mat, StepCostModel(**base, fanout=0), rpn)
    tree = estimate_layer(counts, owners, mat, StepCostModel(**base, fanout=4), rpn)
    # exposed transfers are a barrier (every rank waits for the slowest), so the layer's time is the slowest NIC's
    assert flat.time_s == pytest.approx(24 * 8e-3 / 8, rel=1e-2)    # the owner's node NICs: 24 copies
    # 3 copies, one per other node, then the levels inside each node (cheap links, with their pipeline's fill)
    assert 3 * 8e-3 / 8 <= tree.time_s < 1.25 * 3 * 8e-3 / 8


class _StreamOrderedGloo:
    """gloo standing in for a stream-ordered transport (NCCL on CUDA): it says it is, and its relay scope runs the
    chain in place, each primitive completing before the next (a valid schedule of the stream's order); it counts
    scopes and joins, so a test sees the relay issue every stage inside one scope and join once."""

    def __init__(self, inner):
        self.inner, self.scopes, self.joins = inner, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    stream_ordered = True

    def relay_scope(self, tensors):
        import contextlib
        assert all(isinstance(t, torch.Tensor) for t in tensors)
        self.scopes += 1

        @contextlib.contextmanager
        def scope():
            yield self._join
        return scope()

    def _join(self):
        self.joins += 1


def _collectives(rank, world, placement, fanout, numel, seed, rpn=2, chunks=1, float_grads=False,
                 stream_ordered=False):
    import torch.distributed as dist
    from ds_hecate.comm.collectives import CommCounters, Communicator
    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm = Communicator(None, rank, world)
    if stream_ordered:
        comm.weights = _StreamOrderedGloo(comm.weights)
    plan = RelayPlan.of(placement, rpn, fanout, chunks)
    exchanges = []
    exchange_rows = comm.exchange_rows

    def counted(*args, **kwargs):
        exchanges.append(args[4] if len(args) > 4 else kwargs.get("async_op"))
        return exchange_rows(*args, **kwargs)
    setattr(comm, "exchange_rows", counted)
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randint(-50, 50, (len(placement.owners), numel), generator=gen).float()
    owned = {e: weights[e].clone() for e, o in enumerate(placement.owners) if o == rank}
    counters = CommCounters()
    pending = comm.start_sparse_all_gather(placement, owned, numel, torch.float32, counters, relay=plan)
    gather_started = len(exchanges)
    gathered = pending.wait()
    gather_total = len(exchanges)
    # every copy's gradient: a per-(rank, expert) integer pattern, so sums are exact in fp32 whatever the order
    if float_grads:   # sums whose rounding depends on their order: chunking must not change it
        grads = torch.stack([torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1000 + rank * 37 + e))
                             for e in gathered.experts])
    else:
        grads = torch.stack([torch.full((numel,), float(1 + rank * 7 + e)) for e in gathered.experts])
    accumulator = torch.zeros(gathered.owned, numel)
    finish = comm.start_sparse_reduce_scatter(placement, gathered.experts, grads[:gathered.owned],
                                              grads[gathered.owned:], torch.float32, counters,
                                              TensorAccumulator(accumulator), relay=plan)
    reduce_started = len(exchanges) - gather_total
    finish()
    return {"issued_at_start": (gather_started, reduce_started),
            "issued": (gather_total, len(exchanges) - gather_total),
            "scopes": ((cast(_StreamOrderedGloo, comm.weights).scopes, cast(_StreamOrderedGloo, comm.weights).joins)
                       if stream_ordered else None),
            "rows": {e: row.clone() for e, row in gathered.flats().items()}, "weights": weights,
            "sums": dict(zip(gathered.experts[:gathered.owned], accumulator.unbind(0))),
            "stages": len(plan.stages), "sent": counters.allgather_bytes, "exchanges": len(exchanges),
            "sent_back": counters.reducescatter_bytes}


@pytest.mark.parametrize("fanout", [0, 1, 2])
def test_relayed_collectives_deliver_and_sum_every_copy(fanout):
    """4 ranks as 2 nodes of 2: experts 0 and 1 on every rank (3 replicas each: relayed for fan-out 1 and 2),
    others scattered."""
    world, numel = 4, 6
    owners = (0, 3, 1, 2, 0, 1)
    mat = ((0, 1, 4), (0, 1, 2, 5), (0, 1, 3, 4), (0, 1, 2, 3))
    placement = Placement(owners, mat)
    results = run_ranks(world, _collectives, placement, fanout, numel, 11)
    weights = results[0]["weights"]
    assert results[0]["stages"] == (1 if fanout == 0 else 2)   # rank 3 gets experts 0 and 1 through rank 2
    for r, res in enumerate(results):
        assert sorted(res["rows"]) == sorted(mat[r])
        for e, row in res["rows"].items():
            assert torch.equal(row, weights[e]), f"rank {r} expert {e}: not its owner's weights"
        for e, total in res["sums"].items():
            expected = sum(1 + h * 7 + e for h in range(world) if e in mat[h])
            assert torch.equal(total, torch.full((numel,), float(expected))), f"owner {r} expert {e}"
    if fanout == 1:
        # every copy still crosses once (the same bytes in all); rank 3 got expert 0 from rank 2, not its owner
        assert (0, 2, 3) in RelayPlan.of(placement, 2, 1).stages[1]
        flat = run_ranks(world, _collectives, placement, 0, numel, 11)
        assert sum(r["sent"] for r in results) == sum(r["sent"] for r in flat)


def test_pipelined_relay_is_bit_equal_to_level_by_level_and_takes_fewer_rounds():
    """4 ranks in one node, fan-out 1: an expert on every rank travels down a chain of depth 3 (owner -> a -> b ->
    c), so the pipelined exchanges carry chunks of two levels at once. Whatever ``relay_chunks`` (3 and 4 do not
    divide the rows, 64 exceeds them), every rank receives its owners' weights bit for bit and every owner's
    gradient sum is bit-equal to the level-by-level one (random floats: a changed summation order shows), in
    ``1 + (D - 2 + chunks)`` exchanges per collective on every rank."""
    world, numel = 4, 10
    owners = (0, 1, 2, 3, 0)
    mat = ((0, 1, 4), (0, 1, 4), (0, 1, 2, 4), (0, 1, 3, 4))   # experts 0, 1 and 4 on every rank: chains of 3
    placement = Placement(owners, mat)
    plan = RelayPlan.of(placement, 4, 1)
    assert len(plan.stages) == 3
    runs = {c: run_ranks(world, _collectives, placement, 1, numel, 5, 4, c, True) for c in (1, 3, 4, 64)}
    weights = runs[1][0]["weights"]
    for chunks, results in runs.items():
        pieces = min(chunks, numel)
        for r, res in enumerate(results):
            for e, row in res["rows"].items():
                assert torch.equal(row, weights[e]), f"chunks {chunks} rank {r} expert {e}"
            for e, total in res["sums"].items():
                assert torch.equal(total, runs[1][r]["sums"][e]), f"chunks {chunks} owner {r} expert {e}"
            # gather: the first stage, then D - 2 + chunks pipelined; the reduction the same
            assert res["exchanges"] == 2 * (1 + 3 - 2 + pieces), (chunks, res["exchanges"])
            assert res["sent"] == runs[1][r]["sent"] and res["sent_back"] == runs[1][r]["sent_back"]
    flat = run_ranks(world, _collectives, placement, 0, numel, 5, 4, 1, True)
    for r, res in enumerate(runs[4]):
        for e, total in res["sums"].items():
            torch.testing.assert_close(total, flat[r]["sums"][e], rtol=1e-5, atol=1e-5)


def test_stream_ordered_relay_issues_every_stage_at_start_bit_equal():
    """On a stream-ordered transport (NCCL on CUDA; here gloo standing in for one) a relayed SparseAllGather and
    SparseReduceScatter issue every stage when they start, inside one relay scope each, and their wait only joins
    it; on gloo itself only the first stage goes at start. Same rows and bit-equal gradient sums (random floats)
    either way. Chains of depth 3 on 4 ranks, 3 chunks."""
    world, numel = 4, 10
    owners = (0, 1, 2, 3, 0)
    mat = ((0, 1, 4), (0, 1, 4), (0, 1, 2, 4), (0, 1, 3, 4))
    placement = Placement(owners, mat)
    host = run_ranks(world, _collectives, placement, 1, numel, 5, 4, 3, True)
    stream = run_ranks(world, _collectives, placement, 1, numel, 5, 4, 3, True, True)
    for r in range(world):
        assert stream[r]["issued"] == host[r]["issued"]
        assert stream[r]["issued_at_start"] == stream[r]["issued"], stream[r]       # all of them at start
        assert host[r]["issued_at_start"] == (1, 1), host[r]                         # the first stage only
        assert stream[r]["scopes"] == (2, 2)                                          # one scope, one join each
        for e, row in stream[r]["rows"].items():
            assert torch.equal(row, host[r]["rows"][e])
        for e, total in stream[r]["sums"].items():
            assert torch.equal(total, host[r]["sums"][e]), f"owner {r} expert {e}"


def test_pipeline_schedule():
    """Exchange t carries chunk t - (s - 1) of every stage s >= 1 that has it: each (stage, chunk) once, a
    level's chunk one exchange after the level above delivered it."""
    edges = tuple((((0, 0, s + 1),) for s in range(4)))
    plan = RelayPlan(edges, 3)
    rounds = plan.pipeline(3)
    assert len(rounds) == 4 - 2 + 3
    seen = {pair: t for t, active in enumerate(rounds) for pair in active}
    assert sorted(seen) == [(s, c) for s in range(1, 4) for c in range(3)]
    assert all(seen[(s + 1, c)] == seen[(s, c)] + 1 for s in range(1, 3) for c in range(3))
    assert RelayPlan(edges[:1], 3).pipeline(3) == []



def test_relay_transfers_split_as_the_runtime_runs_them():
    """The first level of relay_transfers is the RelayPlan's first stage (the exchange the collective is issued
    with), copy for copy; the rest are the deeper stages, each expert's charged its pipeline's fill
    ``1 + (D - 2) / chunks``; the depth is the plan's stage count; stream-ordered, both together are the first.
    Random placements, node sizes, fan-outs, transports."""
    rng = random.Random(3)
    for _ in range(300):
        world = rng.choice([4, 8, 16, 32])
        rpn = rng.choice([w for w in (1, 2, 4, 8) if world % w == 0])
        experts, p = 3, rng.random()
        owners = tuple(rng.randrange(world) for _ in range(experts))
        mat = tuple(tuple(sorted({e for e in range(experts) if owners[e] == r or rng.random() < p}))
                    for r in range(world))
        fanout, chunks, stream = rng.choice([0, 1, 2, 3, 4]), rng.choice([1, 3, 4]), rng.random() < 0.5
        holders = np.zeros((experts, world), dtype=bool)
        for r, held in enumerate(mat):
            holders[list(held), r] = True
        first, later, depths = relay_transfers(holders, np.array(owners), rpn, fanout, chunks, True, stream)
        if stream:   # stream-ordered: every level issued with the first, nothing left for the wait
            assert not any(part.any() for part in later)
        total = tree_transfers(holders, np.array(owners), rpn, fanout, chunks, stream)
        plan = RelayPlan.of(Placement(owners, mat), rpn, fanout, chunks, stream)
        assert (int(depths.max()) if depths.size else 0) == len(plan.stages)
        for e in range(experts):
            expected = np.zeros((4, world))
            for _, src, dst in (edge for edge in (plan.stages or ((),))[0] if edge[0] == e):
                inter = 2 if src // rpn != dst // rpn else 0
                expected[inter, dst] += 1
                expected[inter + 1, src] += 1
            depth = sum(any(edge[0] == e for edge in stage) for stage in plan.stages)
            fill = 1 + max(depth - 2, 0) / chunks
            deeper = (np.stack([part[e] for part in total]) - expected) * fill
            if stream:
                np.testing.assert_allclose(np.stack([part[e] for part in first]), expected + deeper)
                continue
            np.testing.assert_array_equal(np.stack([part[e] for part in first]), expected)
            np.testing.assert_allclose(np.stack([part[e] for part in later]), deeper)


def test_scheduler_exposes_the_deeper_levels():
    """One expert on all 32 ranks of 4 nodes, fan-out 4, the transfers otherwise hidden (a long overlap): the first
    level (the owner's 3 NIC copies and 4 NVLink ones) hides, the levels below run at the collective's wait and
    are charged exposed with their fill, more with fewer chunks."""
    world, rpn = 32, 8
    owners = tuple(e * world // 64 for e in range(64))
    counts = np.zeros((world, 64))
    mat = tuple(tuple(sorted({e for e, o in enumerate(owners) if o == r} | {0})) for r in range(world))
    base: Dict[str, Any] = dict(compute_s_per_pair=1e-9, token_transfer_s=1e-9, expert_transfer_s=1e-3,
                token_transfer_inter_s=1e-8, expert_transfer_inter_s=8e-3, overlap_s=10.0, fanout=4)
    flat = estimate_layer(counts, owners, mat, StepCostModel(**{**base, "fanout": 0}), rpn)
    assert flat.time_s == 0.0                     # one level: all of it hides
    one = estimate_layer(counts, owners, mat, StepCostModel(**base, relay_chunks=1), rpn)
    four = estimate_layer(counts, owners, mat, StepCostModel(**base, relay_chunks=4), rpn)
    # depth 3 (node leaders, then two levels inside each node): a leader forwards 4 copies over NVLink, at a fill
    # of 1 + 1/chunks
    assert one.time_s == pytest.approx(4 * 1e-3 * 2, rel=1e-6)
    assert four.time_s == pytest.approx(4 * 1e-3 * 1.25, rel=1e-6)
    # a stream-ordered transport issues every level with the collective: all of it hides behind the overlap
    for chunks in (1, 4):
        stream = estimate_layer(counts, owners, mat, StepCostModel(**base, relay_chunks=chunks,
                                                                   relay_stream_ordered=True), rpn)
        assert stream.time_s == 0.0
    # what hides there is every level with its fill, in its own trees: with nothing hidden, one chunk sends to the
    # other 3 nodes' leaders (node_fanout 3: the same tree, the same time); four make a chain of nodes (node_fanout
    # 1), depth 5, its leaders' 4 NVLink copies at a fill of 1 + 3/4
    assert node_fanout(4, 4, 1) == 3 and node_fanout(4, 4, 4) == 1
    short = {**base, "overlap_s": 0.0}
    for chunks, expected in ((1, 4 * 1e-3 * 2), (4, 4 * 1e-3 * 1.75)):
        flow = estimate_layer(counts, owners, mat, StepCostModel(**short, relay_chunks=chunks,
                                                                 relay_stream_ordered=True), rpn)
        assert flow.time_s == pytest.approx(expected, rel=1e-6), chunks


def test_fresh_search_passes_the_relay_barrier():
    """64 ranks x 8 experts, the planner benchmark's skewed prediction: priced as the runtime runs the trees, a
    greedy that adds one move at a time stops where deepening a tree would expose a level at once (0.086 s, exposed
    transfers a barrier for every rank; 0.175 s when they were charged to the receiving rank alone); the same
    search with the trees priced as one hidden flow walks past it (0.076 s, judged with the levels exposed).
    schedule_materialization runs both and keeps the better by the exposed pricing; calibration, which extends a
    start on the critical path, runs the first alone."""
    from dataclasses import replace

    from benchmarks.planner import COSTS, REPLICAS_PER_RANK, CallSequence
    from ds_hecate.planning.search import SearchSettings, greedy_pass, schedule_materialization

    seq = CallSequence(64, 8, 8, "skewed", 0)
    prediction, owners, rpn = seq.window.predict_array(), seq.owners, seq.rpn
    assert prediction is not None

    def layer_s(materialized):
        return estimate_layer(prediction, owners, materialized, COSTS, rpn).time_s
    priced = greedy_pass(prediction, owners, SearchSettings(COSTS, REPLICAS_PER_RANK, rpn))
    flow = greedy_pass(prediction, owners, SearchSettings(replace(COSTS, relay_levels_exposed=False),
                                                          REPLICAS_PER_RANK, rpn))
    chosen = schedule_materialization(prediction, owners, SearchSettings(COSTS, REPLICAS_PER_RANK, rpn))
    assert layer_s(chosen) == min(layer_s(priced), layer_s(flow))
    assert layer_s(chosen) < 0.95 * layer_s(priced), (layer_s(chosen), layer_s(priced))
    sharded = [[e for e, o in enumerate(owners) if o == r] for r in range(64)]
    assert (schedule_materialization(prediction, owners, SearchSettings(COSTS, REPLICAS_PER_RANK, rpn), start=sharded)
            == greedy_pass(prediction, owners, SearchSettings(COSTS, REPLICAS_PER_RANK, rpn), start=sharded))
