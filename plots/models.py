"""Fig 4: speedup of the overlap system against each baseline, per model: end to end (the whole
forward, latency_ms) and per MoE layer (the MoE calls inside that forward, m_moe_ms).
speedup = time(baseline) / time(overlap) on the same model, W and dtype; each system's fastest
cell (over its sweep points) counts. Higher is better; 1 = as fast as the baseline.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots.common import grid, label, load, main, save, transport_note

KEY = ["model", "world_size", "dtype"]
OURS = "overlap"


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, W, dtype, baseline): e2e and moe speedups of the overlap system."""
    need = set(KEY) | {"system", "latency_ms", "m_moe_ms"}
    if missing := sorted(need - set(df.columns)):
        raise ValueError(f"not a models table: no column(s) {missing}")
    df = df[df["latency_ms"].notna()]
    best = df.loc[df.groupby(KEY + ["system"])["latency_ms"].idxmin()]
    best = best[KEY + ["system", "latency_ms", "m_moe_ms"]]
    ours = best[best["system"] == OURS].drop(columns="system")
    if ours.empty:
        raise ValueError(f"no ok {OURS} rows to compare")
    out = best[best["system"] != OURS].merge(ours, on=KEY, suffixes=("", "_overlap"))
    if out.empty:
        raise ValueError("no ok baseline rows next to the overlap system's")
    out["e2e"] = out["latency_ms"] / out["latency_ms_overlap"]
    out["moe"] = out["m_moe_ms"] / out["m_moe_ms_overlap"]
    return out.rename(columns={"system": "baseline"}).reset_index(drop=True)


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    sp = speedups(df)
    models = list(dict.fromkeys(sp["model"]))
    baselines = sorted(sp["baseline"].unique())
    fig, axes = grid(1, 2, 5.5, 3.8)
    width = 0.8 / len(baselines)
    for ax, col, title in zip(axes[0], ("e2e", "moe"), ("end to end", "per MoE layer")):
        for i, b in enumerate(baselines):
            s = sp[sp["baseline"] == b].set_index("model").reindex(models)
            xs = [j + (i - (len(baselines) - 1) / 2) * width for j in range(len(models))]
            ax.bar(xs, s[col], width, label=label(b))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(models)), models)
        ax.set_ylabel(f"speedup of {OURS} ({title})")
        ax.set_title(title, fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    title = f"Models: overlap against each baseline (higher is better)\n{transport_note(df)}"
    return save(fig, out_dir, name, title)


if __name__ == "__main__":
    main(plot, "results/models.parquet", "models")
