"""Issue 10, findings 1 and 6: a rank that dies, stops, fails or is left behind. The run ends
within the time-out naming the rank and the cell, records nothing broken, resumes, kills its
ranks when it is stopped itself, and with restarts goes on with fresh ranks; a rank's failure is
printed once, from its root cause, and error rows make the exit code nonzero.

Faults are injected by tests/faulty_experiment.py (HARNESS_TEST_FAULT=<kind>:<rank>:<n>), which
runs the smoke cells and makes one rank kill, stop or damage the table at its n-th cell.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.measure import expand_grid
from harness.records import (
    KEEP_STATUSES,
    KEEP_STATUSES_REDO_FAILED,
    ResultsTable,
    Row,
    read_table,
)
from tests.cli import FAULTY, ROOT, alive, children, cmdline, error_lines, out, run
from tests.inprocess import compose_run, launch

STATUSES = ("ok", "fail", "skipped", "error")


def done_hashes(table: ResultsTable, redo_failed: bool = False) -> set[str]:
    """Cells a re-run skips (harness.preflight's rule): `error` cells are always measured again."""
    keep = KEEP_STATUSES_REDO_FAILED if redo_failed else KEEP_STATUSES
    return {h for h, s in table.statuses().items() if s in keep}


def _cells(table, world: int) -> list[dict]:
    return expand_grid(compose_run(f"table={table}", f"hardware.world_size={world}")[0], world)


def _in_process(*overrides: str, capfd=None) -> subprocess.CompletedProcess:
    """tests.inprocess.launch of a run whose table is checked, not its command line: its exit
    code and what it said (the ranks' output too where capfd is given) as `run` gives them."""
    if capfd is None:  # a module fixture has no capfd: the parent's own lines
        with contextlib.redirect_stdout(io.StringIO()) as said:
            code = launch("progress=false", *overrides)
        return subprocess.CompletedProcess(overrides, code, said.getvalue(), "")
    capfd.readouterr()
    code = launch("progress=false", *overrides)
    said = capfd.readouterr()
    return subprocess.CompletedProcess(overrides, code, said.out, said.err)


# ---- 1. a stalled or dead rank ends the run within the time-out; nothing broken is recorded


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory):
    """Three runs (W=2) on one table: rank 1 killed at its 2nd cell; a re-run (it resumes) in
    which rank 1 stops itself at its 2nd cell; a plain re-run. The smoke cells, and per run its
    process, its time and the table after it. The plain re-run is in-process (it checks the
    resume, not the command line)."""
    table = tmp_path_factory.mktemp("stopped") / "t.parquet"
    common = (f"table={table}", "hardware.world_size=2", FAULTY, "hardware.timeout_s=3")
    runs = []
    for fault in ("kill:1:1", "stop:1:1", None):
        t0 = time.monotonic()
        if fault:
            proc = run(*common, env={"HARNESS_TEST_FAULT": fault})
        else:
            assert "HARNESS_TEST_FAULT" not in os.environ
            proc = _in_process(*common)
        runs.append((proc, time.monotonic() - t0, read_table(table)))
    return _cells(table, 2), runs


def _assert_stopped(run_: tuple, expect: str, cell: dict, done: list[dict], bound_s: float):
    """The run ended with exit code 1 within bound_s, one line naming `expect` and the cell in
    flight, which is not recorded: the table holds the `done` cells only, all ok."""
    proc, took, df = run_
    assert proc.returncode == 1, out(proc)
    assert took < bound_s, f"took {took:.1f} s: {out(proc)}"
    (line,) = error_lines(proc)  # one message
    assert expect in line and f"in cell {cell['cell_hash']}" in line, line
    assert "Traceback" not in out(proc)
    assert list(df["cell_hash"]) == [c["cell_hash"] for c in done]
    assert set(df["status"]) == {"ok"}


def _assert_resumed(cells: list[dict], run_: tuple, found: int) -> None:
    proc, _, df = run_
    assert proc.returncode == 0, out(proc)
    assert f"{found} already in" in proc.stdout and f"{4 - found} to run" in proc.stdout
    assert sorted(df["cell_hash"]) == sorted(c["cell_hash"] for c in cells)  # no dup, no loss
    assert set(df["status"]) == {"ok"}


def test_1_killed_rank_ends_the_run_naming_rank_and_cell(stopped_runs):
    cells, (killed, resumed, last) = stopped_runs
    _assert_stopped(killed, "rank 1 died (killed by SIGKILL)", cells[1], cells[:1], 30)
    assert "1 already in" in resumed[0].stdout and "3 to run" in resumed[0].stdout
    assert resumed[2]["cell_hash"].iloc[1] == cells[1]["cell_hash"]  # the lost cell ran again
    _assert_resumed(cells, last, 2)


def test_1_stopped_rank_ends_the_run_within_the_timeout(stopped_runs):
    # SIGSTOP: the rank is alive but silent; its peer blocks in a collective. The bound is the
    # 3 s time-out plus start-up, far below the 10-minute process-group default of old.
    cells, (_, stopped, again) = stopped_runs
    _assert_stopped(stopped, "rank 1 stopped responding", cells[2], cells[:2], 30)
    _assert_resumed(cells, again, 2)


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
def test_1_sigterm_ends_the_run_and_kills_its_ranks(tmp_path):
    # a `timeout` around a run sends SIGTERM to the parent only: its ranks must not outlive it
    # (a rank left holding a GPU would hang the next run). Rank 1 stops itself in its first
    # cell, so the run is certainly in flight when the signal comes.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HARNESS_TEST_FAULT": "stop:1:0"}
    cmd = [sys.executable, "-m", "harness.run", "progress=false", f"table={tmp_path / 't.parquet'}"]
    cmd += ["hardware.world_size=2", FAULTY, "hardware.timeout_s=60"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 60
    ranks: list[int] = []
    while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        ranks = [k for k in children(proc.pid) if "spawn_main" in cmdline(k)]
    assert len(ranks) == 2, "the run did not start its two ranks"
    time.sleep(2)
    proc.terminate()
    said, _ = proc.communicate(timeout=30)
    assert proc.returncode != 0, said
    time.sleep(1)
    assert not [r for r in ranks if alive(r)], f"ranks outlived the run: {said.decode()[-800:]}"


def test_1_a_plain_rerun_retries_error_rows_and_keeps_the_rest(tmp_path):
    t = ResultsTable(tmp_path / "x.parquet")
    t.append([Row("e", "s", cell_hash=h, status=s) for h, s in zip("abcd", STATUSES)])
    assert done_hashes(t) == {"a", "b", "c"}  # ok, fail, skipped kept; error measured again
    assert done_hashes(t, redo_failed=True) == {"a", "c"}


def test_1_with_restarts_a_dead_rank_costs_one_error_row_and_the_sweep_goes_on(
    tmp_path, monkeypatch, capfd
):
    """hardware.restarts=n: the cell in which a rank died is recorded as `error` (crashed, with
    the rank and the signal) and fresh ranks run the remaining cells in the same run. In-process
    (the ranks are spawned as on the command line; its exit codes and lines: the tests above)."""
    table = tmp_path / "t.parquet"
    common = (f"table={table}", "hardware.world_size=2", FAULTY, "hardware.timeout_s=3")
    monkeypatch.setenv("HARNESS_TEST_FAULT", "kill:1:1")
    proc = _in_process(*common, "hardware.restarts=2", capfd=capfd)
    assert proc.returncode == 1, out(proc)  # error rows make the exit code nonzero
    cells = _cells(table, 2)
    df = read_table(table).set_index("cell_hash")
    assert sorted(df.index) == sorted(c["cell_hash"] for c in cells)  # no dup, no loss
    # the fresh ranks count cells from 0 again: they die at the 2nd cell they start, cell 3
    status = [df.loc[c["cell_hash"], "status"] for c in cells]
    assert status == ["ok", "error", "ok", "error"], status
    reason = df.loc[cells[1]["cell_hash"], "reason"]
    assert reason.startswith("crashed: rank 1 died (killed by SIGKILL)"), reason
    assert df.loc[cells[1]["cell_hash"], "system"] == cells[1]["system"]
    assert "Traceback" not in out(proc)


def test_1_a_sticky_cuda_error_records_the_cell_then_fresh_ranks_go_on(
    tmp_path, monkeypatch, capfd
):
    """An illegal memory access poisons the process: the cell is recorded as `error`, the rank
    ends (it would abort in the next cell) and, with restarts, fresh ranks run the rest. One
    rank (W=1): the process that lost its context is the rank itself. In-process, as above."""
    table = tmp_path / "t.parquet"
    common = (f"table={table}", "hardware.world_size=1", FAULTY, "hardware.timeout_s=3")
    monkeypatch.setenv("HARNESS_TEST_FAULT", "cuda:*:1")
    proc = _in_process(*common, "hardware.restarts=2", capfd=capfd)
    assert proc.returncode == 1, out(proc)
    cells = _cells(table, 1)
    df = read_table(table).set_index("cell_hash")
    assert sorted(df.index) == sorted(c["cell_hash"] for c in cells)
    status = [df.loc[c["cell_hash"], "status"] for c in cells]
    assert status == ["ok", "error", "ok", "error"], status
    assert "illegal memory access" in df.loc[cells[1]["cell_hash"], "reason"]
    assert "CUDA context lost" in out(proc)


# ---- 6. a rank's failure, printed once; error rows


def test_6_a_rank_failure_prints_its_root_cause_once(tmp_path):
    # rank 0 finds the table damaged (by someone else) at its second cell: its own error is the
    # root cause; rank 1's "connection closed" is collateral and is not printed
    table = tmp_path / "t.parquet"
    proc = run(
        f"table={table}",
        "hardware.world_size=2",
        FAULTY,
        "hardware.timeout_s=10",
        env={"HARNESS_TEST_FAULT": "corrupt:0:1"},
    )
    assert proc.returncode == 1, out(proc)
    (line,) = error_lines(proc)
    assert line.startswith("error: rank 0 failed in cell") and "cannot be read" in line, line
    said = out(proc)
    assert said.count("cannot be read") == 1 and "Traceback" not in said
    assert "Connection" not in said and "peer" not in said
    assert table.read_bytes() == b"not a parquet file"  # never overwritten


def test_6_error_rows_make_the_run_exit_nonzero_after_writing_every_row(tmp_path, capfd):
    table = tmp_path / "t.parquet"
    common = (f"table={table}", "hardware.world_size=1", FAULTY)  # one rank is enough
    proc = run(*common, env={"HARNESS_TEST_FAULT": "raise:*:1"})  # cell 1 raises
    assert proc.returncode == 1, out(proc)
    df = read_table(table)
    assert len(df) == 4 and sorted(df["status"]) == ["error", "ok", "ok", "ok"]
    (line,) = error_lines(proc)
    assert "1 cell(s) of smoke ended in `error`" in line and "injected fault" in line, line
    again = _in_process(*common, capfd=capfd)  # the re-run's resume: in-process
    assert again.returncode == 0 and "(1 error cell(s) again)" in again.stdout, out(again)
    assert set(read_table(table)["status"]) == {"ok"}
