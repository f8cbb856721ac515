"""Issue 10, findings 2-8: sweeps survive a damaged or shared table and bad settings, resume by
every setting that changes a number, and say what went wrong in a line a person can read. One
test (or more) per numbered finding, each bounded in time; finding 1 (a stalled or dead rank)
and the rank failures of finding 6 are in tests/test_failing_ranks.py.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import HarnessUserError
from harness.measure import expand_grid
from harness.records import ResultsTable, Row, read_table
from tests.cli import ROOT, error_lines, out, run
from tests.inprocess import compose_run, launch

# ---- 2. resume by everything that changes a number


def test_2_the_hash_covers_every_setting_that_changes_a_number():
    def hashes(*o):
        return {c["cell_hash"] for c in expand_grid(compose_run(*o)[0], 4)}

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
    assert hashes("hardware.timeout_s=5", "table=/tmp/x.parquet", "progress=false") == base
    assert {c["cell_hash"] for c in expand_grid(compose_run()[0], 2)} != base  # process count


def test_2_a_changed_measure_setting_reruns_the_cell(tmp_path, capsys):
    # in-process (the same launch; the command line's runs and resume: test_failing_ranks)
    table = tmp_path / "t.parquet"
    assert launch(f"table={table}", "hardware.world_size=1", "progress=true") == 0
    first = capsys.readouterr().err
    assert "4/4" in first and "cell/s" in first, first  # the progress bar (finding 8)
    changed = (f"table={table}", "hardware.world_size=1", "measure.iters=7", "measure.tol=1e-3")
    assert launch(*changed, "progress=false") == 0
    again = capsys.readouterr().out
    assert "0 already in" in again and "4 to run" in again, again
    df = read_table(table)
    assert len(df) == 8 and df["cell_hash"].is_unique
    assert sorted(df["iters"].unique()) == [5, 7] and sorted(df["tol"].unique()) == [1e-3, 8e-3]
    assert launch(*changed, "progress=false", ranks=False) == 0  # every cell is in
    same = capsys.readouterr().out
    assert "4 already in" in same and "0 to run" in same, same


# ---- 3. every setting is validated before any process starts


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["measure.iters=0"], "measure.iters must be >= 1"),
        (["measure.tol=-1"], "measure.tol must be a number > 0"),
        (["measure.tol=0"], "measure.tol must be a number > 0"),
        (["measure.warmup=-5"], "measure.warmup must be >= 0"),
        (["hardware.timeout_s=0"], "hardware.timeout_s must be > 0"),
        (["experiment.grid.routing=[]"], "experiment.grid.routing is empty"),
        (["experiment.grid.experts_per_rank=[]"], "experiment.grid.experts_per_rank is empty"),
        (["~experiment.systems.serial"], "experiment.systems is empty"),
        (
            ["+experiment.systems.tutel.params.degres=[1]"],
            "system 'tutel' has no parameter 'degres'",
        ),
        (["+experiment.systems.serial.params.ccta=4"], "system 'serial' has no parameter 'ccta'"),
        (["workload=m_gpt"], "experiment smoke sets its own shape, so workload=m_gpt"),
        (["hardware.world_size=0"], "hardware.world_size must be 1.."),
        (["hardware.world_size=100000"], "hardware.world_size must be 1.."),
        (["hardware.backend=nccl"], "hardware.device=cpu with hardware.backend=nccl"),
        (["experiment=padding", "experiment.systems.overlap.sweep.tile_m=[0]"], "tile_m must be"),
    ],
)
def test_3_bad_settings_are_rejected_before_any_process_starts(
    tmp_path, monkeypatch, overrides, message
):
    import harness.run as hr

    def no_ranks(*a, **k):
        raise AssertionError("ranks started")

    monkeypatch.setattr(hr, "run_ranks", no_ranks)
    cfg, workload = compose_run(f"table={tmp_path / 't.parquet'}", *overrides)
    with pytest.raises(HarnessUserError, match=None) as exc:
        hr.launch(cfg, workload)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "t.parquet").exists()


@pytest.fixture(scope="module")
def iters_0(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`measure.iters=0` on the command line: its table path and the process."""
    table = tmp_path_factory.mktemp("iters_0") / "t.parquet"
    return table, run(f"table={table}", "measure.iters=0")


def test_3_iters_0_exits_2_with_one_line_before_any_process_starts(iters_0):
    table, proc = iters_0
    assert proc.returncode == 2, out(proc)
    assert error_lines(proc) == ["error: measure.iters must be >= 1, got 0"]
    assert "[harness]" not in proc.stdout and "Traceback" not in out(proc)
    assert not table.exists()


def test_3_a_misspelt_param_without_plus_is_an_error_too(tmp_path):
    proc = run(f"table={tmp_path / 't.parquet'}", "experiment.systems.tutel.params.degres=[1]")
    assert proc.returncode == 2 and "Traceback" not in out(proc), out(proc)
    assert "experiment.systems.tutel" in out(proc)


# ---- 4. a damaged table or an unwritable path: one line, before any rank, table untouched


def _good_table(path: Path) -> Path:
    ResultsTable(path).append([Row("smoke", "serial", cell_hash=f"h{i}") for i in range(50)])
    return path


def _damaged(path: Path, damage: str) -> Path:
    table = _good_table(path)
    data = table.read_bytes()
    if damage == "empty":
        table.write_bytes(b"")
    elif damage == "truncated":
        table.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        table.write_bytes(os.urandom(len(data)))
    else:
        read_table(table).drop(columns=["cell_hash"]).to_parquet(table)
    return table


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "no cell_hash"])
def test_4_a_damaged_table_is_one_line_and_never_overwritten(tmp_path, monkeypatch, capsys, damage):
    # in-process (the command line's exit code 2 and `error:` line for this error: below)
    import harness.run as hr

    table = _damaged(tmp_path / "t.parquet", damage)
    before = table.read_bytes()
    monkeypatch.setattr(hr, "run_ranks", lambda *a: pytest.fail("ranks started"))
    cfg, workload = compose_run(f"table={table}")
    with pytest.raises(HarnessUserError) as exc:
        hr.launch(cfg, workload)
    line = str(exc.value)
    assert f"table {table}" in line and "table=<path>" in line and "\n" not in line, line
    assert "[harness]" not in capsys.readouterr().out
    assert table.read_bytes() == before


def test_4_a_damaged_table_on_the_command_line_is_one_line_and_exit_code_2(tmp_path):
    table = _damaged(tmp_path / "t.parquet", "truncated")
    before = table.read_bytes()
    proc = run(f"table={table}")
    assert proc.returncode == 2, out(proc)
    (line,) = error_lines(proc)
    assert f"table {table}" in line and "table=<path>" in line, line
    assert "[harness]" not in proc.stdout and "Traceback" not in out(proc)
    assert table.read_bytes() == before


def test_4_an_append_never_overwrites_a_table_it_cannot_read(tmp_path):
    table = _good_table(tmp_path / "t.parquet")
    table.write_bytes(b"garbage")
    with pytest.raises(HarnessUserError, match="cannot be read"):
        ResultsTable(table).append([Row("smoke", "serial", cell_hash="x")])
    assert table.read_bytes() == b"garbage"


@pytest.mark.parametrize("where", ["/proc/harness_t.parquet", "FILE/t.parquet"])
def test_4_an_unwritable_table_path_is_found_before_any_work(tmp_path, monkeypatch, where):
    import harness.run as hr

    (tmp_path / "FILE").write_text("a file")
    path = where.replace("FILE", str(tmp_path / "FILE"))
    monkeypatch.setattr(hr, "run_ranks", lambda *a: pytest.fail("ranks started"))
    cfg, _ = compose_run(f"table={path}")
    with pytest.raises(HarnessUserError, match="cannot write the table"):
        hr.launch(cfg)


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


def test_5_a_reader_during_a_writers_replace_sees_a_whole_table(tmp_path):
    """A plot or a progress poll reads while a sweep writes: every read gives a whole table
    (pyarrow by path would take one file's size and the replaced file's bytes)."""
    path = tmp_path / "t.parquet"
    ResultsTable(path).append([Row("e", "serial", cell_hash="0")])
    ctx = multiprocessing.get_context("fork")
    writer = ctx.Process(target=_append_many, args=(str(path), "w", 150))
    writer.start()
    sizes = []
    while writer.is_alive():
        sizes.append(len(read_table(path)))  # a torn read raises HarnessUserError
    writer.join(60)
    assert writer.exitcode == 0 and len(sizes) > 20 and sizes == sorted(sizes), sizes[:20]


def test_5_two_runs_on_one_table_keep_every_row(tmp_path):
    table = tmp_path / "t.parquet"
    cmd = [sys.executable, "-m", "harness.run", "progress=false", f"table={table}"]
    cmd += ["hardware.world_size=1"]
    procs = [
        subprocess.Popen([*cmd, f"seed={s}"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for s in (1, 2)
    ]
    for p in procs:
        p.communicate(timeout=60)
    assert [p.returncode for p in procs] == [0, 0]
    df = read_table(table)
    assert len(df) == 8 and df["cell_hash"].is_unique and set(df["status"]) == {"ok"}


# ---- 6. errors a person can read


def test_6_a_user_error_is_one_line_and_the_trace_comes_only_when_asked(iters_0):
    table, proc = iters_0
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    full = run(f"table={table}", "measure.iters=0", env={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode != 0 and "Traceback" in full.stderr
    assert "measure.iters must be >= 1" in full.stderr


# ---- 7. dry run: any experiment on any machine, cells in the table marked


def test_7_dry_run_of_a_gpu_experiment_needs_no_gpu():
    proc = run("experiment=overlap_sweep", "dry_run=true")
    assert proc.returncode == 0, out(proc)
    assert "dry run of overlap_sweep: 225 cells" in proc.stdout
    assert len(proc.stdout.splitlines()) < 30  # a short table, not 225 lines


def test_7_dry_run_marks_the_cells_already_in_the_table(tmp_path, monkeypatch, capsys):
    import harness.run as hr

    table = tmp_path / "t.parquet"
    cells = expand_grid(compose_run(f"table={table}")[0], 4)
    ResultsTable(table).append(
        [
            Row("smoke", "serial", cell_hash=cells[0]["cell_hash"], status="ok"),
            Row("smoke", "serial", cell_hash=cells[1]["cell_hash"], status="error"),
        ]
    )
    # in-process (the command line's dry run: test_7_dry_run_of_a_gpu_experiment_needs_no_gpu)
    monkeypatch.setattr(hr, "run_ranks", lambda *a: pytest.fail("ranks started"))
    assert hr.launch(*compose_run(f"table={table}", "dry_run=true")) == 0
    said = capsys.readouterr().out
    lines = {line.split()[0]: line for line in said.splitlines() if line.strip()}
    assert lines[cells[0]["cell_hash"]].rstrip().endswith("ok")
    assert lines[cells[1]["cell_hash"]].rstrip().endswith("error, runs again")
    assert lines[cells[2]["cell_hash"]].rstrip().endswith("-")
    assert "1 already in" in said and "3 to run" in said


# ---- 8. progress, short summaries, loud figures


def test_8_no_experiment_turns_the_progress_bar_off():
    # the bar itself is checked in test_2_a_changed_measure_setting_reruns_the_cell
    for name in sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")):
        assert compose_run(f"experiment={name}")[0].progress, name


def test_8_the_summary_is_capped_with_a_pointer_to_the_table(tmp_path):
    from harness.run import summary

    rows = [
        {"system": "overlap", "status": "ok", "cell_hash": str(i), "reason": "", "world_size": 2}
        for i in range(540)
    ]
    lines = summary(rows, tmp_path / "padding.parquet")
    assert len(lines) <= 22
    assert str(tmp_path / "padding.parquet") in lines[-1] and "540" in lines[-1]


def test_8_figures_fail_loudly_on_a_damaged_table_and_drop_its_old_figure(tmp_path):
    from plots import all as figures

    results, out = tmp_path / "results", tmp_path / "figs"
    results.mkdir()
    out.mkdir()
    (results / "smoke.parquet").write_bytes(b"garbage")
    old = [out / "cpu_smoke.png", out / "cpu_smoke.pdf"]  # the figure of an earlier, whole table
    for p in old:
        p.write_bytes(b"an old figure")
    with pytest.raises(SystemExit) as exc:
        figures.main(["--results", str(results), "--out", str(out)])
    assert exc.value.code not in (0, None)
    assert not any(p.exists() for p in old)


def test_2_rounds_interleave_the_systems_of_a_workload():
    """measure.rounds=r: every system of the workload is set up first, then the systems take
    turns, r rounds of iters / r iterations, before any row is finished."""
    from types import SimpleNamespace

    from harness import measure

    log = []
    cfg = compose_run("measure.rounds=3", "measure.iters=6")[0]

    def prepare(ctx, cfg, cell):
        log.append(("setup", cell["system"]))
        row = SimpleNamespace(status="ok")
        return measure._Prepared(row, SimpleNamespace(extra={}, timed=None), None, None)

    def time_it(ctx, cfg, p, iters, warmup):
        log.append(("time", p.system, iters, warmup))
        return True

    def finish(ctx, cfg, p):
        log.append(("finish", p.system.extra["rounds"]))
        return p.row

    cells = [{"system": s} for s in ("a", "b")]
    orig = (measure.prepare_cell, measure.time_prepared, measure.finish_cell)
    measure.prepare_cell, measure.time_prepared, measure.finish_cell = prepare, time_it, finish
    try:
        rows = measure.measure_workload(None, cfg, cells)
    finally:
        measure.prepare_cell, measure.time_prepared, measure.finish_cell = orig
    kinds = [e[0] for e in log]
    assert kinds == ["setup"] * 2 + ["time"] * 6 + ["finish"] * 2
    iters = [e[2] for e in log if e[0] == "time"]
    warm = [e[3] for e in log if e[0] == "time"]
    assert iters == [2] * 6 and warm == [cfg.measure.warmup] * 2 + [1] * 4
    assert [e[1] for e in log if e[0] == "finish"] == [3, 3] and len(rows) == 2


def test_2_rounds_end_to_end_and_in_the_hash(tmp_path):
    table = tmp_path / "t.parquet"
    code = launch(
        f"table={table}",
        "progress=false",
        "hardware.world_size=2",
        "measure.rounds=2",
        "measure.iters=4",
        "+experiment.systems.tutel_reimpl={}",
    )
    assert code == 0
    df = read_table(table)
    assert len(df) == 8 and set(df["status"]) == {"ok"}, df[["status", "reason"]]
    assert df["extra"].str.contains('"rounds": 2').all()
    base = {c["cell_hash"] for c in expand_grid(compose_run("hardware.world_size=2")[0], 2)}
    with_r = compose_run("hardware.world_size=2", "measure.rounds=2")[0]
    assert not base & {c["cell_hash"] for c in expand_grid(with_r, 2)}
    one = compose_run("hardware.world_size=2", "measure.rounds=1")[0]
    assert base == {c["cell_hash"] for c in expand_grid(one, 2)}  # old tables still resume
