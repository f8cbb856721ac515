"""Latency against experts per rank, one line per (system, routing); the overlap system's
variants (plots.common.line_label: transport, local, layout, order, swizzle) are lines of their
own, never a best-of. Lower is better.

Each system's timed region (its `scope`) is named in the title, and in the legend wherever a
system's scope differs from the rest (native Tutel and FasterMoE time the whole layer).

Input: any systems-sweep table (smoke, operator). Output: <out>/<name>.png and .pdf.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from plots.common import line_label, load, main, save, transport_note


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    if df.empty:
        raise ValueError(f"{table}: no rows with status ok to plot")
    df = df.assign(line=line_label(df))  # the overlap system's variants are lines of their own
    shapes = df.groupby(["tokens_per_rank", "hidden", "out", "dtype"])
    fig, axes = plt.subplots(1, shapes.ngroups, figsize=(5 * shapes.ngroups, 3.8), squeeze=False)
    lines = sorted(df["line"].unique())
    colors = {ln: f"C{i % 10}" for i, ln in enumerate(lines)}
    styles = dict(zip(sorted(df["routing"].unique()), ["-", "--", ":", "-."]))
    scope = df["scope"].fillna("") if "scope" in df else df["system"].map(lambda _: "")
    scopes = scope.groupby(df["line"]).first().to_dict()  # older tables have no scope
    common = scope.mode().iloc[0]
    tag = {ln: f" [{sc}]" if sc and sc != common else "" for ln, sc in scopes.items()}
    for ax, ((tpr, k, n, dt), sub) in zip(axes[0], shapes):
        for (line, routing), s in sub.groupby(["line", "routing"]):
            s = s.sort_values("experts_per_rank")
            ax.errorbar(
                s["experts_per_rank"],
                s["latency_ms"],
                yerr=[s["latency_ms"] - s["latency_p10_ms"], s["latency_p90_ms"] - s["latency_ms"]],
                color=colors[line],
                linestyle=styles[routing],
                marker="o",
                ms=3,
                capsize=2,
                label=f"{line}{tag[line]} / {routing}",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("experts per rank")
        ax.set_ylabel("latency (ms, median, p10-p90)")
        ax.set_title(f"T/rank={tpr} K={k} N={n} {dt}", fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.subplots_adjust(wspace=0.35)
    fig.suptitle(
        f"MoE {common or 'gemm+combine'} latency (lower is better)\n{transport_note(df)}",
        fontsize=9,
        y=1.06,
    )
    return save(fig, out_dir, name)


if __name__ == "__main__":
    main(plot, "results/smoke.parquet", "smoke_latency_vs_experts")
