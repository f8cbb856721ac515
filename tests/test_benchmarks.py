"""The benchmark scripts run end to end on a small shape anywhere (their numbers come from GPUs)."""

import pandas as pd

from benchmarks import scale_bound


def test_scale_bound_writes_its_ratio_row(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["scale_bound", "--out", str(tmp_path), "--small"])
    scale_bound.main()
    df = pd.read_parquet(tmp_path / "scale_bound.parquet")
    assert len(df) == 1
    r = df.iloc[0]
    assert r["rel_err"] < 1e-2  # the timed scale is the right one
    assert abs(r["bound_ms"] * r["copy_gbps"] * 1e6 - 3 * 64 * 128 * 2) < 1e-3
    assert r["ratio"] == r["scale_ms"] / r["bound_ms"]
