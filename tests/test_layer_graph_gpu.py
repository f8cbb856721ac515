"""GPU tier: the host-free layer (harness/dispatch_device.py) timed as CUDA-graph replays, at
W=1 and with one GPU playing W = 2, 4, 8 ranks (loopback), every layout; both checks."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu
SHAPE = (
    "experiment.grid.tokens_per_rank=[512]", "experiment.grid.hidden=[256]",
    "experiment.grid.out=[256]", "experiment.grid.ffn=[512]",
    "experiment.grid.experts_per_rank=[4]", "experiment.grid.routing=[balanced,stress_skew]",
    "measure.iters=3", "measure.warmup=1",
)  # fmt: skip


def run(table, *overrides) -> pd.DataFrame:
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "hardware=h200", "hardware.world_size=1",
         "progress=false", f"table={table}", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return pd.read_parquet(table)


def test_serial_and_overlap_layers_at_w1_are_graphed_and_right(tmp_path):
    df = run(
        tmp_path / "w1.parquet",
        "experiment=layer_smoke",
        "experiment.select=[serial,overlap]",
        *SHAPE,
    )
    assert set(df["status"]) == {"ok"}, df[["system", "status", "reason"]]
    assert df["graph"].all(), df[["system", "graph_reason"]]
    assert (df["p_dispatch_used"] == "device").all()
    assert (df["max_row_rel_err"] < 8e-2).all() and (df["m_host_syncs"] == 0).all()


def test_the_nccl_dispatch_runs_eager_and_says_why(tmp_path):
    df = run(
        tmp_path / "nccl.parquet",
        "experiment=layer_smoke",
        "experiment.select=[overlap]",
        "+experiment.systems.overlap.params.dispatch=nccl",
        *SHAPE,
    )
    assert set(df["status"]) == {"ok"} and not df["graph"].any()
    assert df["graph_reason"].str.contains("host sync").all()


@pytest.mark.parametrize("layout", ["aligned", "compact"])
def test_loopback_layers_at_w_2_4_8_are_right_and_state_their_receive_memory(tmp_path, layout):
    df = run(
        tmp_path / f"{layout}.parquet",
        "experiment=layer_smoke",
        "experiment.select=[overlap]",
        "experiment.grid.world_size=[2,4,8]",
        "+experiment.systems.overlap.params.transport=loopback",
        f"+experiment.systems.overlap.params.layout={layout}",
        *SHAPE,
    )
    assert len(df) == 6 and set(df["status"]) == {"ok"}, df[["world_size", "status", "reason"]]
    assert df["graph"].all(), df[["world_size", "graph_reason"]]
    assert (df["max_rel_err"] < 8e-3).all() and (df["max_row_rel_err"] < 8e-2).all()
    mib = df["m_recv_worst_mib"]
    W = df["world_size"]
    assert (mib == W * W * 512 * 2 * 256 * 2 / 2**20).all()
