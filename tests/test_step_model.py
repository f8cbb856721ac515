"""The step model (harness/step_model.py) on hand-made cases with known answers, its calibration
against conf/node/h200.yaml, the predict command and the projection's figure and section."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from harness import step_model as sm
from systems.overlap.plan import plan_from_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def node(**kw) -> sm.Node:
    """The H200 preset with the round numbers a test sets."""
    return dataclasses.replace(sm.load_node("h200"), **kw)


def plan(rows, rank=0, mgb=1, layout="aligned", order="remote_first") -> dict:
    p = plan_from_rows(rows, rank=rank, tile_m=128, mgb=mgb, layout=layout, order=order)
    return sm.plan_arrays(p)


def test_a_compute_bound_step_is_the_producer_on_the_sms_left():
    # rank 0 of W=2, 2 experts: 512 remote + 512 local rows each -> 16 bands of 32 tiles
    pl = plan([[512, 512], [512, 512]])
    n = node(tile_us=10.0, strip_us=0.0, seg_lat_us=0.0, cta_gbps=1e6, link_gbps=1e6)
    end, alone, comm = sm.overlap_rank(pl, 8192, 2048, n, ccta=4, loop=False)
    assert end == pytest.approx(16 * 32 * 10.0 / (132 - 4))
    assert alone == pytest.approx(16 * 32 * 10.0 / 132)
    assert comm < 0.1  # us: 2 MiB segments at 1e6 GB/s


def test_a_link_bound_step_is_the_bytes_at_the_link():
    # 8 remote bands of 128 rows x 8192 bf16 (2 MiB each), the producer instant
    pl = plan([[0, 1024]])  # rows[e][s]: owner 1
    n = node(tile_us=1e-6, strip_us=0.0, seg_lat_us=0.0, cta_gbps=1e6, link_gbps=100.0)
    end, _, comm = sm.overlap_rank(pl, 8192, 2048, n, ccta=4, loop=False)
    assert comm == pytest.approx(8 * 128 * 8192 * 2 / 100e3)  # us at 100 GB/s
    assert end == pytest.approx(comm, rel=1e-6)


def test_the_segment_size_curve_rises_to_a_programs_rate_then_the_links():
    lat, cta, link = 2.0, 40.0, 300.0
    for ccta in (1, 4, 16):
        gbps = []
        for kib in (16, 64, 256, 1024, 4096, 16384):
            b = kib * 1024
            done = sm.consume(
                np.zeros(64), np.full(64, b), np.ones(64), ccta, lat, cta, link, False
            )
            gbps.append(64 * b / done.max() / 1e3)
        per = min(cta, link / ccta)  # every program busy: the link shared
        assert gbps == sorted(gbps)
        assert gbps[0] == pytest.approx(ccta * 16384 / (lat * 1e3 + 16384 / per), rel=1e-9)
        assert gbps[-1] == pytest.approx(ccta * per, rel=0.01)


def test_pairwise_links_share_per_destination_only():
    args = (np.zeros(4), np.full(4, 1e6), np.array([1, 2, 3, 1]), 4, 0.0, 1e3, 100.0)
    assert sm.consume(*args, True).max() == pytest.approx(1e6 / 50e3)  # two to rank 1
    assert sm.consume(*args, False).max() == pytest.approx(1e6 / 25e3)  # four on one link


def test_a_routing_whose_padding_doubles_a_band_doubles_the_producer():
    # W=3, rank 0's expert holds 64 rows from each remote owner: aligned pads each to a band
    # (2 bands for 128 rows), compact packs them into one
    n = node(strip_us=0.0)
    aligned = sm.overlap_rank(plan([[0, 64, 64]]), 4096, 2048, n, 8, False)[1]
    compact = sm.overlap_rank(plan([[0, 64, 64]], layout="compact"), 4096, 2048, n, 8, False)[1]
    assert aligned == pytest.approx(2 * compact)


def test_the_h200_preset_is_its_calibration():
    fitted = sm.fit(ROOT / "results" / "reference")
    preset = yaml.safe_load((ROOT / "conf" / "node" / "h200.yaml").read_text())
    assert fitted.keys() <= preset.keys()
    for k, v in fitted.items():
        assert preset[k] == pytest.approx(v, rel=0.02, abs=0.5), k
    for name in ("h100", "a100_pairwise"):  # every preset loads into the typed node
        assert sm.load_node(name).name == name
    with pytest.raises(ValueError, match="choices: a100_pairwise, h100, h200"):
        sm.load_node("h300")


def test_predict_marks_serial_and_overlap_rows_and_passes_the_rest(tmp_path):
    from experiments import predict

    base = dict(scope="gemm+combine", status="ok", world_size=2, tokens_per_rank=256,
                hidden=256, out=512, ffn=0, experts_per_rank=4, top_k=2, routing="stress_skew",
                dtype="bfloat16", transport="p2p", latency_ms=1.0)  # fmt: skip
    rows = [
        base | {"system": "serial"},
        base | {"system": "overlap", "p_ccta_used": 8.0},
        base | {"system": "tutel"},
        base | {"system": "overlap", "scope": "combine"},
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "in.parquet")
    predict.main(["--cells", str(tmp_path / "in.parquet"), "--out", str(tmp_path / "o.parquet"),
                  "hardware=h200"])  # fmt: skip
    out = pd.read_parquet(tmp_path / "o.parquet")
    assert out["m_pred_ms"].notna().tolist() == [True, True, False, False]
    assert (out.loc[:1, "m_pred_ms"] > out.loc[:1, "m_pred_compute_ms"]).all()
    assert out["latency_ms"].tolist() == [1.0] * 4 and set(out["pred_node"]) == {"h200"}
    with pytest.raises(SystemExit):
        predict.main(["--cells", str(tmp_path / "in.parquet"), "--out", "x", "hardware=nope"])


def test_the_projection_figure_and_section(tmp_path):
    from plots import projection

    paths = projection.plot(projection.PROJECTION, tmp_path, "proj")
    assert [p.name for p in paths] == ["proj.png", "proj.pdf"]
    text = projection.report_section()
    assert "(predictions)" in text and "`h200x2/operator`" in text and "a100_pairwise" in text
    assert len(text.encode()) < 3500
