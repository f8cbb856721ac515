"""make report: REPORT.md is a pure function of the committed tables, and the committed one is
current (a table changed without `make report` fails here)."""

from pathlib import Path

import pandas as pd

from plots.report import CLAIMS, render

ROOT = Path(__file__).resolve().parents[1]


def test_committed_report_is_current():
    committed = (ROOT / "results" / "REPORT.md").read_text()
    assert committed == render(ROOT / "results" / "reference", Path("plots/figures")), (
        "results/REPORT.md is stale: run `make report`"
    )


def test_every_table_and_claim_is_in_the_report():
    text = render(ROOT / "results" / "reference", Path("plots/figures"))
    for p in (ROOT / "results" / "reference").rglob("*.parquet"):
        assert f"`{p.parent.name}/{p.stem}`" in text
    for c in CLAIMS:
        assert c.what in text


def test_without_tables_every_claim_is_not_measured(tmp_path):
    pd.DataFrame({"x": [1]}).to_parquet(tmp_path / "other.parquet")  # not a results table
    text = render(tmp_path, tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    claims = [r for r in rows if any(r.startswith(f"| {c.what} |") for c in CLAIMS)]
    assert len(claims) == len(CLAIMS)
    assert all(r.endswith("| not measured |") for r in claims)
