"""Fig 4: time(baseline) / time(overlap) per model, end to end (latency_ms) and per MoE layer
(the MoE calls in that forward, m_moe_ms), on the same model, W, dtype and timing (graph where the
baseline was captured, else eager: the bar's label says which); each system's fastest row of a
run, runs by their median. Higher is better."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots.common import graphed, grid, label, load, main, save, transport_note

KEY = ["model", "world_size", "dtype"]
OURS = "overlap"


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, W, dtype, baseline): e2e and moe speedups of the overlap system."""
    need = set(KEY) | {"system", "latency_ms", "m_moe_ms"}
    if missing := sorted(need - set(df.columns)):
        raise ValueError(f"not a models table: no column(s) {missing}")
    df = df[df["latency_ms"].notna()]
    df = df.assign(graph=graphed(df), run=df["run_id"] if "run_id" in df else "")
    by = KEY + ["system", "graph"]
    best = df.loc[df.groupby(by + ["run"])["latency_ms"].idxmin()]
    best = best.groupby(by, as_index=False)[["latency_ms", "m_moe_ms"]].median()
    ours = best[best["system"] == OURS].drop(columns="system")
    if ours.empty:
        raise ValueError(f"no ok {OURS} rows to compare")
    out = best[best["system"] != OURS].merge(ours, on=KEY + ["graph"], suffixes=("", "_overlap"))
    out = out.sort_values("graph").groupby(KEY + ["system"]).tail(1)  # graph where both have it
    if out.empty:
        raise ValueError("no ok baseline rows next to the overlap system's")
    out["e2e"] = out["latency_ms"] / out["latency_ms_overlap"]
    out["moe"] = out["m_moe_ms"] / out["m_moe_ms_overlap"]
    out["timing"] = out["graph"].map({True: "graph", False: "eager"})
    return out.rename(columns={"system": "baseline"}).reset_index(drop=True)


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table, prefer=False)
    sp = speedups(df)
    models = list(dict.fromkeys(sp["model"]))
    baselines = sorted(sp["baseline"].unique())
    fig, axes = grid(1, 2, 5.5, 3.8)
    width = 0.8 / len(baselines)
    for ax, col, title in zip(axes[0], ("e2e", "moe"), ("end to end", "per MoE layer")):
        for i, b in enumerate(baselines):
            s = sp[sp["baseline"] == b].set_index("model").reindex(models)
            xs = [j + (i - (len(baselines) - 1) / 2) * width for j in range(len(models))]
            timing = "/".join(sorted(set(s["timing"].dropna())))
            ax.bar(xs, s[col], width, label=f"{label(b)} ({timing})")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(models)), models)
        ax.set_ylabel(f"speedup of {OURS} ({title})")
        ax.set_title(title, fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    title = f"Models: overlap against each baseline (higher is better)\n{transport_note(df)}"
    return save(fig, out_dir, name, title)


if __name__ == "__main__":
    main(plot, "results/models.parquet", "models")
