"""dispatch_overlap's kernels (systems/overlap/dispatch_overlap.py, kernels/copy_fc1.py): the
copied input and fc1 + GELU against torch on the full grid and on one program, the arrival
order against the plan's visiting order (the host plan's schedule), the band counters' values,
and an arrival that never comes as an error naming source and expert. On the CPU through Triton's
interpreter in a fresh process (tests/interpreted.py); the gpu-marked twin runs them compiled."""

from __future__ import annotations

import os

import pytest
import torch

from tests.interpreted import run_interpreted

#: the checks, as one script: run in the interpreter (CPU) or compiled (GPU)
CHECKS = r"""
import torch
from systems.overlap.dispatch_overlap import DispatchOverlap
from systems.overlap.errors import OverlapTimeoutError
from systems.overlap.kernels.copy_fc1 import WAITING_TILES
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
    chunks = -(-K // ov.chunk)
    assert chunks > 1  # a band lands in several items
    for programs in (ov.programs, 1):
        ov.programs = programs
        ov.h.fill_(float("nan"))
        ov.x_pad.fill_(float("nan"))
        ov.run(src, rows, plan)
        ov.check()
        x_ref = padded_input(src[rows], plan.gather_index)
        m = band_mask(plan)
        assert torch.equal(ov.x_pad[m], x_ref[m]), order
        want = torch.nn.functional.gelu(reference_y(plan, x_ref, w1))
        err = ((ov.h[m].float() - want[m]).norm() / want[m].norm()).item()
        assert err < {tol}, (order, programs, err)
        B = int(plan.n_bands)
        assert ov.sync[:B].tolist() == [chunks] * B  # every chunk of every band, once
        places = ov.places(plan)[:B].cpu()
        assert sorted(places.tolist()) == list(range(1, B + 1)), places  # every band once
    # one program: the bands landed exactly in fc1's visiting order of the schedule
    visit = torch.arange(B) if plan.visit is None else plan.visit.cpu()
    landed = places[plan.schedule.cpu()[visit]]
    assert landed.tolist() == list(range(1, B + 1)), (order, landed)

# an arrival that never comes (fc1's tiles without the copies): the first tile times out,
# naming source and expert
plan, src, rows, w1 = problem("remote_first")
ov = DispatchOverlap(w1, plan, rank=2)
ov.wait["timeout_ns"] = 50_000_000
ov.sync.zero_()
ov._launch(src, rows, plan, WAITING_TILES)
try:
    ov.check()
    raise SystemExit("no time-out")
except OverlapTimeoutError as exc:
    rec = exc.record
    assert rec.rank == 2 and rec.seen == 0 and rec.want == chunks, rec
    assert rec.band == int(plan.schedule[0]), rec  # the visiting order's first band
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
    script = CHECKS.format(dev="cuda", dtype="bfloat16", tile=64, K=512, F=512, tol=1e-2)
    exec(compile(script, "dispatch_overlap_checks", "exec"), {})


def _functional(tmp_path, world: int, *extra: str):
    """The overlap layer in the interpreter on one tiny loopback cell per dispatch_overlap."""
    import subprocess
    import sys

    import pandas as pd

    from tests.interpreted import ROOT

    table = tmp_path / f"w{world}.parquet"
    env = {**os.environ, "TRITON_INTERPRET": "1", "HARNESS_FUNCTIONAL": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "experiment=overlap_functional", "hardware=cpu",
         f"table={table}", "experiment.grid.routing=[stress_skew]",
         f"experiment.grid.world_size=[{world}]", "experiment.grid.ffn=[64]",
         "experiment.grid.out=[32]", "hardware.timeout_s=120", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return pd.read_parquet(table)


def test_the_layer_with_dispatch_overlap_on_matches_the_reference(tmp_path):
    """W=2 loopback, the whole layer with the copy behind fc1, checked (off is every other
    layer test's setting)."""
    pytest.importorskip("triton")
    df = _functional(tmp_path, 2, "+experiment.systems.overlap.params.dispatch_overlap=on")
    assert (df["status"] == "ok").all(), df[["p_dispatch_overlap", "status", "reason"]]
    assert list(df["p_dispatch_overlap_used"]) == ["on"]
    assert (df["max_rel_err"] < df["tol"]).all()
    assert "m_dispatch_fc1_ms" not in df  # the bounds are timed on a GPU only


def test_dispatch_overlap_runs_off_where_nothing_is_dispatched_and_says_why():
    """W=1, the operator scope and the NCCL dispatch run off, each with its reason (the row's
    extra["dispatch_overlap_off"]); off asked needs no reason."""
    from harness.workload import WorkloadSpec
    from systems.overlap.params import OverlapParams

    on, off = OverlapParams(dispatch_overlap="on"), OverlapParams()

    def spec(world):
        return WorkloadSpec(8, 16, 16, 2, 1, world_size=world, routing="balanced")

    assert on.dispatch_overlap_off(spec(1), "device") == "W=1: no rows travel between ranks"
    assert "operator scope" in on.dispatch_overlap_off(spec(2), None)
    assert "dispatch=nccl" in on.dispatch_overlap_off(spec(2), "nccl")
    assert on.dispatch_overlap_off(spec(2), "device") is None
    assert off.dispatch_overlap_off(spec(1), "device") is None


def test_a_bad_dispatch_overlap_is_one_line_before_any_gpu_work():
    from harness.workload import WorkloadSpec
    from systems.overlap.params import OverlapParams

    spec = WorkloadSpec(8, 16, 16, 2, 1, world_size=2, routing="balanced", dtype="bfloat16")
    with pytest.raises(ValueError, match="dispatch_overlap must be one of off, on, got 'yes'"):
        OverlapParams(dispatch_overlap="yes").validate(spec, 132)


def test_the_figure_draws_the_phase_against_its_bounds_and_on_over_off(tmp_path):
    import pandas as pd

    from plots import dispatch_overlap as fig

    rows = []
    for W in (2, 4):
        for on in ("off", "on"):
            rows.append(dict(
                system="overlap", status="ok", world_size=W, hidden=768, out=768,
                experts_per_rank=16, routing="balanced", p_layout="aligned",
                p_dispatch_overlap_used=on, latency_ms=2.0 if on == "off" else 1.5,
                m_dispatch_alone_ms=0.1, m_fc1_alone_ms=0.4,
                m_dispatch_fc1_ms=0.5 if on == "off" else 0.42, m_dispatch_hidden=0.8,
                transport="loopback", tol=8e-3, max_rel_err=1e-3, max_row_rel_err=1e-3,
            ))  # fmt: skip
    table = tmp_path / "dispatch_overlap.parquet"
    pd.DataFrame(rows).to_parquet(table)
    rel = fig.on_over_off(fig._with_lines(pd.DataFrame(rows)))
    assert list(rel["value"]) == [0.75, 0.75] and list(rel["line"]) == ["aligned H=768"] * 2
    paths = fig.plot(table, tmp_path / "f", "do")
    assert all(p.exists() for p in paths)


def test_the_experiment_sweeps_both_settings_and_layouts_at_w_2_4_8():
    from hydra import compose, initialize_config_dir

    from harness.config import register_configs
    from harness.measure import expand_grid
    from tests.interpreted import ROOT

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=dispatch_overlap"])
    cells = expand_grid(cfg, 1)
    assert len(cells) == 3 * 2 * 3 * 2 * 2  # W x E x routing x layout x setting
    assert {c["params"]["dispatch_overlap"] for c in cells} == {"off", "on"}
    assert {c["world_size"] for c in cells} == {2, 4, 8}
    assert len({c["cell_hash"] for c in cells}) == len(cells)
