"""Figures a reader can use (issue 42 #9): names by experiment and machine, one measurement
setting per figure, bars where a table has one expert count, the layer figure split in two, and
the figure index in results/REPORT.md."""

import shutil
from pathlib import Path

import pandas as pd
import pytest

from harness.records import ResultsTable, Row

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("serial", "tutel_reimpl", "fastermoe_reimpl")


def _table(path: Path, experts=(2, 4), iters=5, t0=1.0, ms=1.0, **kw) -> Path:
    rows = [
        Row("smoke", s, cell_hash=f"{s}{r}{e}{iters}", world_size=4, transport="gloo",
            tokens_per_rank=64, hidden=32, out=48, experts_per_rank=e, top_k=2, routing=r,
            dtype="float32", latency_ms=ms + e, latency_p10_ms=ms + e - 0.1,
            latency_p90_ms=ms + e + 0.1, hardware="cpu", warmup=1, iters=iters, timestamp=t0,
            **kw)
        for s in SYSTEMS for r in ("balanced", "stress_skew") for e in experts
    ]  # fmt: skip
    ResultsTable(path).append(rows)
    return path


@pytest.fixture
def figures(monkeypatch):
    """Every figure plots.common.save writes, as (figure, name) after it is written."""
    import plots.common as pc

    seen, real = [], pc.save

    def save(fig, out_dir, name, title=""):
        paths = real(fig, out_dir, name, title)
        seen.append((fig, name))
        return paths

    for mod in ("plots.latency_vs_experts", "plots.common"):
        monkeypatch.setattr(f"{mod}.save", save)
    return seen


def test_a_rerun_with_other_iters_draws_the_newest_setting_only(tmp_path, figures):
    from plots import latency_vs_experts
    from plots.common import load

    t = _table(tmp_path / "smoke.parquet", iters=5, t0=1.0, ms=1.0)
    _table(t, iters=20, t0=2.0, ms=10.0)  # the same cells measured again with iters=20
    df = load(t)
    assert set(df["iters"]) == {20} and len(df) == len(SYSTEMS) * 2 * 2
    latency_vs_experts.plot(t, tmp_path / "f", "cpu_smoke")
    ((fig, _),) = figures
    assert "iters 20" in fig._suptitle.get_text() and "iters 5" not in fig._suptitle.get_text()
    drawn = {y for ax in fig.get_axes() for line in ax.get_lines() for y in line.get_ydata()}
    assert min(drawn) > 10  # no point of the iters=5 rows


def test_a_table_of_one_expert_count_is_drawn_as_bars_per_system(tmp_path, figures):
    from plots import latency_vs_experts

    t = _table(tmp_path / "baselines_smoke.parquet", experts=(2,))
    latency_vs_experts.plot(t, tmp_path / "f", "cpu_baselines_smoke")
    ((fig, _),) = figures
    axes = fig.get_axes()
    assert len(axes) == 2  # one per routing
    for ax in axes:
        assert len(ax.patches) == len(SYSTEMS) and ax.get_xscale() == "linear"
        assert "latency" in ax.get_xlabel()
    labels = [t.get_text() for t in axes[0].get_yticklabels()]
    assert len(labels) == len(SYSTEMS) and all(labels)
    assert "E/rank=2" in fig._suptitle.get_text()


def test_figure_names_say_experiment_and_machine(tmp_path):
    from plots import all as figures_cli
    from plots.common import machine

    one = pd.DataFrame({"gpu_name": ["NVIDIA H200"], "gpu_count": [1], "timestamp": [1.0]})
    assert machine(one) == "h200" and machine(one.assign(gpu_count=2)) == "h200x2"
    assert machine(one.assign(gpu_count=0, gpu_name="x86_64")) == "cpu"
    results, out = tmp_path / "results", tmp_path / "figs"
    (results / "reference" / "h200x2").mkdir(parents=True)
    out.mkdir()
    _table(results / "smoke.parquet")
    shutil.copy(results / "smoke.parquet", results / "reference" / "h200x2" / "smoke.parquet")
    figures_cli.main(["--results", str(results), "--out", str(out)])
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["cpu_smoke.png", "reference_h200x2_smoke.png"], pngs
    (results / "smoke.parquet").write_bytes(b"garbage")
    with pytest.raises(SystemExit):
        figures_cli.main(["--results", str(results), "--out", str(out)])
    assert not (out / "cpu_smoke.png").exists()  # never left behind looking current


def test_the_layer_figure_is_two_figures_of_at_most_12_panels_and_8_lines(tmp_path, figures):
    from plots import layer

    paths = layer.plot(ROOT / "results/reference/h200x2/layer.parquet", tmp_path, "lay")
    assert sorted(p.name for p in paths if p.suffix == ".png") == [
        "lay_latency.png", "lay_speedup.png"
    ]  # fmt: skip
    for fig, _ in figures:
        axes = fig.get_axes()
        assert len(axes) <= 12
        assert max(len(ax.get_lines()) for ax in axes) <= 8 + 1  # + the line at 1.0
        assert all(len(ax.get_yticklabels(minor=True) + ax.get_yticklabels()) >= 2 for ax in axes)


def test_the_report_indexes_every_committed_figure_with_its_table_and_script():
    from plots.all import FIGURES, figure_names
    from plots.report import render

    text = render(ROOT / "results" / "reference", Path("plots/figures"))
    index = text.split("## Figures", 1)[1].split("\n## ", 1)[0]
    rows = {r.split("|")[1].strip(" `"): r for r in index.splitlines() if r.startswith("| `")}
    drawn = sorted(p for p in (ROOT / "results/reference").rglob("*.parquet") if p.stem in FIGURES)
    assert drawn and set(rows) == {FIGURES[p.stem] for p in drawn}
    for p in drawn:
        key = f"{p.parent.name}/{p.stem}"
        assert f"`{key}`" in rows[FIGURES[p.stem]].split("|")[3], key
        names = figure_names(Path("results/reference", f"{key}.parquet"), Path("results"))
        assert names[0].startswith(f"reference_{p.parent.name}_{p.stem}")


def test_a_reference_tables_figure_takes_the_name_make_figures_gives_it(monkeypatch, capsys):
    from plots.common import main

    def plot(table, out_dir, name):
        return [name]

    for table, name in (("results/reference/h200/layer_w1.parquet", "reference_h200_layer_w1"),
                        ("results/layer_w1.parquet", "layer_w1")):  # fmt: skip
        monkeypatch.setattr("sys.argv", ["x", "--table", table])
        main(plot, "results/layer_w1.parquet", "layer_w1")
        assert capsys.readouterr().out == f"{name}\n"
