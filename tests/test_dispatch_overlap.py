"""dispatch_overlap's kernels (systems/overlap/dispatch_overlap.py, kernels/put.py, the
producer's waiting mode): the copied input and fc1 + GELU against torch, the arrival order
against the plan's visiting order (the host plan's schedule), the band counters' values, and an
arrival that never comes as an error naming source and expert. On the CPU through Triton's
interpreter in a fresh process (tests/interpreted.py); the gpu-marked twin runs them compiled."""

from __future__ import annotations

import pytest
import torch

from tests.interpreted import run_interpreted

#: the checks, as one script: run in the interpreter (CPU) or compiled (GPU)
CHECKS = r"""
import torch
from systems.overlap.dispatch_overlap import DispatchOverlap
from systems.overlap.errors import OverlapTimeoutError
from systems.overlap.kernels.put import launch_put_bands
from systems.overlap.plan import padded_input
from tests.overlap_testing import reference_y, synthetic_plan

DEV, DT, TILE, K, F = {dev!r}, getattr(torch, {dtype!r}), {tile}, {K}, {F}
ROWS = [[40, 26, 14], [0, 60, 18], [13, 0, 5]]  # rows[e][s], this rank = 2
g = torch.Generator().manual_seed(0)

def problem(order):
    plan = synthetic_plan(ROWS, rank=2, tile_m=TILE, mgb=2, device=DEV, order=order)
    src = torch.randint(-3, 4, (97, K), generator=g).to(DEV, DT)
    rows = torch.randint(0, 97, (int(plan.n_rows),), generator=g).to(DEV)
    w1 = (torch.randint(-2, 3, (3, K, F), generator=g) / 4).to(DEV, DT)
    return plan, src, rows, w1

def band_mask(plan):
    m = torch.zeros(plan.gather_index.numel(), dtype=torch.bool)
    for r0, n in zip(plan.band_row.tolist(), plan.band_rows.tolist()):
        m[r0 : r0 + n] = True
    return m.to(DEV)

for order in ("remote_first", "expert"):
    plan, src, rows, w1 = problem(order)
    ov = DispatchOverlap(w1, plan, rank=2)
    h = ov.run(src, rows, plan)
    ov.check()
    x_ref = padded_input(src[rows], plan.gather_index)
    m = band_mask(plan)
    assert torch.equal(ov.x_pad[m], x_ref[m]), order
    want = torch.nn.functional.gelu(reference_y(plan, x_ref, w1))
    err = ((h[m].float() - want[m]).norm() / want[m].norm()).item()
    assert err < {tol}, (order, err)
    B = int(plan.n_bands)
    got = ov.arrived[:B].cpu()
    assert sorted(got.tolist()) == list(range(1, B + 1)), got  # every band once
    assert int(ov.arrived[B]) == B  # the ticket
    # one program: the bands land exactly in fc1's visiting order of the schedule
    visit = torch.arange(B) if plan.visit is None else plan.visit.cpu()
    ov.arrived.zero_()
    launch_put_bands(src, rows, ov.x_pad, plan, ov.arrived, num_programs=1)
    landed = ov.arrived[plan.schedule.cpu()[visit]].cpu()
    assert landed.tolist() == list(range(1, B + 1)), (order, landed)

# an arrival that never comes: fc1's first wait times out, naming source and expert
plan, src, rows, w1 = problem("remote_first")
ov = DispatchOverlap(w1, plan, rank=2)
ov.wait = type(ov.wait)(ov.arrived, ov.err, ov.wait.clock, 2, timeout_ns=50_000_000,
                        max_spins=50, use_timer=ov.wait.use_timer)
ov.arrived.zero_()
ov._fc1(plan, True, ov.programs)
try:
    ov.check()
    raise SystemExit("no time-out")
except OverlapTimeoutError as exc:
    rec = exc.record
    assert rec.rank == 2 and rec.seen == 0 and rec.want == 1, rec
    assert rec.source == int(plan.band_dst[rec.band]), rec
    assert rec.segment == int(plan.band_expert[rec.band]), rec
    assert "source rank" in str(exc) and "never arrived" in str(exc), str(exc)
print("ok")
"""


def test_dispatch_overlap_kernels_in_the_interpreter():
    script = CHECKS.format(dev="cpu", dtype="float32", tile=16, K=16, F=32, tol=1e-5)
    assert run_interpreted(script, timeout=300).strip().endswith("ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dispatch_overlap_kernels_compiled():
    script = CHECKS.format(dev="cuda", dtype="bfloat16", tile=64, K=256, F=512, tol=1e-2)
    exec(compile(script, "dispatch_overlap_checks", "exec"), {})
