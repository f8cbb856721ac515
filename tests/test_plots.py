"""Every figure script draws from a fixture table (no GPU, no real results needed)."""

from pathlib import Path

import pandas as pd

from harness.records import ResultsTable, Row

ROOT = Path(__file__).resolve().parents[1]


def _fixture(path, experiment, systems):
    rows = []
    for system in systems:
        for routing in ("balanced", "stress_skew"):
            for e in (2, 4):
                for ccta in (4, 8):
                    for mgb in (1, 2):
                        rows.append(
                            Row(
                                experiment,
                                system,
                                cell_hash=f"{system}{routing}{e}{ccta}{mgb}",
                                world_size=4,
                                transport="loopback",
                                tokens_per_rank=64,
                                hidden=32,
                                out=32,
                                experts_per_rank=e,
                                top_k=2,
                                routing=routing,
                                dtype="float16",
                                params={"ccta": ccta, "mgb": mgb},
                                latency_ms=1.0 + e,
                                latency_p10_ms=0.9 + e,
                                latency_p90_ms=1.1 + e,
                                compute_ms=1.0,
                                comm_ms=0.5,
                                overlap_ratio=0.8,
                                gpu_name="fixture",
                            )
                        )
    ResultsTable(path).append(rows)
    return path


def test_latency_and_ccta_figures(tmp_path):
    from plots import ccta_sweep, latency_vs_experts, speedup_vs_serial

    t = _fixture(tmp_path / "t.parquet", "x", ["serial", "overlap"])
    assert len(pd.read_parquet(t)) == 32
    for mod, name in ((latency_vs_experts, "lat"), (ccta_sweep, "ccta"), (speedup_vs_serial, "sp")):
        paths = mod.plot(t, tmp_path / "figs", name)
        assert all(p.exists() and p.stat().st_size > 0 for p in paths)


def test_speedup_takes_each_systems_best_cell(tmp_path):
    from plots.speedup_vs_serial import speedups

    df = pd.read_parquet(_fixture(tmp_path / "t.parquet", "x", ["serial", "overlap"]))
    df.loc[df.system == "overlap", "latency_ms"] /= 2  # overlap twice as fast in every cell
    df.loc[(df.system == "overlap") & (df.p_ccta == 8), "latency_ms"] /= 2  # and 4x at cCTA 8
    sp = speedups(df)
    assert len(sp) == 2 * 2 * 2  # systems x routings x expert counts
    assert set(sp[sp.system == "serial"]["speedup"]) == {1.0}
    assert set(sp[sp.system == "overlap"]["speedup"].round(6)) == {4.0}


def test_latency_figure_reads_tables_older_than_the_scope_column(tmp_path):
    from plots import latency_vs_experts

    t = _fixture(tmp_path / "t.parquet", "x", ["serial", "overlap"])
    pd.read_parquet(t).drop(columns=["scope"]).to_parquet(t)
    paths = latency_vs_experts.plot(t, tmp_path / "figs", "old")
    assert all(p.exists() for p in paths)


def test_overlap_variant_names_transport_and_the_kept_knobs_off_their_defaults():
    from plots.common import overlap_variant

    df = pd.DataFrame(
        {
            "system": ["overlap", "overlap", "overlap", "serial"],
            "transport": ["p2p", "p2p", "nvshmem", "nccl"],
            "p_layout": [None, "aligned", "compact", None],
            "p_order": ["auto", "expert", "remote_first", None],
        }
    )
    assert list(overlap_variant(df)) == ["p2p", "p2p, expert order", "nvshmem, compact", ""]
    df["p_consumer"] = [None, "shared", "own", None]
    df["p_ccta"] = ["16", "132", "16", None]
    assert overlap_variant(df)[1] == "p2p, expert order, shared SMs, cCTA 132"


def test_variants_speedups_pair_each_variant_with_serial():
    from plots.variants import speedups

    w = {"world_size": 2, "tokens_per_rank": 8, "hidden": 4, "out": 4, "experts_per_rank": 2}
    o = {**w, "routing": "balanced", "system": "overlap"}
    df = pd.DataFrame(
        [
            {**w, "routing": "balanced", "system": "serial", "latency_ms": 2.0},
            {**o, "latency_ms": 1.0, "p_layout": None, "p_order": "expert"},
            {**o, "latency_ms": 0.5, "p_layout": "compact", "p_order": None},
        ]
    )
    sp = speedups(df).set_index("variant")["speedup"]
    assert sp["aligned/expert"] == 2.0 and sp["compact"] == 4.0
    alone = speedups(df[df["system"] == "overlap"])  # no serial: latency only
    assert alone["speedup"].isna().all() and sorted(alone["latency_ms"]) == [0.5, 1.0]


def test_variants_name_a_ccta_or_mgb_other_than_the_default():
    from plots.variants import speedups

    w = {"world_size": 2, "tokens_per_rank": 8, "hidden": 4, "out": 4, "experts_per_rank": 2}
    o = {**w, "routing": "balanced", "system": "overlap"}
    df = pd.DataFrame(
        [
            {**w, "routing": "balanced", "system": "serial", "latency_ms": 2.0},
            {**o, "latency_ms": 1.0, "p_ccta": 16.0, "p_mgb": 1.0},
            {**o, "latency_ms": 0.8, "p_ccta": "auto", "p_mgb": "auto"},
        ]
    )
    assert sorted(speedups(df)["variant"]) == ["aligned", "aligned, cCTA auto, mgb auto"]


def test_variants_and_producer_figures_draw_from_the_committed_tables(tmp_path):
    from plots import producer, variants

    for mod, stem in ((variants, "h200/operator_layouts_loopback"), (producer, "h200/producer")):
        paths = mod.plot(ROOT / f"results/reference/{stem}.parquet", tmp_path, stem[5:])
        assert all(p.exists() and p.stat().st_size > 0 for p in paths)


def test_placement_figure_draws_each_placement_from_the_committed_table(tmp_path):
    import pytest

    from plots import placement

    table = ROOT / "results/reference/h200/operator_consumer_loopback.parquet"
    paths = placement.plot(table, tmp_path, "placement")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    bad = tmp_path / "bad.parquet"
    pd.DataFrame([{"system": "serial", "status": "ok", "latency_ms": 1.0}]).to_parquet(bad)
    with pytest.raises(ValueError, match="no ok overlap rows"):
        placement.plot(bad, tmp_path, "bad")
