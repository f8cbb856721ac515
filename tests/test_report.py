"""make report: REPORT.md is a pure function of the committed tables, and the committed one is
current (a table changed without `make report` fails here)."""

from pathlib import Path

import pandas as pd

from plots.report import CLAIMS, render

ROOT = Path(__file__).resolve().parents[1]
#: a row's caveat (the committed serial rows measured before a fix of serial carry one)
CAVEAT = "serial paid a host sync then: ratios are upper bounds"


def test_committed_report_is_current_and_short():
    committed = (ROOT / "results" / "REPORT.md").read_text()
    assert committed == render(ROOT / "results" / "reference", Path("plots/figures")), (
        "results/REPORT.md is stale: run `make report`"
    )
    assert len(committed.encode()) <= 18_000


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


def _cell(e, system, ms, **kw):
    base = dict(status="ok", scope="gemm+combine", world_size=2, tokens_per_rank=8, hidden=8,
                out=8, experts_per_rank=e, routing="balanced", system=system, latency_ms=ms,
                git_rev="r", timestamp=2e9)  # fmt: skip
    return {**base, **kw}


def _rows(text: str, key: str) -> list[str]:
    return [x for x in text.splitlines() if f"`{key}`" in x and x.startswith("| ")]


def test_headline_counts_cells_and_takes_each_cells_fastest_baseline(tmp_path):
    from plots.report import headline

    rows = []
    for e, serial, tutel, te, ours in ((4, 2.0, 1.8, 1.6, 1.0), (8, 3.0, 1.5, 2.0, 1.0)):
        rows += [_cell(e, "serial", serial), _cell(e, "tutel", tutel), _cell(e, "megatron_te", te)]
        rows += [_cell(e, "overlap", ours), _cell(e, "overlap", 9.0, p_transport="nvshmem")]
    rows.append(_cell(4, "tutel", 0.5, scope="layer"))  # another scope: not this headline's
    vs_serial, vs_best = _rows("\n".join(headline({"h200x2/operator": pd.DataFrame(rows)})),
                               "h200x2/operator")  # fmt: skip
    # serial: 2.0 and 3.0 -> median 2.50; best baseline: 1.6 (te) and 1.5 (tutel)
    assert "| 2 H200s, NVLink (W=2) |" in vs_serial and "| eager | 2 |" in vs_serial
    assert "| 2.50x (2.00-3.00) | not measured | not measured | none | - |" in vs_serial
    assert "| 1.55x (1.50-1.60) | megatron_te 1, tutel 1 |" in vs_best
    assert "\\*" not in vs_serial and "across" not in vs_best + vs_serial
    old = pd.DataFrame(rows).assign(caveat=CAVEAT)  # rows that carry a caveat
    text = "\n".join(headline({"h200x2/operator": old}))
    assert "2.50x (2.00-3.00)\\* |" in text and f"\\* `h200x2/operator`: {CAVEAT}." in text
    one = old.assign(caveat=[CAVEAT] + [""] * (len(old) - 1))  # one of the two serial rows
    assert CAVEAT not in "\n".join(headline({"h200x2/operator": one}))  # every serial row's


def test_headline_pairs_one_run_and_timing_and_splits_the_speedup(tmp_path):
    """Graph rows pair with graph rows of the same run; a baseline variant that cannot be
    captured meets graphed overlap eager (flagged), a run without overlap across runs
    (flagged); serial / overlap = serial / serialized x serialized / overlap, C+M in the eager
    row without serialized_ms; two runs of a cell: the median of their ratios."""
    from plots.report import headline

    g = dict(graph=True, run_id="A")
    rows = [_cell(4, "overlap", 1.0, serialized_ms=1.25, compute_ms=1.0, comm_ms=0.5, **g),
            _cell(4, "serial", 1.5, **g), _cell(4, "megatron_te", 2.0, p_capacity="padded", **g),
            _cell(4, "megatron_te", 1.8, p_capacity="dropless", run_id="C"),
            _cell(4, "overlap", 2.0, compute_ms=1.5, comm_ms=0.5, run_id="B"),
            _cell(4, "serial", 3.0, run_id="B"), _cell(4, "serial", 3.6, run_id="D"),
            _cell(4, "overlap", 2.4, compute_ms=1.5, comm_ms=0.5, run_id="D")]  # fmt: skip
    text = "\n".join(headline({"h200/operator": pd.DataFrame(rows)}))
    graph, eager, best_graph, best_eager = _rows(text, "h200/operator")
    assert "| graph | 1 | 1.50x (1.50-1.50) | 1.20x (1.20-1.20) | 1.25x (1.25-1.25) |" in graph
    assert "| 1.50-1.50x | speedup 0, overlap gain 0 |" in graph  # (1.0 + 0.5) / 1.0
    # eager: runs B and D, 3.0 / 2.0 and 3.6 / 2.4, both 1.5; C+M = 2.0, kernel 1.5 and 1.8
    assert (
        "| eager | 1 | 1.50x (1.50-1.50) | 1.65x (1.65-1.65) (C+M) | 0.92x (0.92-0.92) (C+M) |"
        in (eager)
    )
    assert "1.80x (1.80-1.80), eager baseline, across runs | megatron_te 1 |" in best_graph
    assert "| eager | 1 | 0.82x (0.82-0.82), across runs |" in best_eager  # 1.8 / median(2.0, 2.4)


def test_correctness_claim_reads_each_moe_call_of_model_rows_and_says_when_a_cell_is_over():
    from plots.report import _correctness

    base = dict(system="overlap", status="ok", dtype="bfloat16")
    # a model row's max_rel_err is the whole model's output (model_tol 5e-2): its MoE calls count
    model = pd.DataFrame([dict(base, scope="model", max_rel_err=0.0115, m_moe_max_rel_err=0.0035)])
    op = pd.DataFrame([dict(base, scope="gemm+combine", max_rel_err=0.002, dtype="float16")])
    verdict, text = _correctness({"a/models": model, "a/operator": op})
    assert verdict == "agrees" and "2 committed overlap rows" in text
    assert "all within 8e-3, max 3.50e-03 (bf16)" in text
    over = op.assign(max_rel_err=0.009)
    verdict, text = _correctness({"a/models": model, "a/operator": over})
    assert verdict == "differs" and "1 above 8e-3, max 9.00e-03 (fp16)" in text


def test_claims_take_the_machine_with_the_most_gpus(tmp_path):
    from plots.report import _operator, _widest, unmeasured_section

    def table(serial_ms):
        return pd.DataFrame([_cell(4, "serial", serial_ms), _cell(4, "overlap", 1.0)])

    x2, x4, x16 = table(1.5), table(2.0), table(3.0)
    d = {"h200x2/operator": x2, "h200x4/operator": x4, "h200/operator": x16}
    assert _widest(d, "operator")[:2] == ("h200x4", 4)  # h200 (one GPU) is not a width
    assert _widest(d, "layer") is None
    _, text = _operator(*_widest(d, "operator"))
    assert (
        text.startswith("4 H200s over NVLink (`h200x4/operator`") and "balanced 2.00-2.00x" in text
    )
    assert not text.endswith("\\*")
    assert _operator("h200x2", 2, x2.assign(caveat=CAVEAT))[1].endswith(" \\*")
    assert "W=4, W=8" in "\n".join(unmeasured_section({"h200x2/operator": x2}))
    left = "\n".join(unmeasured_section({"h200x4/operator": x4})[:3])
    assert "8 GPUs (W=8)" in left and "W=4" not in left


def test_knob_ratios_compare_each_value_with_the_first_per_cell():
    from plots.report import knob_ratios

    rows = [
        _cell(e, "overlap", ms, p_layout=lay, p_ccta_used=16)
        for e, lay, ms in ((4, "aligned", 1.0), (4, "compact", 0.9), (8, "aligned", 2.0),
                           (8, "compact", 2.2))
    ]  # fmt: skip
    assert knob_ratios(pd.DataFrame(rows), "p_layout") == "compact vs aligned 1.01x (0.91-1.11)"


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


def test_a_cell_whose_overlap_gain_passes_its_ceiling_is_named():
    from plots.report import headline

    rows = [_cell(e, s, ms, compute_ms=c, comm_ms=m) for e, s, ms, c, m in (
        (4, "overlap", 0.9, 1.0, 0.5), (4, "serial", 2.0, None, None),
        (8, "overlap", 1.2, 1.0, 0.5), (8, "serial", 2.0, None, None))]  # fmt: skip
    text = "\n".join(headline({"h200x2/operator": pd.DataFrame(rows)}))
    # C + M = 1.5, ceiling 1.5: E=4 gains 1.5 / 0.9 > 1.5 (named), E=8 1.25 (not)
    assert "| speedup 2, overlap gain 1 |" in text
    assert "its ceiling" in text and text.count("experts_per_rank=4") == 1
    assert "experts_per_rank=8" not in text
