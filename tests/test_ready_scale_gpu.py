"""The ready scale next to a running producer on one GPU (W=1, T=8192, K=2048, N=4096, E=16,
stress_skew, compact, bf16), through benchmarks/ready_scale.py's own checks: each variant's
output from NaN-filled buffers equals the producer-then-scale step within bf16's rounding in 3
runs, with no time-out record. The load-poll and claim-counter variants are those that failed
on 2026-12-02 before rev 9693b06 (each warp loaded its own copy of a tile's counters, warps that
read them apart parted at a branch holding barriers: NaN rows, and an illegal address with a
claim counter; at this workload the first load-poll and the 2-per-SM tail variants gave NaN rows
then, ready_scale_9c485c5.parquet); the atomic-poll variant is the reference. Timings are not
asserted.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

VARIANTS = ["beside132_n1024", "beside132_n1024_ld", "beside132_tail2w8", "beside132_tail4_ld_b2k"]


def test_ready_scale_variants_equal_the_sequential_step_beside_the_producer():
    from benchmarks.ready_scale import TOP_K, K, T, measure_workload
    from harness.workload import WorkloadSpec

    spec = WorkloadSpec(T, K, 4096, 16, TOP_K, 1, "stress_skew", "bfloat16")
    rows: list[dict] = []
    measure_workload(spec, VARIANTS, iters=3, emit=rows.append)
    got = {r["variant"]: r for r in rows}
    for name in VARIANTS:
        r = got[name]
        assert r["status"] == "ok", (name, r.get("reason"))
        assert r["max_rel_diff"] <= 8e-3, (name, r["max_rel_diff"])
