"""A 100-step soak on 2 ranks under a rotating hot spot: re-sharding fires repeatedly, nothing hangs, resident
memory stays flat after warm-up, and the losses stay those of data-parallel training (tests/soak.py; the
1,000-step figures are in docs/benchmarks.md)."""
from __future__ import annotations

from soak import run


def test_soak_100_steps_rotating_hotspot():
    results = run(steps=100, warmup=30, spot_every=10, timeout=300)
    for rank, r in enumerate(results):
        assert r["reshards"] >= 3, f"rank {rank}: re-sharding fired only {r['reshards']} times"
        growth = r["rss_end"] / r["rss_after_warmup"] - 1
        assert growth <= 0.05, f"rank {rank}: resident memory grew {growth:.1%} after warm-up"
        assert r["worst_spot_loss_rel_diff"] <= 1e-5, r["worst_spot_loss_rel_diff"]
        assert r["imbalance_after"] <= r["imbalance_before"]
