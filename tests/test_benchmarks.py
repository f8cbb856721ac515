"""The kept benchmarks through their command lines (their numbers come from GPUs): the small
shapes that run anywhere, and one-line errors for bad input."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_scale_bound_checks_then_writes_its_ratio_row(tmp_path):
    proc = _run("scale_bound", "--out", str(tmp_path), "--small")
    assert proc.returncode == 0, proc.stderr[-2000:]
    df = pd.read_parquet(tmp_path / "scale_bound.parquet")
    assert len(df) == 1
    r = df.iloc[0]
    assert r["status"] == "ok" and r["rel_err"] < 1e-2  # the timed scale is the right one
    assert abs(r["bound_ms"] * r["copy_gbps"] * 1e6 - 3 * 64 * 128 * 2) < 1e-3
    assert r["ratio"] == r["scale_ms"] / r["bound_ms"]
    assert r["timing"] == "host" and r["scale_eager_ms"] > 0 and r["copy_eager_ms"] > 0
    assert "wrote" in proc.stdout.splitlines()[-1]


def _table(tmp_path, rows: list[dict]) -> str:
    base = dict(experiment="t", status="ok", reason="", cell_hash="h", tokens_per_rank=8, out=8)
    path = tmp_path / "t.parquet"
    pd.DataFrame([{**base, "routing": "b", **r} for r in rows]).to_parquet(path)
    return str(path)


def test_table_summary_reports_the_host_share_and_syncs_of_a_step_where_rows_have_them(tmp_path):
    rows = [
        dict(system="overlap", experts_per_rank=4, latency_ms=0.5, m_host_ms=0.6, m_host_syncs=0),
        dict(system="overlap", experts_per_rank=8, latency_ms=1.0, m_host_ms=0.2, m_host_syncs=0),
        dict(system="serial", experts_per_rank=4, latency_ms=1.0, m_host_syncs=1.0),
        dict(system="serial", experts_per_rank=8, latency_ms=1.0, m_host_syncs=2.0),
        dict(system="tutel", experts_per_rank=8, latency_ms=2.0, status="fail", reason="wrong"),
    ]
    proc = _run("table_summary", _table(tmp_path, rows))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "host time / step (median, max): overlap 0.70, 1.20" in lines
    assert lines[-1] == "host syncs / step (min, max): overlap 0, 0, serial 1, 2"
    assert any(line.startswith("fail: tutel h: wrong") for line in lines)
    bare = [{k: v for k, v in r.items() if not k.startswith("m_")} for r in rows]
    proc = _run("table_summary", _table(tmp_path, bare))
    assert "host" not in proc.stdout


def test_table_summary_by_pivots_the_variants_and_their_speedup_over_serial(tmp_path):
    rows = [
        dict(system="serial", experts_per_rank=4, latency_ms=1.0),
        dict(system="overlap", experts_per_rank=4, latency_ms=0.5, p_layout="compact"),
        dict(system="overlap", experts_per_rank=4, latency_ms=0.8, p_layout=None),
        dict(system="overlap", experts_per_rank=8, latency_ms=0.4, p_layout="compact"),
        dict(system="serial", experts_per_rank=8, latency_ms=9.0, status="fail"),
    ]
    proc = _run("table_summary", _table(tmp_path, rows), "--by", "p_layout,p_consumer")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "x_overlap/compact/" in lines[1] and "x_overlap//" in lines[1]  # no p_consumer
    by_e = {line.split()[0]: line.split()[1:] for line in lines[3:]}  # the one varying key: E
    assert by_e["4"] == ["0.8", "0.5", "1.0", "1.25", "2.0"]
    assert by_e["8"] == ["NaN", "0.4", "NaN", "NaN", "NaN"]  # serial failed: no speedup


@pytest.mark.parametrize("module", ["step_profile"])
def test_the_profilers_say_bad_input_in_one_line_before_any_gpu_work(module):
    cases = [(["--steps", "0"], "error: --steps must be >= 1, got 0")]
    if not torch.cuda.is_available():
        cases.append(([], f"error: {module} profiles CUDA kernels: it needs a CUDA GPU"))
    for args, message in cases:
        proc = _run(module, *args, "--", "experiment=smoke")
        assert proc.returncode == 2 and proc.stderr.strip() == message, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without a GPU")
def test_plan_time_asks_for_the_cpu_device_without_a_gpu():
    proc = _run("plan_time")
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith("no CUDA GPU is present (try --device cpu --small)")
