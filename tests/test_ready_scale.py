"""The ready scale prototype (systems/overlap/kernels/ready_scale.py, ready_order.py).

On the CPU: its tables (every receive row of a W=1 plan has exactly one band, the tokens come
sorted by their latest band's time, a peer's row and an aligned plan are refused), and in
Triton's interpreter (a fresh process; T=90, so the last tile is partial) after the real
producer stored every row at local=direct with every band signalled: the ready scale equals the
harness's Scaler, and a band left unsignalled ends in the scale's time-out record, raised on
the host. Its timing is benchmarks/ready_scale.py's.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.token_ready import rank_plans, uniform_band_times
from harness.workload import WorkloadSpec
from systems.overlap.plan import local_row_map
from systems.overlap.ready_order import band_of_recv_rows, ready_order
from tests.interpreted import run_interpreted


def _spec(world: int) -> WorkloadSpec:
    return WorkloadSpec(
        tokens_per_rank=96,
        hidden=8,
        out=24,
        experts_per_rank=3,
        top_k=2,
        world_size=world,
        routing="moderate_skew",
        dtype="float32",
    )


def test_tables_cover_every_row_at_one_rank_and_sort_by_the_latest_band():
    ((lay, plan),) = rank_plans(_spec(1), 16, "compact")
    n_recv = lay.send_pos.numel()
    band = band_of_recv_rows(plan, local_row_map(plan), n_recv)
    assert bool((band >= 0).all()) and int(band.max()) < plan.n_bands
    counts = torch.bincount(band, minlength=plan.n_bands)
    assert torch.equal(counts, plan.band_valid[: plan.n_bands].long())
    times = uniform_band_times(plan, "expert")
    tok, pos, b, gate = ready_order(lay.send_pos, lay.gate, band, times)
    assert torch.equal(torch.sort(tok).values, torch.arange(lay.send_pos.shape[0]))
    assert torch.equal(pos, lay.send_pos[tok]) and torch.equal(gate, lay.gate[tok])
    latest = times[b].amax(1)
    assert bool((latest[1:] >= latest[:-1]).all())


def test_tables_refuse_a_peers_row():
    lay, plan = rank_plans(_spec(2), 16, "compact")[0]
    band = band_of_recv_rows(plan, local_row_map(plan), lay.send_pos.numel())
    assert bool((band < 0).any())  # rows the peer's producer writes
    with pytest.raises(ValueError, match="has no band of this plan"):
        ready_order(lay.send_pos, lay.gate, band, uniform_band_times(plan, "expert"))


def test_tables_refuse_a_plan_whose_signalled_rows_stay_in_y():
    ((lay, plan),) = rank_plans(_spec(1), 16, "aligned")
    with pytest.raises(ValueError, match="compact plan"):
        band_of_recv_rows(plan, local_row_map(plan), lay.send_pos.numel())


_SCRIPT = r"""
import torch
from benchmarks.token_ready import rank_plans, uniform_band_times
from harness.scale import Scaler
from harness.workload import WorkloadSpec
from systems.overlap.errors import OverlapTimeoutError, new_error_buffer, raise_if_error
from systems.overlap.kernels import interpreter_config, launch_producer
from systems.overlap.kernels.ready_scale import launch_ready_scale
from systems.overlap.plan import local_row_map, padded_input, producer_order
from systems.overlap.ready_order import band_of_recv_rows, ready_order

spec = WorkloadSpec(tokens_per_rank=90, hidden=8, out=24, experts_per_rank=3, top_k=2,
                    world_size=1, routing="moderate_skew", dtype="float32")
(lay, plan), = rank_plans(spec, 16, "compact")
g = torch.Generator().manual_seed(0)
K, N = 40, 24
x_recv = torch.randn(plan.n_rows, K, generator=g)
w = torch.randn(3, K, N, generator=g) / K**0.5
x = padded_input(x_recv, plan.gather_index)
y = torch.zeros(plan.n_padded, N)
recv = torch.full((lay.send_pos.numel(), N), float("nan"))
row_dst = local_row_map(plan)
ready = torch.zeros(plan.n_bands, dtype=torch.int32)
cfg = interpreter_config(16)
visit = producer_order(plan)
launch_producer(x, w, y, plan, ready, n_signal=plan.n_bands, num_programs=3, config=cfg,
                local_to=(recv, row_dst), order=visit)
target = cfg.band_increment(N)
assert bool((ready == target).all()), ready
assert not bool(recv.isnan().any())
band = band_of_recv_rows(plan, row_dst, recv.shape[0])
tok, pos, b, gate = ready_order(lay.send_pos, lay.gate, band, uniform_band_times(plan, "expert"))
want = Scaler.for_layout(lay, torch.device("cpu"))(recv)
for programs, bt, bn in ((3, 4, 16), (1, 2, 32), (7, 1, 16), (2, 8, 16)):
    err = new_error_buffer("cpu")
    out = torch.full_like(want, float("nan"))
    launch_ready_scale(recv, tok, pos, b, gate, out, ready, err, target, programs=programs,
                       block_t=bt, block_n=bn)
    raise_if_error(err)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
# claimed tiles: a counter already at 5 (five tiles another launch took) leaves them alone,
# and this launch scales every later tile once
for programs in (1, 3):
    err = new_error_buffer("cpu")
    out = torch.full_like(want, float("nan"))
    claim = torch.full((1,), 5, dtype=torch.int32)
    launch_ready_scale(recv, tok, pos, b, gate, out, ready, err, target, programs=programs,
                       block_t=4, block_n=16, claim=claim)
    raise_if_error(err)
    taken = tok[: 5 * 4]
    assert bool(out[taken].isnan().all())
    rest = torch.ones(out.shape[0], dtype=torch.bool)
    rest[taken] = False
    torch.testing.assert_close(out[rest], want[rest], rtol=1e-5, atol=1e-5)
    assert int(claim) == 23 + programs, claim  # ceil(90 / 4) tiles, one failed claim a program
bad = int(b[-1, 0])
ready[bad] -= 1  # the last tile's band never finishes
err = new_error_buffer("cpu")
out = torch.zeros_like(want)
launch_ready_scale(recv, tok, pos, b, gate, out, ready, err, target, programs=2, max_spins=50)
try:
    raise_if_error(err)
except OverlapTimeoutError as exc:
    assert "ready scale's band wait" in str(exc) and "token tile" in str(exc), exc
    assert exc.record.band == bad and exc.record.want == target, exc.record
    assert exc.record.seen == target - 1, exc.record
    print("ok")
"""


def test_ready_scale_in_the_interpreter_equals_the_scale_claims_and_times_out():
    assert run_interpreted(_SCRIPT, timeout=300).strip().endswith("ok")
