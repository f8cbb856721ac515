"""make report: REPORT.md is a pure function of the committed tables, and the committed one is
current (a table changed without `make report` fails here)."""

from pathlib import Path

import pandas as pd

from plots.report import CLAIMS, render

ROOT = Path(__file__).resolve().parents[1]


def test_committed_report_is_current():
    committed = (ROOT / "results" / "REPORT.md").read_text()
    assert committed == render(ROOT / "results" / "reference", Path("plots/figures")), (
        "results/REPORT.md is stale: run `make report`"
    )


def test_every_table_and_claim_is_in_the_report():
    text = render(ROOT / "results" / "reference", Path("plots/figures"))
    for p in (ROOT / "results" / "reference").rglob("*.parquet"):
        assert f"`{p.parent.name}/{p.stem}`" in text
    for c in CLAIMS:
        assert c.what in text


def test_without_tables_every_claim_is_not_measured(tmp_path):
    pd.DataFrame({"x": [1]}).to_parquet(tmp_path / "other.parquet")  # not a results table
    text = render(tmp_path, tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    claims = [r for r in rows if any(r.startswith(f"| {c.what} |") for c in CLAIMS)]
    assert len(claims) == len(CLAIMS)
    assert all(r.endswith("| not measured |") for r in claims)


def test_baselines_summary_keeps_the_overlap_layouts_apart():
    import pandas as pd

    from plots.report import _baselines_fig

    work = dict(world_size=2, tokens_per_rank=8, hidden=8, out=8, routing="balanced")
    rows = []
    for e in (4, 8):
        for system, layout, ms in [
            ("serial", None, 2.0),
            ("tutel", None, 1.8),
            ("overlap", "aligned", 1.9),  # 1.05x serial, ahead of tutel
            ("overlap", "compact", 1.0),  # 2.0x serial
        ]:
            rows.append(
                dict(
                    work,
                    experts_per_rank=e,
                    system=system,
                    p_layout=layout,
                    latency_ms=ms,
                    status="ok",
                )
            )
    text = _baselines_fig(pd.DataFrame(rows))
    assert "overlap/aligned vs serial 1.05-1.05x (>= 1.35x in 0/2)" in text
    assert "overlap/compact vs serial 2.00-2.00x (>= 1.35x in 2/2)" in text
    # one layout: named plainly
    one = _baselines_fig(pd.DataFrame([r for r in rows if r["p_layout"] != "compact"]))
    assert one.startswith("2 workloads") and "overlap vs serial 1.05-1.05x" in one


def test_placement_summary_compares_with_the_first_placement_and_with_serial():
    from plots.report import _placement_fig

    w = dict(out=8192, experts_per_rank=4, routing="balanced", status="ok", compute_ms=1.0)
    df = pd.DataFrame(
        [
            {**w, "system": "serial", "latency_ms": 2.0},
            {**w, "system": "overlap", "p_ccta": "auto", "p_ccta_used": 8, "latency_ms": 1.6},
            {**w, "system": "overlap", "p_consumer": "shared", "p_ccta": "132",
             "p_ccta_used": 132, "latency_ms": 1.25},
        ]
    )  # fmt: skip
    text = _placement_fig(df)
    assert "shared:132 / own:auto 0.781-0.781x" in text and "faster in 1 of 1" in text
    assert "own:auto 1.25 (0 of 1)" in text and "shared:132 1.60 (1 of 1)" in text


def test_correctness_claim_reads_each_moe_call_of_model_rows_and_says_when_a_cell_is_over():
    from plots.report import _correctness

    base = dict(system="overlap", status="ok", dtype="bfloat16")
    # a model row's max_rel_err is the whole model's output (model_tol 5e-2): its MoE calls count
    model = pd.DataFrame([dict(base, scope="model", max_rel_err=0.0115, m_moe_max_rel_err=0.0035)])
    op = pd.DataFrame([dict(base, scope="gemm+combine", max_rel_err=0.002, dtype="float16")])
    verdict, text = _correctness({"a/models": model, "a/operator": op})
    assert verdict == "agrees" and "2 committed overlap cells" in text
    assert "all within 8e-3, max 3.50e-03 (bf16)" in text
    over = op.assign(max_rel_err=0.009)
    verdict, text = _correctness({"a/models": model, "a/operator": over})
    assert verdict == "differs" and "1 above 8e-3, max 9.00e-03 (fp16)" in text


def test_claims_read_the_newest_of_a_table_and_its_suffixed_reruns():
    from plots.report import _bound, _newest

    row = dict(system="overlap", status="ok", routing="balanced", p_ccta=8)
    old = pd.DataFrame([dict(row, timestamp=1.0, git_rev="aaa", compute_ms=2.0, comm_ms=1.0)])
    new = pd.DataFrame([dict(row, timestamp=2.0, git_rev="bbb", compute_ms=1.0, comm_ms=1.0)])
    d = {"h200/overlap_ccta": old, "h200/overlap_ccta_bbb": new, "h200/other": old}
    assert _newest(d, "h200/overlap_ccta") is new
    assert _newest({"h200/other": old}, "h200/overlap_ccta") is None
    verdict, text = _bound(d)
    assert "rev bbb" in text and "= 2.00-2.00" in text


def test_claims_take_the_machine_with_the_most_gpus_and_name_its_width():
    from plots.report import SERIAL_SYNC_FIXED, _operator, _widest, unmeasured_section

    cell = dict(status="ok", out=4096, experts_per_rank=4, routing="balanced", git_rev="r")
    cell.update(compute_ms=float("nan"), comm_ms=float("nan"), timestamp=SERIAL_SYNC_FIXED + 1)

    def table(serial_ms):
        return pd.DataFrame(
            [
                dict(cell, system="serial", latency_ms=serial_ms),
                dict(cell, system="overlap", latency_ms=1.0),
            ]
        )

    x2, x4, x16 = table(1.5), table(2.0), table(3.0)
    d = {"h200x2/operator_auto": x2, "h200x4/operator_auto": x4, "h200/operator_auto": x16}
    assert _widest(d, "operator_auto")[:2] == ("h200x4", 4)  # h200 (one GPU) is not a width
    assert _widest(d, "operator") is None
    _, text = _operator(d)
    assert text.startswith("4 H200s over NVLink (W=4") and "`h200x4/operator_auto`" in text
    assert "balanced 2.00-2.00x" in text
    _, text = _operator({"h200x2/operator_auto": x2, "h200x16/operator": x16})
    assert "`h200x2/operator_auto`" in text  # the newest table's machine, then the first
    assert "W=4, W=8" in "\n".join(unmeasured_section({"h200x2/operator": x2}))
    left = "\n".join(unmeasured_section({"h200x4/operator": x4})[:3])  # the GPU counts line
    assert "8 GPUs (W=8)" in left and "W=4" not in left
    assert "GPUs" not in "\n".join(unmeasured_section({"h200x4/a": x4, "h200x8/b": x4}))


def test_operator_claim_says_speedups_are_upper_bounds_while_serial_rows_predate_the_fix():
    from plots.report import SERIAL_SYNC_FIXED, _operator

    cell = dict(status="ok", out=4096, experts_per_rank=4, routing="balanced", git_rev="r")
    cell.update(compute_ms=float("nan"), comm_ms=float("nan"))
    rows = [
        dict(cell, system="serial", latency_ms=1.5),
        dict(cell, system="overlap", latency_ms=1.0),
    ]
    for when, said in ((SERIAL_SYNC_FIXED - 1, True), (SERIAL_SYNC_FIXED + 1, False)):
        df = pd.DataFrame([dict(r, timestamp=when) for r in rows])
        _, text = _operator({"h200x2/operator_auto": df})
        assert "balanced 1.50-1.50x" in text
        assert ("upper bounds" in text) == said
        assert "estimate" not in text  # no A/B table


def test_operator_claim_estimates_the_speedups_without_serial_sync_from_the_ab_table():
    from plots.report import SERIAL_SYNC_AB, SERIAL_SYNC_FIXED, _operator

    name, before, after = SERIAL_SYNC_AB
    cell = dict(status="ok", experts_per_rank=4, routing="balanced", timestamp=1)
    cell.update(compute_ms=float("nan"), comm_ms=float("nan"), git_rev="r")
    x2 = pd.DataFrame(
        [
            dict(cell, out=4096, system="serial", latency_ms=1.5),
            dict(cell, out=4096, system="overlap", latency_ms=1.0),
            dict(cell, out=8192, system="serial", latency_ms=1.5),
            dict(cell, out=8192, system="overlap", latency_ms=1.0),
        ]
    )
    ab = pd.DataFrame(
        [
            dict(cell, out=4096, system="serial", git_rev=before, latency_ms=0.7),
            dict(cell, out=4096, system="serial", git_rev=before, latency_ms=0.9),  # median 0.8
            dict(cell, out=4096, system="serial", git_rev=after, latency_ms=0.7),
            dict(cell, out=8192, system="serial", git_rev=before, latency_ms=1.0),
            dict(cell, out=8192, system="serial", git_rev=after, latency_ms=0.8),
        ]
    )
    assert x2["timestamp"].max() < SERIAL_SYNC_FIXED
    _, text = _operator({"h200x2/operator_auto": x2, name: ab})
    # (1.5 - 0.1) / 1.0 = 1.40 and (1.5 - 0.2) / 1.0 = 1.30
    assert "puts the sync at 0.10-0.20 ms a step" in text
    assert ">= 1.35x in 1 of 2 cells: an estimate, not a measurement)" in text


def test_operator_claim_takes_each_cells_fastest_layout_and_counts_aligned_alone():
    from plots.report import _operator

    cell = dict(status="ok", routing="balanced", git_rev="r", timestamp=2e9)
    cell.update(compute_ms=float("nan"), comm_ms=float("nan"), experts_per_rank=64)
    rows = []
    for out, aligned, compact in ((4096, 0.8, 0.7), (8192, 0.7, 0.75)):
        rows += [
            dict(cell, out=out, system="serial", latency_ms=1.0, p_layout=None),
            dict(cell, out=out, system="overlap", latency_ms=aligned, p_layout=None),
            dict(cell, out=out, system="overlap", latency_ms=compact, p_layout="compact"),
        ]
    _, text = _operator({"h200x2/operator_auto": pd.DataFrame(rows)})
    # best per cell: 1 / 0.7 = 1.43 both; aligned alone: 1.25 and 1.43
    assert ">= 1.35x in 2 of 2 cells (each cell's fastest of the layouts aligned, compact: " in text
    assert "aligned in 1, compact in 1; the paper's aligned layout alone >= 1.35x in 1)" in text
    one = pd.DataFrame([r for r in rows if r["p_layout"] is None])
    assert "layouts" not in _operator({"h200x2/operator_auto": one})[1]
    # a shared consumer is a variant of its own: it wins the first cell, aligned stays 1.25x
    shared = dict(rows[1], latency_ms=0.6, p_consumer="shared", p_layout="compact")
    text = _operator({"h200x2/operator_auto": pd.DataFrame([*rows, shared])})[1]
    assert "(each cell's fastest of the variants aligned, compact, compact/shared: " in text
    assert (
        "aligned in 1, compact in 0, compact/shared in 1; the paper's aligned layout alone" in text
    )


def test_not_measured_names_the_workloads_the_auto_rule_was_calibrated_on(tmp_path):
    from plots.report import autotune_coverage

    base = dict(tokens_per_rank=8192, hidden=2048, world_size=2, transport="nvlink", sm_count=132)
    rows = [dict(base, out=n, experts_per_rank=e) for n in (8192, 4096) for e in (64, 4)]
    rows.append(dict(base, out=8192, experts_per_rank=16, world_size=4, transport="loopback"))
    path = tmp_path / "t.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    assert autotune_coverage(path) == (
        "loopback W=4 132 SMs: T 8192, K 2048, N 8192, E 16; "
        "nvlink W=2 132 SMs: T 8192, K 2048, N 4096/8192, E 4/64"
    )
