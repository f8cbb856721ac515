"""`make figures` (python3 -m plots.all) on a table damaged in the middle: its footer reads, one
of its pages does not. Such a table is an error (exit non-zero, one line naming it), as the
harness's own reader has it; never "no figure" with exit 0."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from harness.records import ResultsTable, Row

ROOT = Path(__file__).resolve().parents[1]


def _smoke_table(path: Path) -> Path:
    rows = [
        Row("smoke", "serial", cell_hash=f"cell{i:03d}", tokens_per_rank=64, hidden=32, out=32,
            experts_per_rank=2 ** (1 + i % 3), top_k=2, routing=("balanced", "stress_skew")[i % 2],
            dtype="float32", world_size=4, transport="gloo", latency_ms=1.0 + i,
            latency_p10_ms=0.9 + i, latency_p90_ms=1.1 + i)
        for i in range(60)
    ]  # fmt: skip
    ResultsTable(path).append(rows)
    return path


def _damage_a_middle_page(path: Path) -> None:
    """Overwrite the last bytes of the cell_hash column's pages (its dictionary indices), between
    the leading magic and the footer: the footer and every other column stay intact."""
    meta = pq.ParquetFile(path).metadata
    chunk = meta.row_group(0).column(meta.schema.names.index("cell_hash"))
    end = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size
    data = bytearray(path.read_bytes())
    footer = len(data) - 8 - meta.serialized_size  # [metadata][4-byte length]["PAR1"]
    assert 4 < end - 8 and end < footer, "not between the magic and the footer"
    data[end - 8 : end - 4] = b"\xff" * 4
    path.write_bytes(bytes(data))


def test_a_table_damaged_in_the_middle_makes_figures_exit_nonzero_naming_it(tmp_path):
    results, out = tmp_path / "results", tmp_path / "figs"
    results.mkdir()
    good = _smoke_table(results / "baselines_smoke.parquet")
    table = _smoke_table(results / "smoke.parquet")
    _damage_a_middle_page(table)
    pd.read_parquet(table, columns=[])  # the footer still reads: only a whole read finds it
    with pytest.raises(Exception):  # noqa: B017 - whatever the reader raises
        pd.read_parquet(table)
    proc = subprocess.run(
        [sys.executable, "-m", "plots.all", "--results", str(results), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    named = [line for line in text.splitlines() if "error" in line and str(table) in line]
    assert named and all("\n" not in line for line in named), text
    assert "Traceback" not in text
    assert (out / "baselines_smoke.png").exists() or any(out.glob("*baselines_smoke.png")), text
    assert str(good) not in proc.stderr  # the readable table is not among the failed ones
