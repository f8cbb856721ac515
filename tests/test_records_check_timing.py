import math
import time

import pandas as pd
import pytest
import torch

from harness.check import check
from harness.records import (
    KEEP_STATUSES,
    KEEP_STATUSES_REDO_FAILED,
    ResultsTable,
    Row,
    cell_hash,
    overlap_ratio,
)
from harness.timing import count_host_syncs, time_fn


def done_hashes(table: ResultsTable, redo_failed: bool = False) -> set[str]:
    """Cells a re-run skips (harness.preflight's rule): `error` cells are always measured again."""
    keep = KEEP_STATUSES_REDO_FAILED if redo_failed else KEEP_STATUSES
    return {h for h, s in table.statuses().items() if s in keep}


def test_check_passes_close_and_fails_far():
    ref = torch.randn(8, 16)
    assert check(ref + 1e-4 * torch.randn(8, 16), ref).ok
    bad = ref.clone()
    bad[3] += 5
    res = check(bad, ref)
    assert not res.ok and "worst row 3" in res.message


def test_a_lost_token_row_fails_although_the_whole_tensor_passes():
    """At T=16384 one zeroed row moves the Frobenius error by ~1/sqrt(T) = 7.8e-3 < 8e-3."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(16384, 64, generator=gen)
    ref /= ref.norm(dim=1, keepdim=True)  # equal row norms: one lost row is 1/sqrt(T) = 7.8e-3
    out = ref + 1e-4 * torch.randn(16384, 64, generator=gen)  # ~1e-3 relative: bf16 rounding
    assert check(out, ref).ok and check(out, ref).max_row_rel_err < 2e-2
    out[1234] = 0  # one token's output lost
    res = check(out, ref)
    assert res.max_rel_err < 8e-3  # the whole-tensor check alone would pass
    assert not res.ok and "row 1234" in res.message and res.max_row_rel_err == pytest.approx(1.0)


def test_rows_with_a_near_zero_reference_do_not_blow_up():
    ref = torch.randn(64, 32)
    ref[5] = 0
    out = ref + 1e-4 * torch.randn(64, 32)
    assert check(out, ref).ok


def test_check_guards_nan_zeros_and_shapes():
    ref = torch.randn(4, 4)
    nan = ref.clone()
    nan[1, 2] = float("nan")
    assert "non-finite" in check(nan, ref).message
    assert "all zeros" in check(torch.zeros(4, 4), ref).message
    assert "shape" in check(torch.zeros(4, 5), ref).message


def test_overlap_ratio_definition():
    assert overlap_ratio(10.0, 4.0, 10.0) == 1.0  # comm fully hidden
    assert overlap_ratio(10.0, 4.0, 14.0) == 0.0  # nothing hidden
    assert overlap_ratio(10.0, 4.0, 12.0) == pytest.approx(0.5)
    assert overlap_ratio(10.0, 4.0, 20.0) == -1.5  # unclipped: noise and slowdowns show
    assert math.isnan(overlap_ratio(10.0, 0.0, 10.0))


def test_table_appends_replaces_and_resumes(tmp_path):
    t = ResultsTable(tmp_path / "x.parquet")
    h1, h2 = cell_hash({"a": 1}), cell_hash({"a": 2})
    assert h1 != h2 and h1 == cell_hash({"a": 1})
    t.append([Row("e", "serial", cell_hash=h1, latency_ms=1.0, metrics={"pad": 3})])
    t.append([Row("e", "serial", cell_hash=h2, status="error", reason="boom")])
    assert done_hashes(t) == {h1}  # an error row is measured again by a plain re-run
    assert done_hashes(t, redo_failed=True) == {h1}
    t.append([Row("e", "serial", cell_hash=h2, latency_ms=2.0)])  # replaces, no duplicate
    df = pd.read_parquet(t.path)
    assert len(df) == 2 and set(df["status"]) == {"ok"}
    assert df.loc[df.cell_hash == h1, "m_pad"].item() == 3


def test_row_rejects_unknown_status():
    with pytest.raises(ValueError):
        Row("e", "s", status="great")


def test_time_fn_on_cpu_gives_ordered_quantiles():
    calls = []
    t = time_fn(
        lambda: calls.append(sum(range(20000))), device=torch.device("cpu"), warmup=2, iters=7
    )
    assert len(calls) == 9 and t.iters == 7
    assert 0 < t.p10_ms <= t.median_ms <= t.p90_ms
    assert t.ci_lo_ms <= t.median_ms <= t.ci_hi_ms


@pytest.mark.gpu
def test_time_fn_queued_ahead_measures_the_device_and_reports_the_host():
    """A step whose host work (2 ms of sleep) dwarfs its device work (a small add): timed eager,
    the events measure the host; queued ahead of the device they measure the device, and both
    report the host's 2 ms per step."""
    dev = torch.device("cuda")
    x = torch.ones(1024, device=dev)

    def step():
        time.sleep(0.002)
        x.add_(1)

    eager = time_fn(step, device=dev, warmup=2, iters=10)
    queued = time_fn(step, device=dev, warmup=2, iters=10, queue_ahead=True)
    assert eager.queued is None and queued.queued is True
    assert eager.median_ms > 1.5 and queued.median_ms < 0.5
    assert eager.host_ms > 1.9 and queued.host_ms > 1.9


def test_median_interval_brackets_the_median_and_narrows_with_samples():
    from harness.timing import median_interval

    gen = torch.Generator().manual_seed(1)
    few = 1.0 + 0.1 * torch.rand(8, generator=gen, dtype=torch.float64)
    many = 1.0 + 0.1 * torch.rand(400, generator=gen, dtype=torch.float64)
    lo8, hi8 = median_interval(few)
    lo, hi = median_interval(many)
    assert lo8 <= float(few.median()) <= hi8 and lo <= float(many.quantile(0.5)) <= hi
    assert hi - lo < hi8 - lo8  # more iterations, a tighter interval
    assert median_interval(few) == (lo8, hi8)  # seeded: reproducible
    assert all(v != v for v in median_interval(torch.ones(1, dtype=torch.float64)))  # n=1: NaN


def test_count_host_syncs_off_cuda_is_none_and_runs_nothing():
    calls = []
    assert count_host_syncs(lambda: calls.append(1), torch.device("cpu")) is None
    assert calls == []


def test_extra_bounds_are_timed_into_metrics():
    # a system's extra_bounds() parts are timed after the bounds and land as m_<name>_ms
    from types import SimpleNamespace

    from harness import measure
    from harness.system import RunContext, Step, System
    from harness.workload import WorkloadSpec

    calls = []

    class FakeStep(Step):
        def timed(self):
            return torch.ones(4, 2)

        def compute_only(self):
            calls.append("compute")

        def comm_only(self):
            calls.append("comm")

        def extra_bounds(self):
            return {"shared": lambda: calls.append("shared")}

    class Fake(System):
        name = "fake"

        def build(self, ranks):
            return FakeStep()

    ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"))
    spec = WorkloadSpec(4, 8, 2, 2, 1, 2, "balanced", dtype="float32")
    row = Row(experiment="e", system="fake", cell_hash="h")
    fake = Fake(ctx, {})
    fake.setup([])
    p = measure._Prepared(row, fake, torch.ones(4, 2), spec)
    p.samples = [1.0, 1.1, 0.9]
    cfg = SimpleNamespace(measure=SimpleNamespace(iters=3, warmup=1, tol=1e-3))
    out = measure.finish_cell(ctx, cfg, p)
    assert out.status == "ok", out.reason
    assert calls.count("shared") == 4  # warmup 1 + iters 3
    assert out.metrics["shared_ms"] >= 0 and out.compute_ms >= 0
    assert "host_syncs" not in out.metrics  # a CPU row: nothing to count
    import json

    assert json.loads(out.extra)["samples_ms"] == [1.0, 1.1, 0.9]  # every timed iteration
    assert Step().extra_bounds() == {} and not Step().has_bounds() and FakeStep().has_bounds()
