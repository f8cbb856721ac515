"""The band observer (systems/overlap/kernels/observer.py) sees every band the producer signals,
at a time inside the producer's run, and reports a band never signalled as 0 (GPU only)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from benchmarks.band_times import measure_rank  # noqa: E402
from benchmarks.token_ready import rank_plans, uniform_band_times  # noqa: E402
from harness.workload import WorkloadSpec  # noqa: E402
from systems.overlap.kernels.observer import launch_observer  # noqa: E402


def test_observer_records_each_band_once_it_reaches_its_target():
    spec = WorkloadSpec(
        tokens_per_rank=2048,
        hidden=2048,
        out=1024,
        experts_per_rank=4,
        top_k=2,
        world_size=2,
        routing="balanced",
        dtype="bfloat16",
    )
    _, plan = rank_plans(spec, 128, "compact")[0]
    times, span_ms, missed, start = measure_rank(plan, 1024, "expert", reps=2)
    assert missed == 0 and span_ms > 0 and start <= 0, (missed, span_ms, start)
    assert times.shape == (plan.n_bands,) and ((times > 0) & (times <= 1)).all()
    # the last band ends the producer's span in every run (medians per band: near 1)
    assert times.max() > 0.9, times
    # the band visited first is done no later than the band visited last
    model = uniform_band_times(plan, "expert")
    assert times[model.argmin()] <= times[model.argmax()], (times, model)


def test_a_band_never_signalled_times_out_as_zero():
    ready = torch.zeros(3, dtype=torch.int32, device="cuda")
    ready[1] = 5
    times = launch_observer(ready, 5, timeout_ns=2_000_000)  # 2 ms
    t = times.cpu()
    assert t[0] == 0 and t[2] == 0 and t[1] > 0 and t[3] > 0  # t[3]: the observer's start
