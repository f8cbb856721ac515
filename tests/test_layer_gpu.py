"""GPU tier: every system in the layer scope (FFN experts, timed from the tokens and routing) on
a small cell, one process per GPU present; checked against the float32 oracle."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def test_layer_smoke_every_system_ok_or_skipped_with_a_reason(tmp_path):
    table = tmp_path / "layer_smoke.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "experiment=layer_smoke", f"table={table}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    df = pd.read_parquet(table)
    bad = df[df["status"].isin(["fail", "error"])]
    assert bad.empty, bad[["system", "routing", "status", "reason"]].to_string()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ok = df[df["status"] == "ok"]
    assert {"serial", "overlap"} <= set(ok["system"]), df[["system", "status", "reason"]]
    assert (ok["scope"] == "layer").all() and (ok["ffn"] == 512).all()
    assert (ok["max_rel_err"] < 8e-3).all()
    skipped = df[df["status"] == "skipped"]
    assert skipped["reason"].str.len().gt(0).all()
