"""The Fig 3a experiment: cells, validation, the sending plan, and the reference's data movement
on gloo ranks (the consumer itself needs a GPU: its rows are skipped here, run in the GPU tier)."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments.bandwidth import REFERENCE as REF
from experiments.bandwidth import expected_region, sender_plan, sizes
from tests.inprocess import launch
from tests.overlap_testing import expected_sends

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "experiment=bandwidth",
    "progress=false",
    "hardware.name=cpu",  # the experiment file sets the h200 preset's keys; take them back
    "hardware.device=cpu",
    "hardware.backend=gloo",
    "experiment.options.segment_kib=[1,4]",
    "experiment.options.min_total_mib=1",
    "experiment.grid.out=[64]",
    "experiment.systems.overlap.sweep.ccta=[2]",
]


def _run(*overrides, timeout=240):
    cmd = [sys.executable, "-m", "harness.run", *TINY, *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("W,me", [(2, 0), (3, 1), (4, 3)])
def test_sender_plan_sends_every_row_to_a_peer_in_its_own_region(W, me):
    cell = {"out": 64, "dtype": "bfloat16", "segment_kib": 1, "min_total_mib": 1}
    rows_per_seg, n_seg, row_bytes = sizes(cell, 2)
    assert rows_per_seg * row_bytes == 1024 and n_seg % 2 == 0
    plan = sender_plan(me, W, rows_per_seg, n_seg, "cpu")
    y = torch.randn(plan.n_padded, 64)
    per_dst = W * n_seg * rows_per_seg
    want = expected_sends(plan, y, [torch.zeros(per_dst, 64) for _ in range(W)])
    for d in range(W):
        got = torch.zeros(per_dst, 64)
        expected_region(plan, y, d, got)
        assert torch.equal(got, want[d])
        written = got.abs().sum(1) > 0
        lo = me * n_seg * rows_per_seg  # this source's region of every receiver
        assert not written[:lo].any() and not written[lo + n_seg * rows_per_seg :].any()
    assert not want[me].any()  # nothing to itself


def test_cells_and_a_bad_option_before_any_process(capsys):
    assert launch(*TINY, "dry_run=true", "hardware.world_size=3", ranks=False) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.split()[1:2] in (["overlap"], [REF])]
    assert len(lines) == 2 * 2 + 2  # 2 sizes x (loopback, p2p) + the reference per size
    bad = _run("dry_run=true", "hardware.world_size=3", "+experiment.options.segment_kb=[1]")
    assert bad.returncode != 0 and "unknown option(s) ['segment_kb']" in bad.stdout + bad.stderr


def test_reference_moves_the_right_rows_on_gloo(tmp_path):
    table = tmp_path / "bw.parquet"
    assert launch(*TINY, f"table={table}", "hardware.world_size=3") == 0
    df = pd.read_parquet(table)
    ref = df[df.system == "nccl_all_to_all"]
    assert len(ref) == 2 and (ref.status == "ok").all(), ref[["status", "reason"]]
    assert (
        (ref.max_rel_err == 0).all() and (ref.m_gbps > 0).all() and (ref.transport == "gloo").all()
    )
    cons = df[df.system == "overlap"]
    assert len(cons) == 4 and (cons.status == "skipped").all()
    assert cons.reason.str.contains("CUDA GPU").all()


@pytest.mark.gpu
def test_loopback_consumer_rows_on_one_gpu(tmp_path):
    table = tmp_path / "bw.parquet"
    gpu = ["hardware.name=h200", "hardware.device=cuda", "hardware.backend=nccl"]
    proc = _run(f"table={table}", *gpu, "hardware.world_size=1", timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    df = pd.read_parquet(table)
    loop = df[df.p_transport == "loopback"]
    assert len(loop) == 2 and (loop.status == "ok").all(), loop[["status", "reason"]]
    assert (loop.m_gbps > 0).all() and (loop.world_size == 4).all()
    assert (df[df.p_transport != "loopback"].status == "skipped").all()


@pytest.mark.parametrize(
    "option, message",
    [
        ("experiment.options.min_total_mib=abc", "options.min_total_mib must be an integer"),
        ("experiment.options.loopback_ranks=1", "options.loopback_ranks must be >= 2, got 1"),
        ("experiment.options.segment_kib=16", "options.segment_kib must be a non-empty list"),
        (
            "+experiment.systems.overlap.params.consumer=shared",
            "bandwidth uses overlap's ccta, transport only; consumer='shared' would be ignored",
        ),
    ],
)
def test_an_option_of_the_wrong_kind_is_one_line(option, message):
    """Checked when the cells are made, before any process: not a failing worker."""
    from hydra import compose, initialize_config_dir

    from experiments import bandwidth
    from harness.config import register_configs

    register_configs()
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(conf, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=bandwidth", "hardware=cpu", option])
    with pytest.raises(ValueError) as exc:
        bandwidth.cells(cfg, 1)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_loopback_fabric_larger_than_the_memory_is_one_line(monkeypatch):
    """W x W receive regions of the largest cell: W=64 would need about 1.5 TiB."""
    from hydra import compose, initialize_config_dir

    from experiments import bandwidth
    from harness.config import register_configs

    register_configs()
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(conf, version_base="1.3"):
        base = ["experiment=bandwidth", "hardware=h200", "hardware.world_size=1"]
        ok = compose("config", overrides=base)
        big = compose("config", overrides=[*base, "experiment.options.loopback_ranks=64"])
    monkeypatch.setattr(bandwidth, "memory_bytes", lambda cfg: 64 << 30)
    bandwidth.validate(ok, bandwidth.cells(ok, 1), 0)  # 4 ranks: 6 GiB
    assert bandwidth.loopback_bytes(bandwidth.cells(ok, 1)) == 6 << 30
    with pytest.raises(ValueError) as exc:
        bandwidth.validate(big, bandwidth.cells(big, 1), 0)
    assert "loopback_ranks=64 needs 1536.0 GiB" in str(exc.value)
    assert "more than the 64.0 GiB here" in str(exc.value) and "\n" not in str(exc.value)
    # with several processes (or on the CPU) the loopback cells are skipped: nothing to check
    with initialize_config_dir(conf, version_base="1.3"):
        two = compose(
            "config",
            overrides=[
                "experiment=bandwidth",
                "hardware=h200",
                "hardware.world_size=2",
                "experiment.options.loopback_ranks=64",
            ],
        )
    bandwidth.validate(two, bandwidth.cells(two, 2), 0)
