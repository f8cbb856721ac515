"""The figures issue's experiments (experts, ccta_mgb, correctness): their grids compose, their
plots draw from small synthetic tables, the correctness summary counts a failed row, and the
report says what is not measured yet."""

from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from harness.config import register_configs
from harness.measure import expand_grid
from harness.records import ResultsTable, Row

ROOT = Path(__file__).resolve().parents[1]
CCTAS = [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24]
LAYER_SYSTEMS = {
    "serial",
    "overlap",
    "tutel",
    "tutel_reimpl",
    "fastermoe",
    "fastermoe_reimpl",
    "megatron_cutlass",
    "megatron_te",
}


def _cells(experiment, processes=2):
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}"])
    return cfg, expand_grid(cfg, processes)


def test_experts_grid_is_the_layer_at_the_default_shape_with_every_system():
    cfg, cells = _cells("experts")
    assert len(cells) == 5 * 3 * len(LAYER_SYSTEMS)  # E x routings x systems
    assert {c["system"] for c in cells} == LAYER_SYSTEMS
    assert {c["experts_per_rank"] for c in cells} == {4, 8, 16, 32, 64}
    assert {(c["tokens_per_rank"], c["hidden"], c["out"], c["ffn"]) for c in cells} == {
        (8192, 8192, 8192, 2048)
    }
    assert cfg.experiment.name == "experts"


def test_experts_operator_pass_writes_operator_rows_into_the_experts_table():
    cfg, cells = _cells("experts_operator")
    assert cfg.experiment.name == "experts"  # same table
    assert len(cells) == 5 * 3 * 2  # E x routings x (serial, overlap)
    assert {c["system"] for c in cells} == {"serial", "overlap"}
    assert {(c["hidden"], c["out"], c.get("ffn", 0)) for c in cells} == {(2048, 8192, 0)}
    layer = {c["cell_hash"] for c in _cells("experts")[1]}
    assert not layer & {c["cell_hash"] for c in cells}


def test_ccta_mgb_grid_has_twelve_cctas_two_mgbs_auto_and_serial_once():
    _, cells = _cells("ccta_mgb")
    workloads = 2 * 3  # N x routings
    serial = [c for c in cells if c["system"] == "serial"]
    overlap = [c for c in cells if c["system"] == "overlap"]
    assert len(serial) == workloads
    assert len(overlap) == workloads * 13 * 3  # (12 cCTA + auto) x (1, 2, auto)
    points = {(c["params"]["ccta"], c["params"]["mgb"]) for c in overlap}
    assert {(c, m) for c in CCTAS for m in (1, 2)} <= points
    assert ("auto", "auto") in points
    assert {c["params"]["transport"] for c in overlap} == {"p2p"}
    assert {(c["hidden"], c["experts_per_rank"]) for c in cells} == {(2048, 16)}


@pytest.mark.parametrize(
    "experiment, transport, world",
    [("correctness", "p2p", 2), ("correctness_nvshmem", "nvshmem", 2)],
)
def test_correctness_grid_mirrors_the_paper_per_transport(experiment, transport, world):
    cfg, cells = _cells(experiment)
    assert cfg.experiment.name == "correctness"  # every pass into one table
    assert len(cells) == 3 * 12 * 2 * 2 * 3 * 2  # routings x cCTA x mgb x N x E x layout
    assert {c["params"]["layout"] for c in cells} == {"aligned", "compact"}
    assert {c["params"]["transport"] for c in cells} == {transport}
    assert {c["params"]["ccta"] for c in cells} == set(CCTAS)
    assert {c["world_size"] for c in cells} == {world}
    assert cfg.measure.iters == 1 and cfg.measure.warmup == 0


def test_correctness_passes_are_distinct_cells():
    hashes = [
        {c["cell_hash"] for c in _cells(e)[1]} for e in ("correctness", "correctness_nvshmem")
    ]
    cfg, loop = _cells("correctness_loopback", processes=1)
    assert cfg.hardware.world_size == 1
    assert {c["world_size"] for c in loop} == {4}
    assert {c["params"]["transport"] for c in loop} == {"loopback"}
    assert len(loop) == 864
    assert not hashes[0] & hashes[1] and not hashes[0] & {c["cell_hash"] for c in loop}


def _row(experiment, system, i, **kw):
    base = dict(
        cell_hash=f"{system}{i}",
        world_size=2,
        tokens_per_rank=64,
        hidden=32,
        out=64,
        experts_per_rank=4,
        top_k=2,
        routing="balanced",
        dtype="float16",
        gpu_name="fixture",
        transport="p2p",
        tol=8e-3,
    )
    return Row(experiment, system, **{**base, **kw})


def _correctness_table(path):
    """16 checked overlap rows (one failed: 2e-2) and one skipped row; errors 1e-4 .. 1.5e-3."""
    rows, i = [], 0
    for transport in ("p2p", "nvshmem"):
        for routing in ("balanced", "stress_skew"):
            for ccta in (2, 4):
                for mgb in (1, 2):
                    i += 1
                    rows.append(
                        _row(
                            "correctness",
                            "overlap",
                            i,
                            transport=transport,
                            routing=routing,
                            params={"ccta": ccta, "mgb": mgb},
                            max_rel_err=i * 1e-4 if i != 16 else 2e-2,
                            max_row_rel_err=i * 1e-3 if i != 16 else 0.5,
                            status="fail" if i == 16 else "ok",
                            reason="rel err 2.000e-02 > tol 8.0e-03" if i == 16 else "",
                            latency_ms=1.0,
                        )
                    )
    p = {"ccta": 6, "mgb": 1, "transport": "p2p"}  # skipped before setup: no row.transport
    rows.append(_row("correctness", "overlap", 99, status="skipped", transport="", params=p))
    ResultsTable(path).append(rows)
    return path


def test_correctness_summary_counts_checks_failures_and_errors(tmp_path):
    from plots.correctness import summary

    s = summary(pd.read_parquet(_correctness_table(tmp_path / "c.parquet")))
    a = s.iloc[-1]
    assert a["layout"] == "all"
    assert (a["checks"], a["passed"], a["failed"], a["not_checked"]) == (16, 15, 1, 1)
    assert a["rel_err_max"] == pytest.approx(2e-2)
    assert a["row_err_max"] == pytest.approx(0.5)
    errs = pd.Series([i * 1e-4 for i in range(1, 16)] + [2e-2])
    assert a["rel_err_p50"] == pytest.approx(errs.quantile(0.5))
    per = s.iloc[:-1].set_index("transport")
    assert set(per["layout"]) == {"aligned"} and len(per) == 2  # the skipped row counts as p2p
    assert per.loc["p2p", "passed"] == 8 and per.loc["p2p", "not_checked"] == 1
    assert per.loc["nvshmem", "failed"] == 1


def test_correctness_summary_groups_a_second_layout(tmp_path):
    from plots.correctness import summary

    df = pd.read_parquet(_correctness_table(tmp_path / "c.parquet"))
    df["p_layout"] = ["packed" if i % 2 else None for i in range(len(df))]
    s = summary(df)
    assert set(s["layout"]) == {"aligned", "packed", "all"}
    assert s[s["layout"] != "all"]["checks"].sum() == 16


def _experts_table(path, with_operator=True):
    rows, i = [], 0
    lat = {"overlap": 1.0, "serial": 2.0, "tutel": 3.0, "fastermoe": 4.0, "megatron_te": 1.5}
    for e in (4, 8):
        for system, ms in lat.items():
            i += 1
            kw = dict(hidden=64, out=64, ffn=32, experts_per_rank=e, scope="layer")
            rows.append(_row("experts", system, i, latency_ms=ms * e, **kw))
        i += 1
        why = "tutel_reimpl has no layer scope (FFN experts timed from the tokens)"
        rows.append(
            _row(
                "experts",
                "tutel_reimpl",
                i,
                ffn=32,
                experts_per_rank=e,
                status="skipped",
                reason=why,
            )
        )
        if with_operator:
            for system in ("overlap", "serial"):
                i += 1
                rows.append(
                    _row(
                        "experts", system, i, experts_per_rank=e, latency_ms=1.0, overlap_ratio=0.9
                    )
                )
    ResultsTable(path).append(rows)
    return path


def test_experts_speedups_ratios_and_missing_systems(tmp_path):
    from plots.experts import missing_systems, ratios, speedups

    df = pd.read_parquet(_experts_table(tmp_path / "e.parquet"))
    sp = speedups(df).set_index(["system", "experts_per_rank"])["speedup"]
    assert sp[("fastermoe", 8)] == pytest.approx(4.0)
    assert sp[("megatron_te", 4)] == pytest.approx(1.5)
    assert "overlap" not in sp.index.get_level_values(0)
    assert list(ratios(df)["overlap_ratio"]) == [0.9, 0.9]  # operator rows only
    assert set(missing_systems(df)) == {"tutel_reimpl"}


@pytest.mark.parametrize("with_operator", [True, False])
def test_figures_draw_from_synthetic_tables(tmp_path, with_operator):
    from plots import ccta_mgb, correctness, experts

    tables = {
        experts: _experts_table(tmp_path / "e.parquet", with_operator),
        correctness: _correctness_table(tmp_path / "c.parquet"),
        ccta_mgb: _ccta_table(tmp_path / "m.parquet"),
    }
    for mod, table in tables.items():
        paths = mod.plot(table, tmp_path / "figs", mod.__name__.split(".")[-1])
        assert len(paths) == 2 and all(p.exists() and p.stat().st_size > 0 for p in paths)


def _ccta_table(path):
    """Serial 2 ms; overlap 1 + |ccta - 8| / 4 ms (best at cCTA 8, mgb 2 a bit faster), auto
    picking (8, 1)."""
    rows, i = [], 0
    for routing in ("balanced", "stress_skew"):
        i += 1
        rows.append(
            _row("ccta_mgb", "serial", i, routing=routing, latency_ms=2.0, transport="nccl")
        )
        for ccta in (2, 4, 8, 12):
            for mgb in (1, 2):
                i += 1
                ms = 1.0 + abs(ccta - 8) / 4 - (0.1 if mgb == 2 else 0.0)
                p = {"ccta": ccta, "mgb": mgb, "ccta_used": ccta, "mgb_used": mgb}
                rows.append(
                    _row("ccta_mgb", "overlap", i, routing=routing, params=p, latency_ms=ms)
                )
        i += 1
        p = {"ccta": "auto", "mgb": "auto", "ccta_used": 8, "mgb_used": 1}
        rows.append(_row("ccta_mgb", "overlap", i, routing=routing, params=p, latency_ms=1.0))
    ResultsTable(path).append(rows)
    return path


def test_ccta_mgb_summary_finds_the_best_the_ccta2_slowdown_and_the_auto_pick(tmp_path):
    from plots.ccta_mgb import summary

    s = summary(pd.read_parquet(_ccta_table(tmp_path / "m.parquet")))
    assert len(s) == 2  # one per routing
    r = s.iloc[0]
    assert (r["best_ccta"], r["best_mgb"]) == (8, 2)
    assert r["best_speedup"] == pytest.approx(2.0 / 0.9)
    assert r["ccta2_vs_serial"] == pytest.approx(2.4 / 2.0)  # cCTA 2 slower than serial
    assert r["ccta2_vs_best"] == pytest.approx(2.4 / 0.9)
    assert (r["auto_ccta"], r["auto_mgb"]) == (8, 1)
    assert r["auto_vs_best"] == pytest.approx(1.0 / 0.9)


def test_report_summarises_a_correctness_table_or_says_not_measured(tmp_path):
    from plots.report import render

    text = render(tmp_path, tmp_path)
    assert "| Correctness |" in text and "not measured: `make test-gpu`" in text
    machine = tmp_path / "h200x2"
    machine.mkdir()
    _correctness_table(machine / "correctness.parquet")
    text = render(tmp_path, tmp_path)
    line = next(x for x in text.splitlines() if x.startswith("- `h200x2/correctness`"))
    assert "15 of 17 checks pass" in line and "max rel. error 2.00e-02" in line


def test_ccta_mgb_without_serial_plots_latency(tmp_path):
    from plots import ccta_mgb

    t = _ccta_table(tmp_path / "m.parquet")
    df = pd.read_parquet(t)
    df[df["system"] != "serial"].to_parquet(t)  # a loopback table: serial was skipped
    s = ccta_mgb.summary(pd.read_parquet(t))
    assert s["ccta2_vs_serial"].isna().all() and (s["best_ccta"] == 8).all()
    paths = ccta_mgb.plot(t, tmp_path / "figs", "loopback")
    assert all(p.exists() for p in paths)
