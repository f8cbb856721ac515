"""Issue 42, finding 1: ranks whose parent is killed with SIGKILL end within about a second and
write no row (before, they ran on with no time bound and wrote an `ok` row)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.rank import Reporter
from tests.cli import alive, children, cmdline

ROOT = Path(__file__).resolve().parents[1]
#: how long each rank holds a cell (tests/slow_experiment.py)
HOLD_S = 3.0

pytestmark = pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")


def test_ranks_end_within_a_second_of_a_killed_parent_and_write_no_row(tmp_path):
    table, marks = tmp_path / "t.parquet", tmp_path / "marks"
    marks.mkdir()
    cmd = [sys.executable, "-m", "harness.run", "progress=false", f"table={table}"]
    cmd += ["experiment.module=tests.slow_experiment", "hardware.world_size=2"]
    cmd += ["hardware.timeout_s=30", "experiment.grid.experts_per_rank=[2]"]
    env = {**os.environ, "HARNESS_TEST_SLEEP": str(HOLD_S), "HARNESS_TEST_MARK": str(marks)}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before its ranks were in a cell"
            time.sleep(0.1)
        ranks = [k for k in children(proc.pid) if "spawn_main" in cmdline(k)]
        assert len(ranks) == 2 and len(list(marks.iterdir())) == 2, "ranks not in a cell"
        killed = time.monotonic()
        proc.kill()
        proc.wait(10)
        while [r for r in ranks if alive(r)] and time.monotonic() - killed < 3:
            time.sleep(0.05)
        left = [r for r in ranks if alive(r)]
        took = time.monotonic() - killed
        assert not left, f"{len(left)} rank(s) outlived their killed parent by {took:.1f} s"
        time.sleep(max(0.0, killed + HOLD_S + 1 - time.monotonic()))  # past the cell's end
        assert not table.exists(), "a rank wrote a row after its parent was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
        for r in ranks:  # orphans of a run that does not end them (the old code)
            if alive(r):
                os.kill(r, signal.SIGKILL)


def _rank_without_parent(recv, send) -> None:
    recv.close()  # only the parent holds the reading end, as with spawned ranks
    Reporter(send, 0.05)  # no parent_pid: only the pipe tells
    time.sleep(30)
    os._exit(0)


def test_a_rank_ends_when_its_heartbeat_pipe_closes():
    # the heartbeat's own check, where PR_SET_PDEATHSIG is not there (other platforms)
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_rank_without_parent, args=(recv, send))
    child.start()
    send.close()
    try:
        assert recv.recv() == ("beat",)
        recv.close()
        child.join(2)
        assert child.exitcode is not None, "the rank ran on after its parent's pipe closed"
    finally:
        if child.exitcode is None:
            child.kill()
            child.join(5)
