"""Issue 10: sweeps survive a stalled or dead rank, a damaged or shared table and bad settings,
with errors a person can read. One test (or more) per numbered finding, each bounded in time.

Faults are injected by tests/faulty_experiment.py (HARNESS_TEST_FAULT=<kind>:<rank>:<n>), which
runs the smoke cells and makes one rank kill, stop or damage the table at its n-th cell.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from harness.config import register_configs
from harness.errors import HarnessUserError
from harness.measure import expand_grid
from harness.records import ResultsTable, Row, read_table

STATUSES = ("ok", "fail", "skipped", "error")

ROOT = Path(__file__).resolve().parents[1]
FAULTY = "experiment.module=tests.faulty_experiment"


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


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def _compose(*overrides: str):
    """The composed config and the chosen workload group, as harness.run.main gets them."""
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    workload = cfg.hydra.runtime.choices.get("workload")
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, workload


# ---- 1. a stalled or dead rank ends the run within the time-out; nothing broken is recorded


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory):
    """Three runs (W=2) on one table: rank 1 killed at its 2nd cell; a re-run (it resumes) in
    which rank 1 stops itself at its 2nd cell; a plain re-run. The smoke cells, and per run its
    process, its time and the table after it."""
    table = tmp_path_factory.mktemp("stopped") / "t.parquet"
    common = (f"table={table}", "hardware.world_size=2", FAULTY, "hardware.timeout_s=3")
    runs = []
    for fault in ("kill:1:1", "stop:1:1", None):
        t0 = time.monotonic()
        proc = run(*common, env={"HARNESS_TEST_FAULT": fault} if fault else None)
        runs.append((proc, time.monotonic() - t0, read_table(table)))
    return expand_grid(_compose(f"table={table}", "hardware.world_size=2")[0], 2), runs


def _assert_stopped(run_: tuple, expect: str, cell: dict, done: list[dict], bound_s: float):
    """The run ended with exit code 1 within bound_s, one line naming `expect` and the cell in
    flight, which is not recorded: the table holds the `done` cells only, all ok."""
    proc, took, df = run_
    assert proc.returncode == 1, _out(proc)
    assert took < bound_s, f"took {took:.1f} s: {_out(proc)}"
    (line,) = _error_lines(proc)  # one message
    assert expect in line and f"in cell {cell['cell_hash']}" in line, line
    assert "Traceback" not in _out(proc)
    assert list(df["cell_hash"]) == [c["cell_hash"] for c in done]
    assert set(df["status"]) == {"ok"}


def _assert_resumed(cells: list[dict], run_: tuple, found: int) -> None:
    proc, _, df = run_
    assert proc.returncode == 0, _out(proc)
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


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # field 4 of stat: the parent pid
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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
        ranks = [k for k in _children(proc.pid) if "spawn_main" in _cmdline(k)]
    assert len(ranks) == 2, "the run did not start its two ranks"
    time.sleep(2)
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode != 0, out
    time.sleep(1)
    assert not [r for r in ranks if _alive(r)], f"ranks outlived the run: {out.decode()[-800:]}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


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
    assert hashes("hardware.timeout_s=5", "table=/tmp/x.parquet", "progress=false") == base
    assert {c["cell_hash"] for c in expand_grid(_compose()[0], 2)} != base  # process count


def test_2_a_changed_measure_setting_reruns_the_cell(tmp_path, monkeypatch, capsys):
    table = tmp_path / "t.parquet"
    first = run(f"table={table}", "hardware.world_size=1", "progress=true")
    assert first.returncode == 0, _out(first)
    assert "4/4" in first.stderr and "cell/s" in first.stderr  # the progress bar (finding 8)
    again = run(f"table={table}", "hardware.world_size=1", "measure.iters=7", "measure.tol=1e-3")
    assert again.returncode == 0, _out(again)
    assert "0 already in" in again.stdout and "4 to run" in again.stdout, again.stdout
    df = read_table(table)
    assert len(df) == 8 and df["cell_hash"].is_unique
    assert sorted(df["iters"].unique()) == [5, 7] and sorted(df["tol"].unique()) == [1e-3, 8e-3]
    # the same settings again: every cell is in (in-process: nothing would run)
    import harness.run as hr

    monkeypatch.setattr(hr, "run_ranks", lambda *a: pytest.fail("ranks started"))
    capsys.readouterr()
    cfg, workload = _compose(
        f"table={table}", "hardware.world_size=1", "measure.iters=7", "measure.tol=1e-3"
    )
    assert hr.launch(cfg, workload) == 0
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
    cfg, workload = _compose(f"table={tmp_path / 't.parquet'}", *overrides)
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
    assert proc.returncode == 2, _out(proc)
    assert _error_lines(proc) == ["error: measure.iters must be >= 1, got 0"]
    assert "[harness]" not in proc.stdout and "Traceback" not in _out(proc)
    assert not table.exists()


def test_3_a_misspelt_param_without_plus_is_an_error_too(tmp_path):
    proc = run(f"table={tmp_path / 't.parquet'}", "experiment.systems.tutel.params.degres=[1]")
    assert proc.returncode == 2 and "Traceback" not in _out(proc), _out(proc)
    assert "experiment.systems.tutel" in _out(proc)


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
    cfg, workload = _compose(f"table={table}")
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
    assert proc.returncode == 2, _out(proc)
    (line,) = _error_lines(proc)
    assert f"table {table}" in line and "table=<path>" in line, line
    assert "[harness]" not in proc.stdout and "Traceback" not in _out(proc)
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
    cfg, _ = _compose(f"table={path}")
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
    assert proc.returncode == 1, _out(proc)
    (line,) = _error_lines(proc)
    assert line.startswith("error: rank 0 failed in cell") and "cannot be read" in line, line
    out = _out(proc)
    assert out.count("cannot be read") == 1 and "Traceback" not in out
    assert "Connection" not in out and "peer" not in out
    assert table.read_bytes() == b"not a parquet file"  # never overwritten


def test_6_error_rows_make_the_run_exit_nonzero_after_writing_every_row(tmp_path):
    table = tmp_path / "t.parquet"
    common = (f"table={table}", "hardware.world_size=2", FAULTY)
    proc = run(*common, env={"HARNESS_TEST_FAULT": "raise:*:1"})  # cell 1 raises on every rank
    assert proc.returncode == 1, _out(proc)
    df = read_table(table)
    assert len(df) == 4 and sorted(df["status"]) == ["error", "ok", "ok", "ok"]
    (line,) = _error_lines(proc)
    assert "1 cell(s) of smoke ended in `error`" in line and "injected fault" in line, line
    again = run(*common)
    assert again.returncode == 0 and "(1 error cell(s) again)" in again.stdout, _out(again)
    assert set(read_table(table)["status"]) == {"ok"}


# ---- 7. dry run: any experiment on any machine, cells in the table marked


def test_7_dry_run_of_a_gpu_experiment_needs_no_gpu():
    proc = run("experiment=overlap_sweep", "dry_run=true")
    assert proc.returncode == 0, _out(proc)
    assert "dry run of overlap_sweep: 225 cells" in proc.stdout
    assert len(proc.stdout.splitlines()) < 30  # a short table, not 225 lines


def test_7_dry_run_marks_the_cells_already_in_the_table(tmp_path, monkeypatch, capsys):
    import harness.run as hr

    table = tmp_path / "t.parquet"
    cells = expand_grid(_compose(f"table={table}")[0], 4)
    ResultsTable(table).append(
        [
            Row("smoke", "serial", cell_hash=cells[0]["cell_hash"], status="ok"),
            Row("smoke", "serial", cell_hash=cells[1]["cell_hash"], status="error"),
        ]
    )
    # in-process (the command line's dry run: test_7_dry_run_of_a_gpu_experiment_needs_no_gpu)
    monkeypatch.setattr(hr, "run_ranks", lambda *a: pytest.fail("ranks started"))
    assert hr.launch(*_compose(f"table={table}", "dry_run=true")) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert lines[cells[0]["cell_hash"]].rstrip().endswith("ok")
    assert lines[cells[1]["cell_hash"]].rstrip().endswith("error, runs again")
    assert lines[cells[2]["cell_hash"]].rstrip().endswith("-")
    assert "1 already in" in out and "3 to run" in out


# ---- 8. progress, short summaries, loud figures


def test_8_no_experiment_turns_the_progress_bar_off():
    # the bar itself is checked in test_2_a_changed_measure_setting_reruns_the_cell
    for name in sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")):
        assert _compose(f"experiment={name}")[0].progress, name


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
    old = [out / "smoke.png", out / "smoke.pdf"]
    for p in old:
        p.write_bytes(b"an old figure")
    with pytest.raises(SystemExit) as exc:
        figures.main(["--results", str(results), "--out", str(out)])
    assert exc.value.code not in (0, None)
    assert not any(p.exists() for p in old)


def test_1_with_restarts_a_dead_rank_costs_one_error_row_and_the_sweep_goes_on(tmp_path):
    """hardware.restarts=n: the cell in which a rank died is recorded as `error` (crashed, with
    the rank and the signal) and fresh ranks run the remaining cells in the same run."""
    table = tmp_path / "t.parquet"
    common = (f"table={table}", "hardware.world_size=2", FAULTY, "hardware.timeout_s=3")
    proc = run(*common, "hardware.restarts=2", env={"HARNESS_TEST_FAULT": "kill:1:1"})
    assert proc.returncode == 1, _out(proc)  # error rows make the exit code nonzero
    cells = expand_grid(_compose(f"table={table}", "hardware.world_size=2")[0], 2)
    df = read_table(table).set_index("cell_hash")
    assert sorted(df.index) == sorted(c["cell_hash"] for c in cells)  # no dup, no loss
    # the fresh ranks count cells from 0 again: they die at the 2nd cell they start, cell 3
    status = [df.loc[c["cell_hash"], "status"] for c in cells]
    assert status == ["ok", "error", "ok", "error"], status
    reason = df.loc[cells[1]["cell_hash"], "reason"]
    assert reason.startswith("crashed: rank 1 died (killed by SIGKILL)"), reason
    assert df.loc[cells[1]["cell_hash"], "system"] == cells[1]["system"]
    assert "Traceback" not in _out(proc)


def test_1_a_sticky_cuda_error_records_the_cell_then_fresh_ranks_go_on(tmp_path):
    """An illegal memory access poisons the process: the cell is recorded as `error`, the rank
    ends (it would abort in the next cell) and, with restarts, fresh ranks run the rest."""
    table = tmp_path / "t.parquet"
    common = (f"table={table}", "hardware.world_size=2", FAULTY, "hardware.timeout_s=3")
    proc = run(*common, "hardware.restarts=2", env={"HARNESS_TEST_FAULT": "cuda:*:1"})
    assert proc.returncode == 1, _out(proc)
    cells = expand_grid(_compose(f"table={table}", "hardware.world_size=2")[0], 2)
    df = read_table(table).set_index("cell_hash")
    assert sorted(df.index) == sorted(c["cell_hash"] for c in cells)
    status = [df.loc[c["cell_hash"], "status"] for c in cells]
    assert status == ["ok", "error", "ok", "error"], status
    assert "illegal memory access" in df.loc[cells[1]["cell_hash"], "reason"]
    assert "CUDA context lost" in _out(proc)


def test_2_rounds_interleave_the_systems_of_a_workload():
    """measure.rounds=r: every system of the workload is set up first, then the systems take
    turns, r rounds of iters / r iterations, before any row is finished."""
    from types import SimpleNamespace

    from harness import measure

    log = []
    cfg = _compose("measure.rounds=3", "measure.iters=6")[0]

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
    proc = run(
        f"table={table}",
        "hardware.world_size=2",
        "measure.rounds=2",
        "measure.iters=4",
        "+experiment.systems.tutel_reimpl={}",
    )
    assert proc.returncode == 0, _out(proc)
    df = read_table(table)
    assert len(df) == 8 and set(df["status"]) == {"ok"}, df[["status", "reason"]]
    assert df["extra"].str.contains('"rounds": 2').all()
    base = {c["cell_hash"] for c in expand_grid(_compose("hardware.world_size=2")[0], 2)}
    with_r = _compose("hardware.world_size=2", "measure.rounds=2")[0]
    assert not base & {c["cell_hash"] for c in expand_grid(with_r, 2)}
    one = _compose("hardware.world_size=2", "measure.rounds=1")[0]
    assert base == {c["cell_hash"] for c in expand_grid(one, 2)}  # old tables still resume
