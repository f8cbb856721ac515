"""Issue 42, finding 4: a read-only table, or one in a read-only folder, is refused with one line
and left as it is, also for root (os.access is always true for root; these tests run as root on
the project's machines, where the old check let a table of mode 0444 be rewritten)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from harness.config import register_configs
from harness.errors import HarnessUserError
from harness.records import ResultsTable, Row

ROOT = Path(__file__).resolve().parents[1]


def _table(path: Path) -> Path:
    ResultsTable(path).append([Row("smoke", "serial", cell_hash=h) for h in "ab"])
    return path


def _cfg(*overrides: str):
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _state(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("read_only", ["table", "folder"])
def test_a_read_only_table_is_refused_before_any_rank_starts(tmp_path, monkeypatch, read_only):
    import harness.run as hr

    folder = tmp_path / "d"
    folder.mkdir()
    table = _table(folder / "t.parquet")
    target = table if read_only == "table" else folder
    target.chmod(0o444 if read_only == "table" else 0o555)
    before = _state(table)
    monkeypatch.setattr(hr, "run_ranks", lambda *a: pytest.fail("ranks started"))
    try:
        with pytest.raises(HarnessUserError, match="is read-only") as exc:
            hr.launch(_cfg(f"table={table}"))
        assert "\n" not in str(exc.value) and str(target) in str(exc.value)
        assert _state(table) == before
        assert sorted(p.name for p in folder.iterdir()) == ["t.parquet", "t.parquet.lock"]
    finally:
        folder.chmod(0o755)


def test_on_the_command_line_it_is_one_line_and_exit_code_2(tmp_path):
    table = _table(tmp_path / "t.parquet")
    table.chmod(0o444)
    before = _state(table)
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "progress=false", f"table={table}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot write the table"), lines
    assert "read-only (mode -r--r--r--)" in lines[0]
    assert _state(table) == before


def test_an_append_refuses_a_table_made_read_only_during_the_run(tmp_path):
    table = _table(tmp_path / "t.parquet")
    table.chmod(0o444)
    before = _state(table)
    with pytest.raises(HarnessUserError, match="read-only"):
        ResultsTable(table).append([Row("smoke", "serial", cell_hash="c")])
    assert _state(table) == before


def test_an_append_keeps_the_tables_permissions(tmp_path):
    table = _table(tmp_path / "t.parquet")
    table.chmod(0o664)
    ResultsTable(table).append([Row("smoke", "serial", cell_hash="c")])
    assert stat.S_IMODE(table.stat().st_mode) == 0o664
    assert os.access(table, os.R_OK)
