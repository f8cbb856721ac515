"""deepep's Buffer, once per run (issue 56, item 3): validate() plans the run's worst case per
world size before any rank starts, the ranks (spawned: they inherit the plan) make ONE Buffer at
that size at their first deepep cell, a cell's memory bound counts the run's Buffer, and the
Buffer is destroyed at the run's end, before the process group (harness.teardown, called by
harness.rank.worker). With tests/test_deepep.py's stand-in deep_ep."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness import rank, teardown
from harness.config import register_configs
from harness.measure import expand_grid, spec_of
from harness.workload import WorkloadSpec
from systems import deepep
from systems.deepep import (
    PLAN_ENV,
    DeepEPSystem,
    cell_needs,
    ll_rdma_bytes,
    plan_cell,
    planned,
)
from tests import test_deepep
from tests.test_deepep import _deepep, _FakeBuffer, _spec

fake_deep_ep, h200 = test_deepep.fake_deep_ep, test_deepep.h200  # its fixtures

ROOT = Path(__file__).resolve().parents[1]
SMALL = _spec(tokens_per_rank=40, hidden=32, ffn=48, experts_per_rank=4, dtype="float32")
BIG = WorkloadSpec(**{**SMALL.__dict__, "tokens_per_rank": 600, "experts_per_rank": 6})


@pytest.fixture
def no_plan(monkeypatch):
    monkeypatch.setenv(PLAN_ENV, "")  # and the plan a test makes is gone after it


def _validate(*specs: WorkloadSpec) -> None:
    for spec in specs:
        DeepEPSystem.validate(spec, {}, 132)


def test_validate_plans_the_largest_cell_per_world_size(h200, no_plan):
    w2 = _spec(world_size=2, tokens_per_rank=128, experts_per_rank=8)
    too_big = _spec(tokens_per_rank=16384, hidden=8192, experts_per_rank=128)  # > the GPU
    _validate(_spec(tokens_per_rank=64), _spec(tokens_per_rank=256, experts_per_rank=4), w2)
    _validate(_spec(hidden=768), _spec(ffn=0), too_big)  # skipped cells plan nothing
    assert planned(1) == (ll_rdma_bytes(256, 4096, 1, 4), 16, 2 * 257)
    assert planned(2) == cell_needs(w2) and planned(4) == (0, 0, 0)


def test_a_plan_of_another_process_is_not_read(monkeypatch):
    foreign = {"pid": os.getpid() + 99991, "sizes": {"1": [10, 2, 3]}}
    monkeypatch.setenv(PLAN_ENV, json.dumps(foreign))
    assert planned(1) == (0, 0, 0)
    plan_cell(SMALL)  # this process's run starts a plan of its own
    assert planned(1) == cell_needs(SMALL)
    parent = {"pid": os.getppid(), "sizes": {"1": [10, 2, 3]}}  # a spawned rank's parent
    monkeypatch.setenv(PLAN_ENV, json.dumps(parent))
    assert planned(1) == (10, 2, 3)
    monkeypatch.setenv(PLAN_ENV, "not json")
    assert planned(1) == (0, 0, 0)


def _planned_in_child(q) -> None:
    from systems.deepep import planned

    q.put(planned(2))


def test_the_ranks_a_run_spawns_inherit_its_plan(h200, no_plan):
    """The layer experiment's cells at W=2 through the experiment's own validate (what
    harness.preflight calls), then a spawned process (as harness.supervisor starts ranks)."""
    from experiments import systems_sweep

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=layer", "experiment.select=[deepep]"])
    cells = expand_grid(cfg, 2)
    systems_sweep.validate(cfg, cells, 132)
    fit = [spec_of(c) for c in cells if DeepEPSystem.unsupported(spec_of(c), {}) is None]
    assert fit and len(fit) < len(cells)  # the largest cells exceed the GPU alone
    assert planned(2) == tuple(max(cell_needs(s)[i] for s in fit) for i in range(3))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_planned_in_child, args=(q,))
    child.start()
    got = q.get(timeout=60)
    child.join(60)
    assert got == planned(2)


def test_one_buffer_per_run_at_the_planned_size(fake_deep_ep):
    plan_cell(SMALL)  # what validate() does for a cell the kernels take (float32 here: the
    plan_cell(BIG)  # stand-in computes on the CPU, which has no bf16 grouped GEMM)
    first = _deepep(SMALL)
    buffer = first.step.buffer
    assert buffer.num_rdma_bytes == ll_rdma_bytes(600, 32, 1, 6) and buffer.qps == 6
    assert buffer.nvshmem_qp_depth == 2 * 601  # deep_ep/buffer.py:602, for the largest cell
    assert first.extra["rdma_bytes"] == buffer.num_rdma_bytes
    assert first.extra["rdma_bytes_cell"] == ll_rdma_bytes(40, 32, 1, 4)
    assert _deepep(BIG).step.buffer is buffer and _deepep(SMALL).step.buffer is buffer
    assert len(_FakeBuffer.made) == 1 and not buffer.destroyed  # never grown, never re-made


def test_the_buffer_is_destroyed_at_the_runs_end_once(fake_deep_ep, monkeypatch):
    calls = []
    monkeypatch.setattr(_FakeBuffer, "destroy", lambda self: calls.append(self), raising=False)
    buffer = _deepep(SMALL).step.buffer
    _deepep(SMALL)
    assert teardown.run_end() == [] and calls == [buffer]
    assert deepep._Held.buffer is None
    assert teardown.run_end() == [] and calls == [buffer]  # nothing left to release
    assert _deepep(SMALL).step.buffer is not buffer  # a later run makes its own


def test_a_cell_that_fits_alone_but_not_beside_the_runs_buffer_is_skipped(h200, monkeypatch):
    spec = _spec(tokens_per_rank=4096, experts_per_rank=16)
    assert DeepEPSystem.unsupported(spec, {}) is None
    sizes = {"1": [140 * 2**30, 16, 8194]}  # with the cell's 1.7 GiB: over the 141 GiB
    monkeypatch.setenv(PLAN_ENV, json.dumps({"pid": os.getpid(), "sizes": sizes}))
    reason = DeepEPSystem.unsupported(spec, {})
    assert reason is not None and "the run's RDMA buffer 140.0 GiB" in reason, reason


def test_run_end_reports_a_failing_release_and_runs_the_others(capsys):
    done = []

    def bad():
        raise RuntimeError("barrier timed out")

    teardown.at_run_end(lambda: done.append(1))
    teardown.at_run_end(bad)
    teardown.at_run_end(bad)  # registered once
    failed = teardown.run_end()
    assert done == [1] and len(failed) == 1 and "barrier timed out" in failed[0]
    assert "barrier timed out" in capsys.readouterr().err


def test_a_rank_releases_before_its_process_group_ends():
    """harness.rank.worker: its cells, `done`, the systems' releases (harness.teardown.run_end),
    and only then the end of the process group (read from its source: the worker's other steps
    belong to the failure handling)."""
    import inspect

    src = inspect.getsource(rank.worker)
    steps = ("_walk(", "report.done()", "run_end()", "dist.destroy_process_group()")
    at = [src.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), dict(zip(steps, at))
