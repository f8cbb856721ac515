"""GPU tier: the smoke experiment with one process per GPU over NCCL, and GPU input errors."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def run(*overrides):
    return subprocess.run(
        [sys.executable, "-m", "harness.run", "hardware=h200", "progress=false", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_smoke_on_gpus_with_nccl(tmp_path):
    table = tmp_path / "smoke.parquet"
    proc = run(f"table={table}", "experiment.grid.dtype=[bfloat16]")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    df = pd.read_parquet(table)
    assert set(df["status"]) == {"ok"}, df[["status", "reason"]]
    assert (df["world_size"] == torch.cuda.device_count()).all()
    assert (df["transport"] == "nccl").all()
    assert (df["max_rel_err"] < 8e-3).all() and (df["latency_ms"] > 0).all()


def test_more_ranks_than_gpus_is_refused(tmp_path):
    n = torch.cuda.device_count()
    proc = run(f"table={tmp_path / 't.parquet'}", f"hardware.world_size={n + 1}")
    assert proc.returncode != 0 and "GPU(s) are present" in proc.stdout + proc.stderr


def test_ccta_at_sm_count_is_refused(tmp_path):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    proc = run(f"table={tmp_path / 't.parquet'}", f"+experiment.systems.overlap.params.ccta={sms}")
    assert proc.returncode != 0 and f"must be in [1, {sms})" in proc.stdout + proc.stderr
