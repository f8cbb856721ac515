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


def test_baselines_summary_keeps_the_overlap_layouts_apart():
    import pandas as pd

    from plots.report import _baselines_fig

    work = dict(world_size=2, tokens_per_rank=8, hidden=8, out=8, routing="balanced")
    rows = []
    for e in (4, 8):
        for system, layout, ms in [
            ("serial", None, 2.0),
            ("tutel", None, 1.8),
            ("overlap", "aligned", 1.9),  # 1.05x serial, ahead of tutel
            ("overlap", "compact", 1.0),  # 2.0x serial
        ]:
            rows.append(
                dict(
                    work,
                    experts_per_rank=e,
                    system=system,
                    p_layout=layout,
                    latency_ms=ms,
                    status="ok",
                )
            )
    text = _baselines_fig(pd.DataFrame(rows))
    assert "overlap/aligned vs serial 1.05-1.05x (>= 1.35x in 0/2)" in text
    assert "overlap/compact vs serial 2.00-2.00x (>= 1.35x in 2/2)" in text
    # one layout: named plainly
    one = _baselines_fig(pd.DataFrame([r for r in rows if r["p_layout"] != "compact"]))
    assert one.startswith("2 workloads") and "overlap vs serial 1.05-1.05x" in one
