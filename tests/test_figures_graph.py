"""Figures and the report prefer a cell's CUDA-graph rows and say which timing they show
(issue 39 #1): plots.common.prefer_graph, timing_note, the layer_w1 and layer_loopback figures
and the report's host-free section."""

from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
W1 = ROOT / "results/reference/h200/layer_w1.parquet"
#: (system, graph, p_dispatch, p_dispatch_used, latency): serial timed three ways per cell; the
#: eager rows are the FASTER ones here, so a figure that took the minimum or the median over a
#: cell's rows would not draw the graph row
ROWS = [("serial", True, "auto", "device", 1.0), ("serial", False, "auto", "device", 0.5),
        ("serial", False, "nccl", "nccl", 0.7), ("tutel", False, None, None, 2.0)]  # fmt: skip


def _table(path: Path, rows=ROWS, graph_status="ok") -> Path:
    recs = []
    for e in (2, 4):
        for system, graph, disp, used, ms in rows:
            recs.append(dict(
                system=system, status=graph_status if graph else "ok", scope="layer",
                transport="nccl", world_size=1, tokens_per_rank=64, hidden=32, out=32, ffn=64,
                experts_per_rank=e, top_k=2, routing="balanced", dtype="bfloat16",
                latency_ms=ms * e, graph=graph, p_dispatch=disp, p_dispatch_used=used,
                hardware="h200", warmup=1, iters=5, gpu_name="NVIDIA H200", gpu_count=1,
                timestamp=1.0,
            ))  # fmt: skip
    pd.DataFrame(recs).to_parquet(path)
    return path


def test_load_keeps_a_cells_graph_rows_and_every_row_of_a_cell_without_one(tmp_path):
    from plots.common import load, timing_note

    df = load(_table(tmp_path / "layer_w1.parquet"))
    serial = df[df["system"] == "serial"]
    assert len(serial) == 2 and serial["graph"].all()  # the eager and the nccl rows left
    assert sorted(serial["latency_ms"]) == [2.0, 4.0]
    assert len(df[df["system"] == "tutel"]) == 2  # no graph row in its cells: kept, eager
    assert timing_note(df) == "timing: CUDA-graph replay (serial), eager (the rest)"
    assert len(load(tmp_path / "layer_w1.parquet", prefer=False)) == 2 * len(ROWS)


def test_a_failed_graph_row_leaves_the_eager_rows_and_no_column_means_eager(tmp_path):
    from plots.common import load, prefer_graph, timing_note

    df = load(_table(tmp_path / "t.parquet", graph_status="fail"))
    assert set(df[df["system"] == "serial"]["latency_ms"]) == {1.0, 1.4, 2.0, 2.8}
    old = pd.read_parquet(tmp_path / "t.parquet").drop(columns=["graph"])
    assert len(prefer_graph(old)) == len(old) and timing_note(old) == "timing: eager"


def test_the_layer_figure_draws_serials_graph_row_and_says_so(tmp_path):
    from plots import layer
    from plots.common import load

    t = _table(tmp_path / "layer.parquet")
    sp = layer.series(load(t))
    assert sorted(sp[sp["system"] == "serial"]["latency_ms"]) == [2.0, 4.0]
    assert sorted(sp[sp["system"] == "tutel"]["speedup"]) == [0.5, 0.5]


def test_report_pairs_graph_rows_not_the_fastest_eager_one(tmp_path):
    from plots.report import compare, fastest

    df = pd.read_parquet(_table(tmp_path / "t.parquet"))
    ours = df[df["system"] == "tutel"].assign(system="overlap", graph=True, latency_ms=1.0)
    r, keys = fastest(pd.concat([df, ours]), "layer")
    c = compare(r, keys, ["serial", "tutel"], "graph").set_index("system")
    assert sorted(c.loc["serial", "ratio"]) == [2.0, 4.0]  # the graph rows, not eager 0.5 * e
    assert sorted(c.loc["tutel", "ratio"]) == [4.0, 8.0] and c.loc["tutel", "eager"].all()


def test_layer_w1_figures_label_each_lines_timing(tmp_path, monkeypatch):
    import plots.common as pc
    from plots import layer_w1

    seen, real = [], pc.save
    monkeypatch.setattr(
        pc, "save", lambda fig, d, n, t="": (seen.append(fig), real(fig, d, n, t))[1]
    )
    paths = layer_w1.plot(W1, tmp_path, "w1")
    assert sorted(p.name for p in paths if p.suffix == ".png") == ["w1_graph.png", "w1_systems.png"]
    systems, graph = ([t.get_text() for t in f.legends[0].get_texts()] for f in seen)
    assert any(s.startswith("Serial") and s.endswith("[CUDA graph]") for s in systems)
    assert any(s.startswith("Tutel") and s.endswith("[eager]") for s in systems)
    assert len(graph) == 4 and all(s.endswith("/ CUDA graph") for s in graph)
    assert "one H200, W=1" in seen[0]._suptitle.get_text()
    for fig in seen:
        assert max(len(ax.get_lines()) for ax in fig.get_axes()) <= 8 + 1  # + the line at 1


def test_layer_w1_graph_gain_is_eager_over_the_graph_replay_of_one_cell():
    from plots.layer_w1 import graph_gain

    df = pd.read_parquet(W1)
    g = graph_gain(df)
    one = g[(g["hidden"] == 768) & (g["experts_per_rank"] == 16) & (g["routing"] == "balanced")]
    cell = df[(df["hidden"] == 768) & (df["experts_per_rank"] == 16)
              & (df["routing"] == "balanced") & (df["system"] == "overlap")]  # fmt: skip
    graph = float(cell[cell["graph"]]["latency_ms"].iloc[0])
    nccl = float(cell[cell["p_dispatch_used"] == "nccl"]["latency_ms"].iloc[0])
    got = one[(one["system"] == "overlap") & (one["mode"] == "nccl")]["gain"]
    assert len(one) == 4 and abs(float(got.iloc[0]) - nccl / graph) < 1e-12


def test_host_free_section_and_the_loopback_figure_from_the_committed_tables(tmp_path):
    from plots import layer_loopback
    from plots.report import host_free_section, tables

    d = tables(ROOT / "results/reference")
    text = "\n".join(host_free_section(d))
    df = d["h200/layer_w1"]
    cell = df[(df["hidden"] == 768) & (df["experts_per_rank"] == 16) & (df["routing"] == "balanced")
              & (df["graph"] == True) & (df["status"] == "ok")]  # fmt: skip  # noqa: E712
    ms = [float(cell[cell["system"] == s]["latency_ms"].iloc[0]) for s in ("serial", "overlap")]
    assert f"| 768, 3072 | 16 | balanced | {ms[0]:.3f} | {ms[1]:.3f} |" in text
    assert "48 of 48 cells pass both checks" in text
    assert host_free_section({}) == []
    paths = layer_loopback.plot(
        ROOT / "results/reference/h200/layer_loopback.parquet", tmp_path, "lb"
    )
    assert all(p.exists() for p in paths)
