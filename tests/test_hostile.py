"""Issue 59, findings 3, 5, 6 and 7 (what a hostile tester still found at 6172669): a symlinked
table forked, a table of another schema measured before it failed, a parent that lagged called a
finished run failed, wrong counts, signals that ended with a trace or with no word, and
messages that let a bad setting through. One test (or more) per finding, each failing on
6172669's behaviour.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from harness.errors import HarnessUserError
from harness.records import CHECKSUM_KEY, ResultsTable, Row, read_table
from tests.cli import FAULTY, ROOT, alive, children, error_lines, out, run
from tests.inprocess import compose_run

# ---- 3. a symlinked table: written through to its target, locked there; bad links refused


def _append_many(path: str, who: str, n: int) -> None:
    t = ResultsTable(Path(path))
    for i in range(n):
        t.append([Row("e", "serial", cell_hash=f"{who}{i}")])


def test_3_a_symlinked_table_is_written_through_to_its_target(tmp_path):
    target = tmp_path / "shared" / "t.parquet"
    target.parent.mkdir()
    ResultsTable(target).append([Row("e", "serial", cell_hash="first")])
    link = tmp_path / "link.parquet"
    link.symlink_to(target)
    table = ResultsTable(link)
    assert table.lock.lock_file == str(target) + ".lock"
    table.append([Row("e", "serial", cell_hash="second")])
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert sorted(read_table(target)["cell_hash"]) == ["first", "second"]
    assert not list(tmp_path.glob(".*.tmp")) and not list(target.parent.glob(".*.tmp"))


def test_3_two_links_to_one_table_serialise_and_end_as_one_table(tmp_path):
    target = tmp_path / "t.parquet"
    ResultsTable(target).append([Row("e", "serial", cell_hash="first")])
    links = [tmp_path / f"{w}.parquet" for w in "ab"]
    for link in links:
        link.symlink_to(target)
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_append_many, args=(str(link), w, 30)) for link, w in zip(links, "ab")
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert all(link.is_symlink() for link in links)  # not replaced by copies of their own
    want = sorted(["first", *(f"{w}{i}" for w in "ab" for i in range(30))])
    assert sorted(read_table(target)["cell_hash"]) == want


@pytest.mark.parametrize("kind", ["dangling", "loop", "dangling folder"])
def test_3_a_dangling_link_or_a_loop_is_one_line_and_left_as_it_is(tmp_path, monkeypatch, kind):
    import harness.run as hr

    if kind == "dangling":
        link = path = tmp_path / "t.parquet"
        link.symlink_to(tmp_path / "nowhere" / "t.parquet")
    elif kind == "loop":
        link = path = tmp_path / "t.parquet"
        link.symlink_to(link)
    else:
        link = tmp_path / "results"
        link.symlink_to(tmp_path / "gone")
        path = link / "t.parquet"
    before = os.readlink(link)
    monkeypatch.setattr(hr, "run_ranks", lambda *a: pytest.fail("ranks started"))
    cfg, workload = compose_run(f"table={path}")
    with pytest.raises(HarnessUserError) as exc:
        hr.launch(cfg, workload)
    line = str(exc.value)
    assert "\n" not in line and str(link) in line and "symbolic link" in line, line
    assert ("loop" in line) == (kind == "loop"), line
    assert link.is_symlink() and os.readlink(link) == before
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "gone").exists()


# ---- 5. a table of another schema: one line in preflight, nothing measured


def _other_schema(path: Path, column: str, value) -> Path:
    ResultsTable(path).append([Row("smoke", "serial", cell_hash=f"h{i}") for i in range(3)])
    df = read_table(path)
    df[column] = value
    df.to_parquet(path, index=False)  # another tool's table: no checksum of the harness
    return path


@pytest.mark.parametrize(
    "column, value, have, writes",
    [("tokens_per_rank", "many", "string", "int64"), ("latency_ms", "fast", "string", "double"),
     ("routing", 7, "int64", "string"), ("graph", "yes", "string", "bool")],
)  # fmt: skip
def test_5_a_table_of_another_schema_is_one_line_before_any_rank(
    tmp_path, monkeypatch, capsys, column, value, have, writes
):
    import harness.run as hr

    table = _other_schema(tmp_path / "t.parquet", column, value)
    before = table.read_bytes()
    monkeypatch.setattr(hr, "run_ranks", lambda *a: pytest.fail("ranks started"))
    cfg, workload = compose_run(f"table={table}")
    with pytest.raises(HarnessUserError) as exc:
        hr.launch(cfg, workload)
    line = str(exc.value)
    assert "\n" not in line and str(table) in line, line
    assert f"column {column} " in line and have in line and writes in line, line
    assert "[harness]" not in capsys.readouterr().out
    assert table.read_bytes() == before


def test_5_another_schema_on_the_command_line_is_exit_code_2(tmp_path):
    table = _other_schema(tmp_path / "t.parquet", "hidden", "wide")
    proc = run(f"table={table}")
    assert proc.returncode == 2, out(proc)
    (line,) = error_lines(proc)
    assert "column hidden" in line and "string" in line and "int64" in line, line
    assert "Traceback" not in out(proc) and len(read_table(table)) == 3


def test_5_an_older_table_of_compatible_types_is_still_taken(tmp_path):
    """A core column an older table lacks, holds all null, or holds as float (an int column
    after a concat with a table without it) is no mismatch: rows are added to it."""
    path = tmp_path / "t.parquet"
    ResultsTable(path).append([Row("smoke", "serial", cell_hash=f"h{i}") for i in range(3)])
    df = read_table(path).drop(columns=["caveat", "machine"])
    df["gpu_count"] = df["gpu_count"].astype(float)
    df["reason"] = None
    df.to_parquet(path, index=False)
    table = ResultsTable(path)
    table.check_schema()
    table.append([Row("smoke", "serial", cell_hash="new")])
    assert len(read_table(path)) == 4


# ---- 7. a bit flip that still parses is a damaged table, never overwritten


def test_7_a_bit_flip_that_still_parses_is_a_damaged_table(tmp_path):
    path = tmp_path / "t.parquet"
    values = [1234.5678, 987.654321, 42.4242]
    rows = [Row("smoke", "serial", cell_hash=f"h{i}", latency_ms=v) for i, v in enumerate(values)]
    ResultsTable(path).append(rows)
    data, good = path.read_bytes(), pd.read_parquet(path)
    changed = 0
    for v in values:  # each value's bytes, wherever they lie (data page, statistics)
        for at in [i for i in range(len(data)) if data.startswith(struct.pack("<d", v), i)]:
            flipped = bytearray(data)
            flipped[at] ^= 1  # the lowest bit of the mantissa: the number moves, still a number
            path.write_bytes(bytes(flipped))
            try:
                quiet = not pd.read_parquet(path).equals(good)  # parses, and reads another value
            except Exception:  # noqa: BLE001 - a flip pandas notices is not this finding
                continue
            if not quiet:
                continue
            changed += 1
            with pytest.raises(HarnessUserError, match="table .* (damaged|cannot be read)"):
                read_table(path)
            with pytest.raises(HarnessUserError):
                ResultsTable(path).append([Row("smoke", "serial", cell_hash="x")])
            assert path.read_bytes() == bytes(flipped)  # never overwritten
    assert changed >= 1  # the test flipped a value pandas reads without a word


def test_7_a_value_changed_under_the_stored_checksum_is_a_damaged_table(tmp_path):
    """The checksum in the key-value metadata: a table rewritten with one value changed and the
    old metadata kept (no page checksums) is damaged."""
    path = tmp_path / "t.parquet"
    ResultsTable(path).append([Row("smoke", "serial", cell_hash=f"h{i}") for i in range(3)])
    table = pq.read_table(path)
    assert CHECKSUM_KEY in table.schema.metadata
    df = table.to_pandas()
    df.loc[1, "latency_ms"] = 0.001
    import pyarrow as pa

    forged = pa.Table.from_pandas(df, preserve_index=False).replace_schema_metadata(
        table.schema.metadata
    )
    pq.write_table(forged, path)
    with pytest.raises(HarnessUserError, match="damaged: its values do not match the checksum"):
        read_table(path)


# ---- 6. the supervisor reads every report before it judges exit codes; its counts are right


class _Exited:
    """A rank process that has exited with code 0."""

    exitcode, pid = 0, 0

    def kill(self) -> None:
        pass

    def join(self, timeout=None) -> None:
        pass


def test_6_reports_still_in_the_pipe_of_an_exited_rank_are_read_first():
    """What a parent that lagged finds: every rank finished every cell, reported, and exited
    before the parent read a word. It says the run is done, with every cell written."""
    from omegaconf import OmegaConf

    from harness.supervisor import _Rank, supervise

    todo = [{"cell_hash": f"h{i}", "system": "serial"} for i in range(4)]
    ranks = []
    for rank in range(2):
        recv, send = multiprocessing.Pipe(duplex=False)
        for i in range(len(todo)):
            send.send(("cell", i))
            send.send(("beat",))
            if rank == 0:
                send.send(("written", i, [("serial", "ok")]))
        send.send(("done",))
        send.close()
        ranks.append(_Rank(_Exited(), recv))
    cfg = OmegaConf.create({"hardware": {"timeout_s": 60.0}})
    assert supervise(ranks, todo, cfg, None) is None
    assert ranks[0].written == {0, 1, 2, 3}


def test_6_a_parent_paused_while_its_ranks_finish_reports_a_finished_run(tmp_path):
    table, mark = tmp_path / "t.parquet", tmp_path / "mark"
    mark.mkdir()
    cmd = [sys.executable, "-m", "harness.run", "progress=false", f"table={table}"]
    cmd += ["experiment.module=tests.slow_experiment", "hardware.world_size=2"]
    env = {**os.environ, "HARNESS_TEST_SLEEP": "0.2", "HARNESS_TEST_MARK": str(mark)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        t0 = time.monotonic()
        while len(list(mark.iterdir())) < 2 and time.monotonic() - t0 < 60:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGSTOP)  # the ranks run on and finish meanwhile
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            time.sleep(0.5)
            if table.exists() and len(read_table(table)) == 4:
                break
        time.sleep(3)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    stdout, stderr = (s.decode() for s in proc.communicate(timeout=60))
    assert len(read_table(table)) == 4
    assert proc.returncode == 0, stdout + stderr
    assert "exited early" not in stderr and "wrote 4 row(s)" in stdout, stdout + stderr


def test_6_the_restart_message_counts_the_cells_of_the_whole_run(tmp_path, monkeypatch, capfd):
    """Rank 1 dies at its 2nd cell, every time: the first ranks write cell 0 and record cell 1
    as crashed, the fresh ones write cell 2 and die in cell 3 with no restart left: 3 of the
    run's 4 cells (6172669 said "3 of 2")."""
    from tests.inprocess import launch

    table = tmp_path / "t.parquet"
    monkeypatch.setenv("HARNESS_TEST_FAULT", "kill:1:1")
    common = (f"table={table}", "hardware.world_size=2", FAULTY, "hardware.timeout_s=3")
    capfd.readouterr()
    code = launch("progress=false", *common, "hardware.restarts=1")
    said = capfd.readouterr()
    assert code == 1, said.out + said.err
    assert "fresh ranks run the remaining 2 of 4 cell(s)" in said.out, said.out
    (line,) = [x for x in said.err.splitlines() if x.startswith("error:")]
    assert "run stopped after 3 of 4 cell(s)" in line, line
    assert len(read_table(table)) == 3


# ---- 7. SIGTERM and SIGINT: one line saying what was written and where, no trace


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_7_a_signal_ends_the_run_with_one_line_saying_what_was_written(tmp_path, signum):
    """SIGTERM to the parent (a `timeout`, a scheduler), SIGINT to the whole process group (a
    terminal's Ctrl-C) during the third cell: one line, no trace, the ranks gone, 128 + signal."""
    table, mark = tmp_path / "t.parquet", tmp_path / "mark"
    mark.mkdir()
    cmd = [sys.executable, "-m", "harness.run", "progress=false", f"table={table}"]
    cmd += ["experiment.module=tests.slow_experiment", "hardware.world_size=2"]
    env = {**os.environ, "HARNESS_TEST_SLEEP": "0.2", "HARNESS_TEST_MARK": str(mark)}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            if table.exists() and len(read_table(table)) >= 2:
                break
            time.sleep(0.05)
        ranks = children(proc.pid)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, stdout + stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    (line,) = error_lines(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    n = len(read_table(table))
    assert f"wrote {n} row(s)" in line and str(table) in line, line
    assert signal.Signals(signum).name in line and "run the same command again" in line, line
    t0 = time.monotonic()
    while any(alive(r) for r in ranks) and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert not any(alive(r) for r in ranks)


# ---- 7. messages: the missing `+`, an empty system set, an experiment name that leaves results/


def test_7_a_system_param_set_without_plus_is_told_to_use_plus(tmp_path):
    proc = run(f"table={tmp_path / 't.parquet'}", "experiment.systems.serial.params.foo=1")
    assert proc.returncode == 2 and "Traceback" not in out(proc), out(proc)
    (line,) = error_lines(proc)
    assert "+experiment.systems.serial.params.foo=1" in line, line


def test_7_an_empty_system_set_is_an_error_not_a_serial_run(tmp_path):
    table = tmp_path / "t.parquet"
    proc = run(f"table={table}", "experiment.systems={}", "hardware.world_size=1")
    assert proc.returncode == 2, out(proc)
    (line,) = error_lines(proc)
    assert "experiment.systems={}" in line and "no system" in line, line
    assert not table.exists()


@pytest.mark.parametrize("name", ["", "  ", "..", "../..", "../../escaped", "/tmp/abs", "a/b"])
def test_7_an_experiment_name_that_would_leave_the_results_folder_is_refused(
    tmp_path, monkeypatch, name
):
    import harness.run as hr

    monkeypatch.chdir(tmp_path)  # results_dir is relative: nothing may land above tmp_path
    monkeypatch.setattr(hr, "run_ranks", lambda *a: pytest.fail("ranks started"))
    cfg, workload = compose_run(f"experiment.name='{name}'", f"results_dir={tmp_path / 'r'}")
    with pytest.raises(HarnessUserError) as exc:
        hr.launch(cfg, workload)
    line = str(exc.value)
    assert "experiment.name" in line and "\n" not in line, line
    assert not list(tmp_path.rglob("*.parquet")) and not Path("/tmp/abs.parquet").exists()


def test_7_the_figures_refuse_a_folder_named_like_a_table(tmp_path, capsys):
    from plots import all as figures

    results, figs = tmp_path / "results", tmp_path / "figs"
    folder = results / "smoke.parquet"
    folder.mkdir(parents=True)
    figs.mkdir()
    rows = [
        Row("smoke", "serial", cell_hash=f"h{i}", experts_per_rank=e, tokens_per_rank=256,
            hidden=128, out=128, top_k=2, routing="balanced", dtype="float32", world_size=2,
            latency_ms=1.0 + i, latency_p10_ms=0.9 + i, latency_p90_ms=1.1 + i)
        for i, e in enumerate((2, 4))
    ]  # fmt: skip
    table = tmp_path / "t.parquet"
    ResultsTable(table).append(rows)
    (folder / "part-0.parquet").write_bytes(table.read_bytes())  # a data set pandas would read
    with pytest.raises(SystemExit) as exc:
        figures.main(["--results", str(results), "--out", str(figs)])
    assert exc.value.code not in (0, None)
    assert f"{folder} is a folder, not a table" in capsys.readouterr().out
    assert not list(figs.iterdir())
