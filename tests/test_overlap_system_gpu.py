"""GPU tier: the overlap system against the reference, and its row placement against stage A's
CPU oracle, oracle_cpu.py (exactly, on integer-valued inputs where every GEMM is exact)."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from harness.layout import rank_layout
from harness.workload import WorkloadSpec
from systems.overlap.plan import padded_input, plan_for_layout
from tests.oracle_cpu import _copy_local, produce

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def test_overlap_equals_reference_on_loopback_grid(tmp_path):
    """3 routings x W in {1,2,4,8} x cCTA in {2..24} x mgb {1,2} x fp16/bf16, all ok."""
    table = tmp_path / "overlap_check.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "experiment=overlap_check", f"table={table}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df = pd.read_parquet(table)
    assert len(df) == 3 * 4 * 6 * 2 * 2
    bad = df[df["status"] != "ok"]
    assert bad.empty, bad[["world_size", "p_ccta", "p_mgb", "dtype", "routing", "reason"]].head()
    assert (df["max_rel_err"] < 8e-3).all()
    assert (df["transport"] == "loopback").all()


@pytest.mark.parametrize("routing", ["balanced", "stress_skew"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mgb", [1, 2])
@pytest.mark.parametrize("layout", ["aligned", "compact"])
@pytest.mark.parametrize("order", ["remote_first", "expert"])
def test_row_placement_equals_cpu_oracle(routing, world, mgb, layout, order):
    """Every destination buffer of the loopback system equals the CPU oracle's (the producer
    stores the local rows in the own buffer itself; order expert: the producer visits the
    bands in another order, the rows delivered are the same)."""
    from systems.overlap.operator import OperatorRank
    from systems.overlap.params import OverlapParams
    from systems.overlap.transport import LoopbackFabric

    spec = WorkloadSpec(
        tokens_per_rank=160,
        hidden=64,
        out=256,
        experts_per_rank=3,
        top_k=2,
        world_size=world,
        routing=routing,
        dtype="float16",
    )
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(world * 10 + mgb)
    rows = spec.tokens_per_rank * spec.top_k
    fabric = LoopbackFabric([rows] * world, spec.out, torch.float16, dev)
    cpu_backs = [torch.zeros(rows, spec.out) for _ in range(world)]
    knobs = OverlapParams(ccta=4, mgb=mgb, tile_m=64, layout=layout, order=order)
    ranks = []
    for r in range(world):
        lay = rank_layout(spec, r)
        R = lay.recv_src.numel()
        x = torch.randint(-2, 3, (R, spec.hidden), generator=gen).half()
        w = torch.randint(-2, 3, (3, spec.hidden, spec.out), generator=gen).half()
        t = fabric.transport(r)
        inp = SimpleNamespace(spec=spec, layout=lay, x_recv=x.to(dev), weights=w.to(dev))
        rk = OperatorRank(inp, t, knobs)
        assert (rk.plan.layout, rk.plan.order) == (layout, order)
        ranks.append(rk)
        plan = plan_for_layout(
            lay,
            world_size=world,
            experts_per_rank=3,
            tile_m=64,
            mgb=mgb,
            out_cols=spec.out,
            elem_bytes=2,
            layout=layout,
        )
        xp = padded_input(x.float(), plan.gather_index)

        def send(seg, dst, offset, block):
            cpu_backs[dst][offset : offset + block.shape[0]] = block

        y = produce(plan, xp, w.float(), send)
        _copy_local(plan, y, cpu_backs[r])
    for rk in ranks:
        rk.step()
    torch.cuda.synchronize()
    for rk in ranks:
        rk.runner.check()
    for d in range(world):
        assert torch.equal(fabric.recv(d).float().cpu(), cpu_backs[d]), f"destination {d}"


def test_auto_ccta_mgb_run_and_report_what_they_used(tmp_path):
    """ccta=auto, mgb=auto next to a fixed cell in one table: both ok, the ask kept in p_ccta,
    the used values in p_ccta_used / p_mgb_used, the reason in extra."""
    table = tmp_path / "auto.parquet"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.run",
            "experiment=overlap_check",
            f"table={table}",
            "experiment.systems.overlap.sweep.ccta=[8,auto]",
            "experiment.systems.overlap.sweep.mgb=[auto]",
            "experiment.grid.world_size=[4]",
            "experiment.grid.dtype=[bfloat16]",
            "experiment.grid.routing=[stress_skew]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df = pd.read_parquet(table)
    assert (df["status"] == "ok").all(), df[["p_ccta", "reason"]]
    assert sorted(df["p_ccta"]) == ["8", "auto"] and (df["p_mgb"] == "auto").all()
    assert (df["p_ccta_used"] >= 1).all() and (df["p_mgb_used"] >= 1).all()
    assert df[df["p_ccta"] == "8"]["p_ccta_used"].tolist() == [8]
    assert df["extra"].str.contains('"auto"').all()


def test_shared_consumer_equals_reference_on_loopback(tmp_path):
    """consumer=shared (small consumer CTAs next to the producer on every SM): W 2 and 4, cCTA
    4 and every SM, aligned and compact, fp16 and bf16, three routings: all ok."""
    table = tmp_path / "shared.parquet"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.run",
            "experiment=overlap_check",
            f"table={table}",
            f"experiment.systems.overlap.sweep.ccta=[4,{sms}]",
            "experiment.systems.overlap.sweep.mgb=[2]",
            "+experiment.systems.overlap.sweep.consumer=[shared]",
            "+experiment.systems.overlap.sweep.layout=[aligned,compact]",
            "experiment.grid.world_size=[2,4]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df = pd.read_parquet(table)
    assert len(df) == 2 * 2 * 2 * 2 * 3
    bad = df[df["status"] != "ok"]
    assert bad.empty, bad[["world_size", "p_ccta", "p_layout", "routing", "reason"]].head()
    assert (df["max_rel_err"] < 8e-3).all() and (df["p_consumer"] == "shared").all()
    assert df["extra"].str.contains('"consumer_sms": "shared"').all()
    assert df["extra"].str.contains('"consumers_beside_producer": ').all()
