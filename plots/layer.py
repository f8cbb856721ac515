"""The layer table (scope `layer`), one panel row per shape (T, H), one column per routing,
against experts per rank: <name>_latency, every system's latency; <name>_speedup,
latency(serial) / latency(system). Each overlap variant is its own line, never a best-of."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots import common as pc

SHAPE = {"tokens_per_rank": "T", "hidden": "H"}
WORKLOAD = ["world_size", *SHAPE, "ffn", "experts_per_rank", "top_k", "routing", "dtype"]


def series(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, line: plots.common.line_label): latency_ms (median) and speedup
    against serial."""
    out = pc.against(df.assign(line=pc.line_label(df)), WORKLOAD, ["system", "line"], agg="median")
    return out[out["ref_ms"].notna()]


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = pc.load(table)
    df = df[df["ffn"].fillna(0) > 0] if "ffn" in df else df.iloc[0:0]
    pc.need(df[df["system"] == "serial"], table, "ok serial layer rows to compare against")
    sp = series(df)
    colors = pc.palette(sp["line"])
    paths = []
    for part, y, what, kw in (
        ("_latency", "latency_ms", "latency (ms), lower is better", dict(hlines=(), logy=True)),
        ("_speedup", "speedup", "speedup vs serial, higher is better", {}),
    ):
        title = f"The MoE layer (scope layer): {what}\n{pc.transport_note(df)}"
        fig = pc.panel_grid(sp, "line", y, what, title, SHAPE, colors, **kw)
        paths += pc.save(fig, out_dir, name + part)
    return paths


if __name__ == "__main__":
    pc.main(plot, "results/layer.parquet", "layer")
