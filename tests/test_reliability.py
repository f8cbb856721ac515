"""Issue 10: sweeps survive a stalled or dead rank, a damaged or shared table and bad settings,
with errors a person can read. One test (or more) per numbered finding, each bounded in time.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from harness.errors import HarnessUserError
from harness.records import ResultsTable, Row, read_table

STATUSES = ("ok", "fail", "skipped", "error")


# ---- 1. nothing broken is recorded as done


def test_1_a_plain_rerun_retries_error_rows_and_keeps_the_rest(tmp_path):
    t = ResultsTable(tmp_path / "x.parquet")
    t.append([Row("e", "s", cell_hash=h, status=s) for h, s in zip("abcd", STATUSES)])
    assert t.done_hashes() == {"a", "b", "c"}  # ok, fail, skipped kept; error measured again
    assert t.done_hashes(redo_failed=True) == {"a", "c"}


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
