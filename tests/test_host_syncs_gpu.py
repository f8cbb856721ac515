"""GPU tier: the host synchronisations of a timed step (harness.timing.count_host_syncs, the
rows' m_host_syncs), and expert_gemm's offsets copied without one."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.experts import expert_gemm
from harness.timing import count_host_syncs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def test_count_host_syncs_counts_each_wait_of_the_host():
    x = torch.ones(8, device=DEV)
    assert count_host_syncs(lambda: x * 2, DEV) == 0
    assert count_host_syncs(lambda: x.sum().item(), DEV) == 1
    assert count_host_syncs(lambda: (x.sum().item(), x.tolist()), DEV) == 2
    # the serial baseline's old offsets: a blocking copy from pageable memory
    assert count_host_syncs(lambda: torch.tensor([1, 2, 3], device=DEV), DEV) == 1
    event = torch.cuda.Event()
    event.record()
    # not flagged by torch: counted apart (looked up at the call, as Megatron's d2h_event)
    assert count_host_syncs(lambda: event.synchronize(), DEV) == 1
    assert torch.cuda.get_sync_debug_mode() == 0  # restored
    assert torch.cuda.Event.synchronize is torch.cuda.streams.Event.synchronize


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="torch._grouped_mm needs Hopper",
)
def test_expert_gemm_without_offs_does_not_synchronise_and_is_right():
    counts = [3, 0, 130, 7]
    x = torch.randn(sum(counts), 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(len(counts), 64, 32, device=DEV, dtype=torch.bfloat16)
    expert_gemm(x, counts, w)  # warm-up: the first call may load kernels
    assert count_host_syncs(lambda: expert_gemm(x, counts, w), DEV) == 0
    y = expert_gemm(x, counts, w).float()
    start = 0
    for e, c in enumerate(counts):
        ref = x[start : start + c].float() @ w[e].float()
        torch.testing.assert_close(y[start : start + c], ref, rtol=2e-2, atol=2e-1)
        start += c


def run(table, *overrides):
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "hardware=h200", "hardware.world_size=1",
         "progress=false", f"table={table}", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df = pd.read_parquet(table)
    assert set(df["status"]) == {"ok"}, df[["system", "status", "reason"]]
    return df.set_index("system")["m_host_syncs"]


def test_operator_steps_of_serial_and_overlap_never_wait_for_the_device(tmp_path):
    syncs = run(
        tmp_path / "op.parquet", "experiment=operator", "experiment.select=[serial,overlap]",
        "experiment.grid.tokens_per_rank=[1024]", "experiment.grid.out=[4096]",
        "experiment.grid.experts_per_rank=[4]", "experiment.grid.routing=[stress_skew]",
        "measure.iters=3", "measure.warmup=1",
    )  # fmt: skip
    assert syncs.to_dict() == {"serial": 0.0, "overlap": 0.0}


def test_layer_step_of_serial_waits_only_with_the_nccl_dispatch(tmp_path):
    # W=1: the device dispatch (the default) needs no host sync, the NCCL one its split sizes'
    base = ("experiment=layer_smoke", "experiment.select=[serial]", "measure.graph=false")
    syncs = run(tmp_path / "layer.parquet", *base, "experiment.grid.routing=[balanced]")
    assert syncs.to_dict() == {"serial": 0.0}
    nccl = "+experiment.systems.serial.params.dispatch=nccl"
    syncs = run(tmp_path / "nccl.parquet", *base, "experiment.grid.routing=[balanced]", nccl)
    assert syncs.to_dict() == {"serial": 1.0}
