"""``python -m benchmarks.layer --hf``, briefly: on the quick shape it runs, pairs its rounds, ds_hecate computes what
transformers' own call computes, its table renders into its own block, and its per-call relayout check sees a
relayout planted in the experts' views (the timings themselves are the benchmark's, run on a quiet machine); and
GPT-OSS's experts run the grouped path (the fused fast path) with the per-expert loop's numbers.

One 1-rank process (the benchmark builds its one-rank process group); about 15 to 25 s."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from dist_utils import run_ranks  # noqa: E402

FAMILIES = ["mixtral", "gpt_oss"]


def _hf_check(rank, world_size):
    """(the run record of ``--quick --hf mixtral,gpt_oss``, the relayout ops found with a per-call relayout planted
    (every expert's weights copied before the GEMMs), GPT-OSS's grouped path against its per-expert loop)."""
    import torch

    from benchmarks import common, layer
    from benchmarks.layer_systems import BUILDERS, SHAPES, routed_inputs
    from ds_hecate.runtime.sharded_experts import ExpertCompute

    args = layer.parse_args(["--quick", "--hf", ",".join(FAMILIES), "--reps", "2"])
    cell = layer.measure_cell(args.shape[0], args.dtype[0], args.device, args.reps, args.warmup, args.systems)
    record = common.run_record(layer.SCHEMA, layer.MODULE, args.argv, common.describe_machine(), hf=args.hf,
                               cells=[cell])
    shape, device = SHAPES["quick"], torch.device("cpu")
    inputs = routed_inputs(shape, torch.float32, device)
    keep_views = ExpertCompute.keep_views   # the owned experts' views, asked for by every forward

    def copied(self, weights):
        return {name: view.transpose(1, 2).contiguous().transpose(1, 2) if view.dim() == 3 else view
                for name, view in keep_views(self, weights).items()}
    setattr(ExpertCompute, "keep_views", copied)
    try:
        built = BUILDERS["gpt_oss/ds_hecate"](shape, inputs, torch.float32, device)
        layer.one_call(built, inputs.x, inputs.grad, device)
        broken = layer.relayout_ops(built, inputs.x, shape)
    finally:
        setattr(ExpertCompute, "keep_views", keep_views)
    return record, broken, _grouped_against_loop(shape, inputs)


def _grouped_against_loop(shape, inputs):
    """GPT-OSS's layer call (interleaved, transposed, biased experts with their own gate) on the grouped path and
    on the per-expert loop: the largest relative difference of the output, the input gradient and every expert's
    gradient, and how many grouped GEMMs each path ran."""
    import os

    import torch
    import torch.nn.functional as F
    from benchmarks.layer_systems import BUILDERS
    from ds_hecate.runtime.sharded_experts import ExpertCompute

    built = BUILDERS["gpt_oss/ds_hecate"](shape, inputs, torch.float32, torch.device("cpu"))
    binding = built.keep[2]
    grouped_mm, calls = F.grouped_mm, []

    def counted(*args, **kwargs):
        calls.append(1)
        return grouped_mm(*args, **kwargs)
    F.grouped_mm = counted
    results = {}
    try:
        for mode in ("1", "0"):
            os.environ["DS_HECATE_GROUPED_MM"] = mode   # read when a layer's experts are built
            binding.compute = ExpertCompute(binding.shard.kernel, torch.float32)
            calls.clear()
            leaf = inputs.x.detach().requires_grad_(True)
            out = built.forward(leaf)
            out.backward(inputs.grad)
            built.after_backward()
            expert_grads = torch.stack([binding.shard.masters[e].grad.clone() for e in binding.shard.owned])
            results[mode] = (out.detach(), leaf.grad, expert_grads, len(calls))
            built.reset()
    finally:
        F.grouped_mm = grouped_mm
        os.environ["DS_HECATE_GROUPED_MM"] = "1"
    rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(results["1"][:3], results["0"][:3]))
    return {"max_rel": rel, "grouped_mm_calls": (results["1"][3], results["0"][3])}


def test_hf_layer_calls_pair_agree_and_no_relayout_per_call_but_the_check_sees_one(tmp_path):
    from benchmarks import common, layer

    record, broken, grouped_against_loop = run_ranks(1, _hf_check, timeout=600)[0]
    cell = record["cells"][0]
    assert list(cell["systems"]) == ["plain"] + [f"{f}/{side}" for f in FAMILIES for side in ("ds_hecate",
                                                                                                 "transformers")]
    for family in FAMILIES:
        hecate = cell["systems"][f"{family}/ds_hecate"]
        assert hecate["status"] == "ok" and cell["systems"][f"{family}/transformers"]["status"] == "ok"
        assert hecate["relayout_ops"] == []                       # layouts are converted once, at take-over
        assert len(hecate["times_s"]) == cell["reps"] == 2        # paired: one call per round each
        # the same function as transformers' own call on the same weights and routing
        assert max(hecate["agreement"].values()) <= layer.AGREEMENT_TOL["fp32"], (family, hecate["agreement"])
    median, lo, hi = common.paired_ratio(cell["systems"]["gpt_oss/ds_hecate"]["times_s"],
                                         cell["systems"]["mixtral/ds_hecate"]["times_s"])
    assert lo <= median <= hi
    # a planted per-call relayout is seen, on tensors holding all 16 experts
    assert broken and all("[16, " in op for op in broken), broken
    # the fast path serves GPT-OSS's layout, with the loop's numbers
    grouped, loop = grouped_against_loop["grouped_mm_calls"]
    assert grouped > 0 and loop == 0
    assert grouped_against_loop["max_rel"] < 1e-5, grouped_against_loop

    # its table goes to its own block (``benchmarks.layer --hf``), leaving the layer table's block alone
    path, doc = tmp_path / "hf.json", tmp_path / "bench.md"
    path.write_text(json.dumps(record))
    hf_begin, hf_end = common.markers("benchmarks.layer --hf")
    layer_begin, layer_end = common.markers("benchmarks.layer")
    doc.write_text("\n".join([layer_begin, "layer table", layer_end, hf_begin, "old", hf_end]) + "\n")
    assert layer.main(["--report-only", str(path), "--markdown", str(doc)]) == 0
    text = doc.read_text()
    assert "layer table" in text and "old" not in text
    rows = [line for line in text.splitlines() if line.startswith("| quick | fp32 |")]
    assert [row.split(" | ")[2] for row in rows] == FAMILIES
    assert all(row.rstrip(" |").endswith("none") for row in rows), rows


def test_hf_option_refuses_unknown_families_and_n_rank():
    from benchmarks import layer
    assert layer.parse_args(["--hf", "mixtral,glm4_moe"]).systems[1] == "mixtral/transformers"
    for argv in (["--hf", "mixtral,no_such_family"], ["--hf", "mixtral", "--n-rank"]):
        with pytest.raises(SystemExit):
            layer.parse_args(argv)
