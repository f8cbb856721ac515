"""ccta="auto" / mgb="auto" of the overlap system (CPU): the calibration table, the rule, the
system's validation and host-side resolution, and the fit script's held-out evaluation."""

from dataclasses import asdict
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from harness.records import ResultsTable, Row
from harness.system import RunContext
from harness.workload import WorkloadSpec
from systems.overlap import autotune
from systems.overlap import autotune_fit as fit
from systems.overlap import system as osys


def spec(T=8192, K=2048, N=8192, E=16, W=4, routing="balanced"):
    return WorkloadSpec(
        tokens_per_rank=T,
        hidden=K,
        out=N,
        experts_per_rank=E,
        top_k=2,
        world_size=W,
        routing=routing,
        dtype="bfloat16",
    )


def test_committed_table_loads_and_is_small():
    df = autotune.load_table()
    assert set(autotune.COLUMNS) <= set(df.columns)
    assert set(df["consumer"]) <= set(autotune.CONSUMER_SMS)  # "own" where the csv has none
    assert len(df) > 0 and autotune.TABLE.stat().st_size < 32_000
    assert (df.groupby(["routing", "transport"])["rel_latency"].min() == 1.0).all()


@pytest.mark.parametrize(
    "s, transport, sm",
    [
        (spec(), "loopback", 132),
        (spec(routing="stress_skew"), "", 132),
        (spec(T=1024, K=512, N=1024, E=4, W=2), "p2p", 132),
        (spec(W=8, E=8), "nvshmem", 0),
        (spec(), "loopback", 6),  # a tiny GPU: ccta clamped below its SM count
    ],
)
def test_pick_is_in_range_with_a_reason(s, transport, sm):
    ccta, mgb, why = autotune.pick(s, transport, sm)
    assert isinstance(ccta, int) and isinstance(mgb, int) and why
    assert ccta >= 1 and mgb >= 1
    assert not sm or ccta < sm
    osys.OverlapSystem.validate(s, {**osys.OverlapSystem.PARAMS, "ccta": ccta, "mgb": mgb}, sm)


def test_pick_near_and_far():
    # the calibrated shape itself, nearest cell only (k=1): its own measured best
    table = autotune.load_table()
    s = spec(routing="stress_skew")
    values = {**autotune.spec_values(s), "world_size": 4}
    p = autotune.pick_from(table, values, "loopback", 132, k=1)
    loop = table[(table.transport == "loopback") & (table.routing == "stress_skew")]
    best = loop.sort_values("rel_latency").iloc[0]
    assert (p.ccta, p.mgb) == (int(best.ccta), int(best.mgb)) and "mean of the 1 nearest" in p.why
    c, m, why = autotune.pick(s, "loopback", 132)  # the default k: a mean over neighbours
    assert f"mean of the {autotune.K_NEAREST} nearest" in why or "mean of the" in why
    # far from every calibrated cell: the documented default
    c, m, why = autotune.pick(spec(T=256, K=256, N=512, E=2, W=2), "p2p", 132)
    assert (c, m) == autotune.DEFAULT and why.startswith("default")
    # a fixed mgb is kept, only ccta picked
    c, m, _ = autotune.pick(spec(), "loopback", 132, mgb=2)
    assert m == 2


def test_shared_reads_only_its_own_rows_or_takes_every_sm():
    """consumer="shared": the own rows never decide its pick; with none of its own near, the
    documented default (every SM, mgb 1; 16 SMs where the count is unknown); its cCTA may be
    every SM where own keeps one for the producer."""
    s = spec(W=2)
    values = {**autotune.spec_values(s), "world_size": 2}
    own = autotune.load_table()
    p = autotune.pick_from(own, values, "nvlink", 132, consumer="shared")
    assert (p.ccta, p.mgb) == (132, 1) and p.why.startswith("shared default: every SM (132)")
    assert "no calibrated shared cell" in p.why
    assert (autotune.pick_from(own, values, "nvlink", 0, consumer="shared").ccta) == 16
    c, m, why = autotune.pick(s, "p2p", 132, consumer="shared")
    assert (c, m) == (132, 1)
    P = osys.OverlapSystem.PARAMS
    osys.OverlapSystem.validate(s, {**P, "consumer": "shared", "ccta": c, "mgb": m}, 132)
    # shared rows of one calibrated workload: (66, 2) best; own rows of it say (8, 1)
    row = own[(own.transport == "nvlink") & (own.routing == "balanced")].iloc[0]
    base = {k: row[k] for k in autotune.COLUMNS[:-3]}  # the features, transport, routing
    shared = pd.DataFrame(
        [
            {**base, "sm_count": 132, "ccta": c, "mgb": m, "rel_latency": r, "consumer": "shared"}
            for c, m, r in [(66, 2, 1.0), (132, 1, 1.04), (132, 2, 1.02)]
        ]
    )
    both = pd.concat([own, shared], ignore_index=True)
    cal = {col: row[col] for col in autotune.FEATURES}
    p = autotune.pick_from(both, cal, "nvlink", 132, k=1, consumer="shared")
    assert (p.ccta, p.mgb) == (66, 2) and "mean of the 1 nearest" in p.why
    assert autotune.pick_from(both, cal, "nvlink", 132, k=1) == autotune.pick_from(
        own, cal, "nvlink", 132, k=1
    )
    p = autotune.pick_from(both, cal, "nvlink", 132, k=1, ccta=200, consumer="shared")
    assert p.ccta == 132 and "clamped to 132" in p.why  # shared: at most every SM
    with pytest.raises(ValueError, match="consumer must be one of"):
        autotune.pick_from(own, cal, "nvlink", 132, consumer="both")


def test_the_rule_reads_the_rows_of_this_gpus_sm_count_or_says_they_are_anothers():
    """Rows calibrated on a GPU of the cell's SM count decide alone; with none, every row
    counts and the why names the other GPUs and how to calibrate this one."""
    own = autotune.load_table()
    row = own[(own.transport == "nvlink") & (own.routing == "balanced")].iloc[0]
    cal = {col: row[col] for col in autotune.FEATURES}
    base = {k: row[k] for k in autotune.COLUMNS[:-4]}  # the features, transport, routing
    rows = [(132, 8, 1, 1.0), (132, 24, 2, 1.2), (108, 24, 2, 1.0), (108, 8, 1, 1.3)]
    table = pd.DataFrame(
        [{**base, "sm_count": n, "ccta": c, "mgb": m, "rel_latency": r} for n, c, m, r in rows]
    )
    p132 = autotune.pick_from(table, cal, "nvlink", 132, k=1)
    p108 = autotune.pick_from(table, cal, "nvlink", 108, k=1)
    assert (p132.ccta, p132.mgb) == (8, 1) and (p108.ccta, p108.mgb) == (24, 2)
    assert "calibrated on" not in p132.why + p108.why
    other = autotune.pick_from(table, cal, "nvlink", 114, k=1)
    assert "calibrated on 108/132-SM GPUs, this one has 114" in other.why
    assert "experiment=ccta_auto" in other.why
    assert "calibrated on" not in autotune.pick_from(table, cal, "nvlink", 0, k=1).why


def test_fit_calibrates_own_and_shared_apart():
    lat = {"balanced": {(8, 1): 1.0, (16, 1): 1.2}, "stress_skew": {(8, 1): 2.0, (16, 1): 3.0}}
    own = synthetic(lat, {"balanced": 1.0, "stress_skew": 1.5})
    shared = synthetic(
        {"balanced": {(66, 1): 0.9, (132, 1): 0.8}, "stress_skew": {(66, 1): 1.9, (132, 1): 1.7}},
        {"balanced": 1.0, "stress_skew": 1.5},
    ).assign(p_consumer="shared")
    sweep, auto = fit.split_rows(pd.concat([own, shared], ignore_index=True))
    table = fit.calibration_table(sweep, 132)
    assert sorted(set(zip(table.consumer, table.ccta))) == [
        ("own", 8),
        ("own", 16),
        ("shared", 66),
        ("shared", 132),
    ]
    res = fit.heldout(sweep, auto, 132, k=1).set_index(["consumer", "routing"])
    # each held-out workload is picked from its own placement's rows only
    assert set(res.loc["shared", "pick_ccta"]) == {132}
    assert set(res.loc["own", "pick_ccta"]) == {8}
    assert (res.loc[("shared", "balanced"), "default_ratio"]) == pytest.approx(1.0)  # 132, mgb 1


def test_validate_accepts_auto_and_rejects_bad_values():
    s, P = spec(), osys.OverlapSystem.PARAMS
    osys.OverlapSystem.validate(s, {**P, "ccta": "auto", "mgb": "auto"}, 132)
    for bad, msg in [
        ({"ccta": "fast"}, "overlap: ccta must be an integer or 'auto', got 'fast'"),
        ({"mgb": "many"}, "overlap: mgb must be an integer or 'auto', got 'many'"),
        ({"ccta": 0}, "overlap: ccta=0 must be in [1, 132)"),
        ({"mgb": 0}, "overlap: mgb must be >= 1"),
        ({"ccta": 1.5}, "overlap: ccta must be an integer or 'auto', got 1.5"),
        ({"ccta": True}, "overlap: ccta must be an integer or 'auto', got True"),
        ({"ccta": "8"}, "overlap: ccta must be an integer or 'auto', got '8'"),  # a 2nd hash
        ({"mgb": 2.5}, "overlap: mgb must be an integer or 'auto', got 2.5"),
        ({"tile_m": 64.7}, "overlap: tile_m must be one of (64, 128), got 64.7"),
        ({"tile_m": 64.0}, "overlap: tile_m must be one of (64, 128), got 64.0"),
    ]:
        with pytest.raises(ValueError) as exc:
            osys.OverlapSystem.validate(s, {**P, **bad}, 132)
        assert msg in str(exc.value) and "\n" not in str(exc.value)


def test_setup_resolves_auto_on_the_host(monkeypatch):
    """setup picks before building anything; resolved_params reports what ran."""
    seen = {}

    class FakeLoopback:
        timed_rank = 0

        def __init__(self, ranks, k):
            seen.update(asdict(k))
            tile = SimpleNamespace(block_n=256, block_k=64)
            self.runner, self.facts = SimpleNamespace(tile=tile, residency=None), {}

    monkeypatch.setattr(osys.steps, "PlayedOperatorStep", FakeLoopback)
    ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"))
    s = spec(routing="moderate_skew")
    sysm = osys.OverlapSystem(ctx, {"ccta": "auto", "mgb": "auto", "transport": "loopback"})
    sysm.setup([SimpleNamespace(spec=s)])
    want = autotune.pick(s, "loopback", 0)
    assert (seen["ccta"], seen["mgb"]) == want[:2]
    r = sysm.resolved_params()
    assert r["ccta_used"] == want[0] and r["mgb_used"] == want[1]
    assert sysm.params["ccta"] == "auto" and sysm.extra["auto"] == want[2]
    # order: "auto" by default, resolved in setup and reported next to what was asked
    want_order = autotune.pick_order(s, 128)
    assert seen["order"] == want_order[0] == r["order_used"]
    assert sysm.extra["auto_order"] == want_order[1]
    fixed = osys.OverlapSystem(ctx, {"ccta": 4, "transport": "loopback", "order": "expert"})
    fixed.setup([SimpleNamespace(spec=s)])
    assert (seen["ccta"], seen["mgb"]) == (4, 1) and "auto" not in fixed.extra
    assert fixed.resolved_params()["ccta_used"] == 4
    assert seen["order"] == "expert" and "auto_order" not in fixed.extra


def test_a_table_holds_auto_next_to_integer_params(tmp_path):
    t = ResultsTable(tmp_path / "t.parquet")
    t.append([Row(experiment="e", system="overlap", cell_hash="a", params={"ccta": 16})])
    t.append([Row(experiment="e", system="overlap", cell_hash="b", params={"ccta": "auto"})])
    assert list(t.load()["p_ccta"]) == ["16", "auto"]


# ---- the fit script on a synthetic sweep ----------------------------------------------------


def synthetic(lat: dict[str, dict[tuple[int, int], float]], imb: dict[str, float]):
    """Rows of an overlap sweep: routing -> {(ccta, mgb): latency}."""
    rows = []
    for routing, grid in lat.items():
        for (c, m), ms in grid.items():
            rows.append(
                dict(
                    system="overlap",
                    status="ok",
                    transport="loopback",
                    world_size=4,
                    tokens_per_rank=8192,
                    hidden=2048,
                    out=8192,
                    experts_per_rank=16,
                    top_k=2,
                    routing=routing,
                    dtype="bfloat16",
                    imbalance_rank=imb[routing],
                    p_ccta=c,
                    p_mgb=m,
                    latency_ms=ms,
                )
            )
    return pd.DataFrame(rows)


def test_fit_heldout_ratios_are_computed_against_the_measured_best():
    lat = {
        "balanced": {(4, 1): 2.0, (8, 1): 1.0, (16, 1): 1.5},  # best 8
        "moderate_skew": {(4, 1): 3.0, (8, 1): 2.2, (16, 1): 2.0},  # best 16
        "stress_skew": {(4, 1): 3.3, (8, 1): 3.0, (16, 1): 4.0},  # best 8
    }
    imb = {"balanced": 1.0, "moderate_skew": 1.2, "stress_skew": 2.2}
    sweep, auto = fit.split_rows(synthetic(lat, imb))
    assert auto.empty
    table = fit.calibration_table(sweep, 132)
    assert set(table.columns) == {*autotune.COLUMNS, "consumer"}
    assert set(table["consumer"]) == {"own"}  # rows without p_consumer ran the own SMs
    assert table[table.routing == "moderate_skew"].set_index("ccta")["rel_latency"][8] == 1.1
    res = fit.heldout(sweep, auto, 132, k=1).set_index("routing")
    # balanced held out: nearest is moderate_skew (log2 1.2 vs 1.0), whose best is 16
    assert (res.loc["balanced", "pick_ccta"], res.loc["balanced", "best_ccta"]) == (16, 8)
    assert res.loc["balanced", "pick_ratio"] == pytest.approx(1.5)
    # moderate held out: nearest is balanced (best 8): 2.2 / 2.0
    assert res.loc["moderate_skew", "pick_ratio"] == pytest.approx(1.1)
    # stress held out: nearest is moderate (best 16): 4.0 / 3.0; the default is (16, 1) too
    assert res.loc["stress_skew", "pick_ratio"] == pytest.approx(4.0 / 3.0)
    assert res.loc["stress_skew", "default_ratio"] == pytest.approx(4.0 / 3.0)
    assert "0/3 workloads; worst ratio 1.5000" in fit.summary(res.reset_index())


def test_the_mean_of_the_nearest_cells_outvotes_one_noisy_cell():
    # four calibrated workloads near each other: in the nearest one (16, 1) came out best by
    # noise, the three others measured (8, 1) best; the held-out workload's own best is 8
    lat = {
        "balanced": {(8, 1): 1.0, (16, 1): 1.4},  # held out
        "moderate_skew": {(8, 1): 1.05, (16, 1): 1.0},  # nearest: the noisy one
        "stress_skew": {(8, 1): 1.0, (16, 1): 1.3},
        "uniform": {(8, 1): 1.0, (16, 1): 1.3},
        "skewed": {(8, 1): 1.0, (16, 1): 1.2},
    }
    imb = {
        "balanced": 1.0,
        "moderate_skew": 1.05,
        "stress_skew": 1.3,
        "uniform": 1.2,
        "skewed": 1.4,
    }
    sweep, auto = fit.split_rows(synthetic(lat, imb))
    one = fit.heldout(sweep, auto, 132, k=1).set_index("routing").loc["balanced"]
    four = fit.heldout(sweep, auto, 132, k=4).set_index("routing").loc["balanced"]
    assert (one["pick_ccta"], one["pick_ratio"]) == (16, pytest.approx(1.4))
    assert (four["pick_ccta"], four["pick_ratio"]) == (8, pytest.approx(1.0))
    assert "mean of the 4 nearest" in four["why"]


def test_fit_reports_measured_auto_rows_and_runs_as_a_script(tmp_path):
    lat = {"balanced": {(8, 1): 1.0, (16, 1): 1.2}, "stress_skew": {(8, 1): 2.0, (16, 1): 3.0}}
    df = synthetic(lat, {"balanced": 1.0, "stress_skew": 1.5})
    auto = df.iloc[[0]].assign(p_ccta="auto", p_mgb="auto", latency_ms=1.1)
    auto = auto.assign(p_ccta_used=8, p_mgb_used=1)
    df = pd.concat([df, auto], ignore_index=True)
    df["p_ccta"], df["p_mgb"] = df["p_ccta"].astype(str), df["p_mgb"].astype(str)
    df.to_parquet(tmp_path / "sweep.parquet")
    out, table = tmp_path / "heldout.parquet", tmp_path / "table.csv"
    argv = [str(tmp_path / "sweep.parquet"), "--table", str(table), "--heldout", str(out)]
    assert fit.main(argv) == 0
    res = pd.read_parquet(out).set_index("routing")
    assert res.loc["balanced", "auto_ratio"] == pytest.approx(1.1)
    assert (res.loc["balanced", "auto_ccta"], res.loc["balanced", "auto_mgb"]) == (8, 1)
    assert pd.isna(res.loc["stress_skew", "auto_ratio"])
    assert len(autotune.load_table(table)) == 4


def test_fit_adds_another_gpus_calibration_beside_the_committed_rows(tmp_path):
    lat = {"balanced": {(8, 1): 1.0, (16, 1): 1.2}, "stress_skew": {(8, 1): 2.0, (16, 1): 3.0}}
    synthetic(lat, {"balanced": 1.0, "stress_skew": 1.5}).to_parquet(tmp_path / "sweep.parquet")
    table, out = tmp_path / "table.csv", tmp_path / "heldout.parquet"
    base = [str(tmp_path / "sweep.parquet"), "--table", str(table), "--heldout", str(out)]
    assert fit.main(base) == 0  # the first GPU: 132 SMs, the default
    assert fit.main([*base, "--sm-count", "108", "--keep-other-gpus"]) == 0
    both = pd.read_csv(table)
    assert both["sm_count"].value_counts().to_dict() == {132: 4, 108: 4}
    assert fit.main([*base, "--sm-count", "108", "--keep-other-gpus"]) == 0  # a refit replaces
    assert pd.read_csv(table)["sm_count"].value_counts().to_dict() == {132: 4, 108: 4}
    assert fit.main([*base, "--sm-count", "108"]) == 0  # without the flag: this GPU's rows only
    assert set(pd.read_csv(table)["sm_count"]) == {108}


def test_auto_order_picks_expert_only_where_an_expert_has_few_bands():
    from systems.overlap.autotune import ORDER_EXPERT_BANDS, pick_order

    def spec(E):
        return WorkloadSpec(8192, 2048, 8192, E, 2, 2, "balanced", dtype="bfloat16")

    # T * top_k / (E * tile_m) bands an expert: 16384 / (E * 128)
    assert pick_order(spec(64), 128)[0] == "expert"  # 2 bands
    assert pick_order(spec(32), 128)[0] == "expert"  # 4 bands: the threshold
    assert pick_order(spec(16), 128)[0] == "remote_first"  # 8 bands
    assert pick_order(spec(32), 64)[0] == "remote_first"  # 8 bands of 64 rows
    order, why = pick_order(spec(64), 128)
    assert "2 bands" in why and f"{ORDER_EXPERT_BANDS:g}" in why


def test_fit_keeps_only_rows_at_the_order_auto_runs():
    # E=16 at T=8192, top-2, tile 128: 8 bands an expert -> auto runs remote_first; E=64: expert
    lat = {"balanced": {(4, 1): 2.0, (8, 1): 1.0}}
    rows = synthetic(lat, {"balanced": 1.0})
    old = rows.copy()  # a table from before the knob: no p_order column, ran remote_first
    assert len(fit.split_rows(old)[0]) == 2
    both = pd.concat([rows.assign(p_order="remote_first"), rows.assign(p_order="expert")])
    assert set(fit.split_rows(both)[0]["p_order"]) == {"remote_first"}
    e64 = both.assign(experts_per_rank=64)
    assert set(fit.split_rows(e64)[0]["p_order"]) == {"expert"}
    # order "auto" rows are judged by what they ran (p_order_used)
    ran = rows.assign(experts_per_rank=64, p_order="auto", p_order_used=["expert", "remote_first"])
    kept = fit.split_rows(ran)[0]
    assert list(kept["p_order_used"]) == ["expert"]
