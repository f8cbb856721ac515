"""Issue 10: sweeps survive a stalled or dead rank, a damaged or shared table and bad settings,
with errors a person can read. One test (or more) per numbered finding, each bounded in time.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from harness.config import register_configs
from harness.errors import HarnessUserError
from harness.measure import expand_grid
from harness.records import ResultsTable, Row, read_table

ROOT = Path(__file__).resolve().parents[1]

STATUSES = ("ok", "fail", "skipped", "error")


def run(
    *overrides: str, env: dict | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """`python -m harness.run` as a user runs it (progress off unless asked)."""
    return subprocess.run(
        [sys.executable, "-m", "harness.run", "progress=false", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _out(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def _compose(*overrides: str):
    """The composed config and the chosen workload group, as harness.run.main gets them."""
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    workload = cfg.hydra.runtime.choices.get("workload")
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, workload


# ---- 1. nothing broken is recorded as done


def test_1_a_plain_rerun_retries_error_rows_and_keeps_the_rest(tmp_path):
    t = ResultsTable(tmp_path / "x.parquet")
    t.append([Row("e", "s", cell_hash=h, status=s) for h, s in zip("abcd", STATUSES)])
    assert t.done_hashes() == {"a", "b", "c"}  # ok, fail, skipped kept; error measured again
    assert t.done_hashes(redo_failed=True) == {"a", "c"}


# ---- 2. resume by everything that changes a number


def test_2_the_hash_covers_every_setting_that_changes_a_number():
    def hashes(*o):
        return {c["cell_hash"] for c in expand_grid(_compose(*o)[0], 4)}

    base = hashes()
    for override in (
        "measure.iters=7",
        "measure.warmup=0",
        "measure.tol=1e-9",
        "experiment.grid.dtype=[bfloat16]",
        "hardware.name=other",
        "hardware.backend=nccl",
        "seed=1",
    ):
        assert not hashes(override) & base, override
    assert hashes("table=/tmp/x.parquet", "progress=false") == base
    assert {c["cell_hash"] for c in expand_grid(_compose()[0], 2)} != base  # process count


def test_2_a_changed_measure_setting_reruns_the_cell(tmp_path):
    table = tmp_path / "t.parquet"
    first = run(f"table={table}", "hardware.world_size=1")
    assert first.returncode == 0, _out(first)
    again = run(f"table={table}", "hardware.world_size=1", "measure.iters=7", "measure.tol=1e-3")
    assert again.returncode == 0, _out(again)
    assert "0 already in" in again.stdout and "4 to run" in again.stdout, again.stdout
    df = read_table(table)
    assert len(df) == 8 and df["cell_hash"].is_unique
    assert sorted(df["iters"].unique()) == [5, 7] and sorted(df["tol"].unique()) == [1e-3, 8e-3]
    same = run(f"table={table}", "hardware.world_size=1", "measure.iters=7", "measure.tol=1e-3")
    assert "4 already in" in same.stdout and "0 to run" in same.stdout, same.stdout


# ---- 4. a damaged table is never overwritten


def _good_table(path: Path) -> Path:
    ResultsTable(path).append([Row("smoke", "serial", cell_hash=f"h{i}") for i in range(50)])
    return path


def test_4_an_append_never_overwrites_a_table_it_cannot_read(tmp_path):
    table = _good_table(tmp_path / "t.parquet")
    table.write_bytes(b"garbage")
    with pytest.raises(HarnessUserError, match="cannot be read"):
        ResultsTable(table).append([Row("smoke", "serial", cell_hash="x")])
    assert table.read_bytes() == b"garbage"


# ---- 5. concurrent writers lose no row


def _append_many(path: str, who: str, n: int) -> None:
    t = ResultsTable(Path(path))
    for i in range(n):
        t.append([Row("e", "serial", cell_hash=f"{who}{i}")])


def test_5_two_concurrent_writers_keep_every_row(tmp_path):
    path = str(tmp_path / "t.parquet")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(path, w, 40)) for w in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    df = read_table(path)
    assert sorted(df["cell_hash"]) == sorted(f"{w}{i}" for w in "ab" for i in range(40))
    assert not list(tmp_path.glob(".*.tmp"))
