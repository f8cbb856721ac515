"""Latency against experts per rank: one panel per (shape, routing), one line per system; the
overlap system's variants (plots.common.line_label) are lines of their own, never a best-of.
Median with the p10-p90 spread; lower is better.

Each system's timed region (its `scope`) is named in the title, and in the legend wherever a
system's scope differs from the rest (native Tutel and FasterMoE time the whole layer).

Input: any systems-sweep table (smoke, operator). Output: <out>/<name>.png and .pdf.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots.common import line_label, load, main, panel_grid, save, transport_note

SHAPE = {"tokens_per_rank": "T/rank", "hidden": "K", "out": "N", "dtype": ""}


def _spread(ax, s: pd.DataFrame, style: dict) -> None:
    s = s.sort_values("experts_per_rank")
    lo, hi = s["latency_ms"] - s["latency_p10_ms"], s["latency_p90_ms"] - s["latency_ms"]
    ax.errorbar(s["experts_per_rank"], s["latency_ms"], yerr=[lo, hi], fmt="none",
                color=style["color"], capsize=2)  # fmt: skip


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    if df.empty:
        raise ValueError(f"{table}: no rows with status ok to plot")
    line = line_label(df)
    scope = df["scope"].fillna("") if "scope" in df else line.map(lambda _: "")
    common = scope.mode().iloc[0]  # older tables have no scope
    df = df.assign(line=line + scope.map(lambda sc: f" [{sc}]" if sc and sc != common else ""))
    title = f"MoE {common or 'gemm+combine'} latency (lower is better)\n{transport_note(df)}"
    fig = panel_grid(df, "line", "latency_ms", "latency (ms, median, p10-p90)", title,
                     rows=SHAPE, hlines=(), extra=_spread, logy=True)  # fmt: skip
    return save(fig, out_dir, name)


if __name__ == "__main__":
    main(plot, "results/smoke.parquet", "smoke_latency_vs_experts")
