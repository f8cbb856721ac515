"""Latency against experts per rank of a systems-sweep table: one panel per (shape, routing), one
line per system (each overlap variant its own line), median with the p10-p90 spread; lower is
better. Only the most common timed region (`scope`) is drawn; the title names systems of another
(native Tutel and FasterMoE time the whole layer). One expert count: one bar per line instead."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots import common as pc
from plots.common import label, line_label, load, main, need, panel_grid, save, transport_note

SHAPE = {"tokens_per_rank": "T/rank", "hidden": "K", "out": "N", "dtype": ""}


def _spread(ax, s: pd.DataFrame, style: dict) -> None:
    s = s.sort_values("experts_per_rank")
    lo, hi = s["latency_ms"] - s["latency_p10_ms"], s["latency_p90_ms"] - s["latency_ms"]
    ax.errorbar(s["experts_per_rank"], s["latency_ms"], yerr=[lo, hi], fmt="none",
                color=style["color"], capsize=2)  # fmt: skip


def _bars(df: pd.DataFrame, title: str, out_dir: str | Path, name: str) -> list[Path]:
    """One panel per (shape, routing), one horizontal bar per line (every panel lists every
    line, in one order and colour): median latency, p10-p90 whiskers."""
    lines = sorted(df["line"].unique())
    colors = pc.palette(lines)
    fig, cells = pc.panels(df, SHAPE, w=3.4, h=0.9 + 0.32 * len(lines))
    right = 1.05 * df[["latency_ms", "latency_p90_ms"]].max().max()  # one scale for all panels
    for ax, panel, sub, _ in cells:
        m = sub.groupby("line")[["latency_ms", "latency_p10_ms", "latency_p90_ms"]].median()
        m = m.reindex(lines)
        err = [m["latency_ms"] - m["latency_p10_ms"], m["latency_p90_ms"] - m["latency_ms"]]
        ax.barh(range(len(lines)), m["latency_ms"], xerr=err, capsize=2,
                color=[colors[v] for v in lines])  # fmt: skip
        first = ax.get_subplotspec().is_first_col()
        ax.set_yticks(range(len(lines)), lines if first else [""] * len(lines), fontsize=7)
        ax.invert_yaxis()
        ax.set_title(panel, fontsize=8)
        ax.set_xlim(0, right)
        ax.set_xlabel("latency (ms, median, p10-p90)", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    (e,) = df["experts_per_rank"].unique()
    return save(fig, out_dir, name, pc._fixed(df, SHAPE, title, f"E/rank={int(e)} "))


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    every = load(table, status=None)
    df = need(every[every["status"] == "ok"], table, "rows with status ok to plot")
    absent = sorted(set(every["system"]) - set(df["system"]))
    line = line_label(df)
    scope = df["scope"].fillna("") if "scope" in df else line.map(lambda _: "")
    common = scope.mode().iloc[0]  # older tables have no scope
    other = sorted(set(df["system"][(scope != common) & (scope != "")]))
    df = df.assign(line=line)[(scope == common) | (scope == "")]
    title = f"MoE {common or 'gemm+combine'} latency (lower is better)\n{transport_note(df)}"
    if other:
        title += f"\nnot drawn (another timed region): {', '.join(map(label, other))}"
    if absent:
        title += f"\nno ok row (see the table's reason column): {', '.join(absent)}"
    if df["experts_per_rank"].nunique() == 1:
        return _bars(df, title, out_dir, name)
    fig = panel_grid(df, "line", "latency_ms", "latency (ms, median, p10-p90)", title,
                     rows=SHAPE, hlines=(), extra=_spread, logy=True)  # fmt: skip
    return save(fig, out_dir, name)


if __name__ == "__main__":
    main(plot, "results/smoke.parquet", "smoke_latency_vs_experts")
