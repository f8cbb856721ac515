"""The CPU preset's functional run (issue 42 #8): the overlap system's Triton kernels in Triton's
CPU interpreter on tiny loopback cells, checked by the harness, never presented as a timing.

The catalogue lets the overlap system onto the CPU only when both HARNESS_FUNCTIONAL=1 and
TRITON_INTERPRET=1 are set (`make functional`): the kernel tests set TRITON_INTERPRET for their
whole process, whose other runs must keep skipping it there."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.records import ResultsTable, Row
from tests import ranks

ROOT = Path(__file__).resolve().parents[1]


def _gate(rank: int, q) -> None:
    """In a fresh process (forked from tests/ranks.py's server, which imported torch only):
    whether the catalogue and triton were still unimported, and why overlap cannot run here."""
    fresh = not [m for m in sys.modules if m.split(".")[0] in ("systems", "triton")]
    import torch

    from harness.system import RunContext, get_system

    ctx = RunContext(0, 1, torch.device("cpu"))
    q.put((fresh, str(get_system("overlap").unavailable_reason(ctx, 2))))


def _env(**set_vars: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("HARNESS_FUNCTIONAL", "TRITON_INTERPRET")
    }
    return {**env, "PYTHONPATH": str(ROOT), **set_vars}


def test_the_catalogue_lets_overlap_onto_the_cpu_in_a_functional_run_only(monkeypatch):
    pytest.importorskip("triton")
    said = {}
    q = ranks.context().SimpleQueue()
    for name, env in (
        ("plain", {}),
        ("interpreter only", {"TRITON_INTERPRET": "1"}),
        ("functional", {"TRITON_INTERPRET": "1", "HARNESS_FUNCTIONAL": "1"}),
    ):
        for var in ("HARNESS_FUNCTIONAL", "TRITON_INTERPRET"):
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        ranks.run_ranks(_gate, (q,), 1)  # a process of its own: the catalogue reads env once
        fresh, said[name] = q.get()
        assert fresh, "the catalogue was imported before this environment was set"
    assert "needs a CUDA GPU" in said["plain"] and "needs a CUDA GPU" in said["interpreter only"]
    assert said["functional"] == "None", said


def _functional_table(path: Path) -> Path:
    rows = []
    for i, (w, status, err) in enumerate(
        [(2, "ok", 3e-4), (4, "ok", 2.9e-4), (4, "fail", 1.4), (2, "error", float("nan"))]
    ):
        rows.append(
            Row(
                "overlap_functional",
                "overlap",
                cell_hash=f"f{i}",
                world_size=w,
                transport="loopback",
                tokens_per_rank=32,
                hidden=32,
                out=64,
                experts_per_rank=2,
                top_k=2,
                routing=("balanced", "stress_skew")[i % 2],
                dtype="float16",
                status=status,
                reason="" if status == "ok" else "x",
                max_rel_err=err,
                tol=8e-3,
                latency_ms=250.0,
                hardware="cpu",
                warmup=0,
                iters=1,
            )  # fmt: skip
        )
    ResultsTable(path).append(rows)
    return path


def test_the_functional_figure_draws_errors_against_the_tolerance_and_says_it_is_no_timing(
    tmp_path, monkeypatch
):
    from plots import functional

    seen = []
    real = functional.save
    monkeypatch.setattr(functional, "save", lambda fig, *a: seen.append((fig, a)) or real(fig, *a))
    paths = functional.plot(_functional_table(tmp_path / "t.parquet"), tmp_path / "f", "fn")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    ((fig, (_, _, title)),) = seen
    assert "functional (Triton interpreter), not a timing" in title and "2 of 4 cells ok" in title
    (ax,) = fig.get_axes()
    assert "error" in ax.get_xlabel() and "latency" not in ax.get_xlabel().lower()
    assert len(ax.patches) == 4 and len(ax.get_yticklabels()) == 4
    # grid order (W, E, routing): each cell's status at its bar
    assert [t.get_text().strip() for t in ax.texts] == ["ok", "error", "fail", "ok"]


def test_the_functional_run_checks_the_overlap_kernels_in_the_interpreter(tmp_path):
    """One run, W=2 played in one process: the operator scope (ffn 0) and the layer scope (ffn
    64: the device dispatch, stage A, fc1, fc2 with the combine, the scale, then its error
    check), each checked against the reference; and the W=1 layer, whose fc2 is the producer
    alone (no consumer, no cCTA: nothing to combine)."""
    pytest.importorskip("triton")
    table = tmp_path / "overlap_functional.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "experiment=overlap_functional", "hardware=cpu",
         f"table={table}", "experiment.grid.routing=[balanced]", "experiment.grid.world_size=[1,2]",
         "experiment.grid.ffn=[0,64]", "hardware.timeout_s=120"],
        cwd=ROOT, env=_env(TRITON_INTERPRET="1", HARNESS_FUNCTIONAL="1"), capture_output=True,
        text=True, timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    df = pd.read_parquet(table).sort_values("ffn")
    one = df[(df["world_size"] == 1) & (df["ffn"] == 64)]
    assert len(one) == 1 and (one["status"] == "ok").all(), one[["status", "reason"]]
    assert int(one["p_ccta_used"].iloc[0]) == 0
    assert json.loads(one["extra"].iloc[0])["consumer_sms"] == "none"
    df = df[df["world_size"] == 2]
    assert set(df["experiment"]) == {"overlap_functional"} and set(df["system"]) == {"overlap"}
    assert list(df["world_size"]) == [2, 2] and set(df["transport"]) == {"loopback"}
    assert list(df["ffn"]) == [0, 64] and list(df["p_dispatch_used"].fillna("")) == ["", "device"]
    assert (df["status"] == "ok").all(), df[["ffn", "status", "reason"]]
    assert (df["max_rel_err"] < df["tol"]).all()
