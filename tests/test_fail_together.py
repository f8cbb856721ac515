"""Issue 56, item 2: ranks fail together. W = 3 processes; rank 2 fails in its 2nd cell of 4 in
one of four ways (an exception in setup, an exception mid-step, a wrong result: its check fails
there only, a wait that never completes) or leaves its peers in a collective of the system.
Each time the cell ends on every rank within the cell time-out + 10 s with one row naming rank 2
and the cause, and the next cells run, ok. The faults: tests/faulty_experiment.py (the fake
system `faulty`). The pieces: harness.measure.stage / settle (the agreement that ends every
stage), harness.timing.time_fn (a failed rank stays in its collectives), harness.supervisor
(names a stuck rank, or a failed one its peers could not end the cell with).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from harness.measure import expand_grid
from harness.records import read_table
from tests.cli import FAULTY
from tests.inprocess import compose_run, launch

TIMEOUT_S = 5
COMMON = (
    "progress=false",
    "hardware.world_size=3",
    FAULTY,
    "+experiment.systems.faulty={}",
    "experiment.select=[faulty]",
    f"hardware.timeout_s={TIMEOUT_S}",
)
#: fault -> (status of the failing cell, its reason's start, hardware.restarts)
CASES = {
    "setup": ("error", "rank 2: setup: RuntimeError: injected fault in setup", 0),
    "step": ("error", "rank 2: timed loop 1: RuntimeError: injected fault mid-step", 0),
    "wrong": ("fail", "rank 2: first check: rel err", 0),
    # stuck for good: the parent ends the cell at its time-out naming the rank its peers
    # waited for, and fresh ranks run the rest
    "hang": ("error", f"crashed: rank 2 made no progress for {TIMEOUT_S} s", 1),
    # its peers wait in the system's own collective, which it left out
    "orphan": ("error", "crashed: rank 2 failed in cell", 1),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_one_failing_rank_ends_the_cell_on_every_rank_and_the_sweep_goes_on(
    kind, tmp_path, monkeypatch, capfd
):
    import harness.run as hr

    status, reason, restarts = CASES[kind]
    table = tmp_path / "t.parquet"
    monkeypatch.setenv("HARNESS_TEST_FAULT", f"{kind}:2:1")
    monkeypatch.setenv("HARNESS_TEST_FAULT_ONCE", str(tmp_path))  # fresh ranks run clean
    crashed: list[float] = []
    record = hr.record_crash

    def timed_crash(cfg, cell, why):
        crashed.append(time.time())
        record(cfg, cell, why)

    monkeypatch.setattr(hr, "record_crash", timed_crash)
    t0 = time.time()
    code = launch(f"table={table}", *COMMON, f"hardware.restarts={restarts}")
    took = time.time() - t0
    said = capfd.readouterr()
    assert code == (1 if status == "error" else 0), said.out + said.err
    cells = expand_grid(compose_run(f"table={table}", *COMMON)[0], 3)
    df = read_table(table).set_index("cell_hash")
    rows = [df.loc[c["cell_hash"]] for c in cells]
    assert len(df) == 4 and [r.status for r in rows] == ["ok", status, "ok", "ok"], df.reason
    assert rows[1].reason.startswith(reason), rows[1].reason
    assert "rank 2" in rows[1].reason and "rank 0" not in rows[1].reason.split(";")[0]
    assert (rows[1].latency_ms != rows[1].latency_ms) and rows[2].latency_ms > 0
    # the failing cell's time: from its start (a crashed cell: the start of the cell before)
    # to the next cell's start (a crashed cell: to its row, written once the ranks are killed)
    if crashed:
        (end,) = crashed
        cell_s = end - rows[0].timestamp
        assert cell_s > TIMEOUT_S - 1, cell_s  # the time-out ended it, nothing else
    else:
        cell_s = rows[2].timestamp - rows[1].timestamp
    assert cell_s < TIMEOUT_S + 10, f"the failing cell took {cell_s:.1f} s"
    print(f"\n[fail-together] {kind}: failing cell {cell_s:.2f} s, whole run {took:.1f} s")


def test_a_rank_whose_step_raises_stays_in_the_timing_collectives(monkeypatch):
    """time_fn: where fn raises, the rank takes part in every barrier left, then raises."""
    import harness.timing as ht

    barriers, calls = [], []
    monkeypatch.setattr(ht, "barrier", lambda group, device: barriers.append(1))

    def fn():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ht.time_fn(fn, device=torch.device("cpu"), warmup=1, iters=4)
    assert len(calls) == 2 and len(barriers) == 1 + 4  # after the warm-up, then per iteration


def test_a_broken_process_group_is_raised_at_once(monkeypatch):
    import harness.timing as ht

    barriers = []
    monkeypatch.setattr(ht, "barrier", lambda group, device: barriers.append(1))

    def fn():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="Connection closed"):
        ht.time_fn(fn, device=torch.device("cpu"), warmup=0, iters=4)
    assert len(barriers) == 2  # the one after the warm-up, the first iteration's


def _rank(phase="cell", stage="timed loop 1", waiting=False, unsettled=None):
    proc = SimpleNamespace(exitcode=None, pid=0)
    return SimpleNamespace(
        proc=proc, phase=phase, cell=0, beat=100.0, failure=None, stage=stage,
        waiting=waiting, unsettled=unsettled,
    )  # fmt: skip


def test_the_parent_names_the_stuck_rank_its_peers_waited_for():
    from harness.supervisor import _diagnose

    cells = [{"cell_hash": "abc", "system": "faulty"}]
    ranks = [_rank(waiting=True), _rank(waiting=True), _rank()]
    why = _diagnose(ranks, cells, 5.0, 100.5)
    assert why.startswith("rank 2 made no progress for 5 s (hardware.timeout_s) in cell abc")
    assert "in timed loop 1; rank(s) 0, 1 waited for it" in why
    # a failure not agreed on comes first: its peers are left in the system's collective
    ranks = [_rank(), _rank(), _rank(waiting=True, unsettled="setup: RuntimeError: x")]
    why = _diagnose(ranks, cells, 5.0, 100.5)
    assert why.startswith("rank 2 failed in cell abc") and "setup: RuntimeError: x" in why
    # every rank waiting, or none: nobody to blame
    for w in (True, False):
        why = _diagnose([_rank(waiting=w) for _ in range(3)], cells, 5.0, 100.5)
        assert why.startswith("rank(s) 0, 1, 2 made no progress"), why


def test_one_process_keeps_its_reasons_without_a_rank():
    """W = 1 (no process group): a stage's failure is the row's, as before, with no prefix."""
    from harness import measure
    from harness.records import Row
    from harness.system import RunContext

    ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"))
    row = Row(experiment="e", system="s", cell_hash="h")

    def fail():
        raise ValueError("bad")

    assert measure.stage(ctx, row, "setup", fail) is None
    assert row.status == "error" and row.reason == "ValueError: bad"
    ok = Row(experiment="e", system="s", cell_hash="h")
    assert measure.stage(ctx, ok, "host syncs", lambda: [3.0], n=1) == [3.0]
