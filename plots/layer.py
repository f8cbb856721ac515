"""The layer table (scope `layer`): latency and the speedup against serial, per routing, one
panel row per shape (T, H).

Left block: latency (ms) of every system against experts per rank, one column per routing.
Right block: latency(serial) / latency(system) on the same workload (same table). The overlap
system's rows are split by variant (transport, kept knobs off their defaults): each its own
line, never a best-of.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots import common as pc

SHAPE = {"tokens_per_rank": "T", "hidden": "H"}
WORKLOAD = ["world_size", *SHAPE, "ffn", "experts_per_rank", "top_k", "routing", "dtype"]


def series(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, line): latency_ms (median) and speedup against serial. A line is
    a system, the overlap system per variant ("... (p2p, compact)")."""
    out = pc.against(df.assign(line=pc.line_label(df)), WORKLOAD, ["system", "line"], agg="median")
    return out[out["ref_ms"].notna()]


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = pc.load(table)
    df = df[df["ffn"].fillna(0) > 0] if "ffn" in df else df.iloc[0:0]
    if "serial" not in set(df["system"]):
        raise ValueError(f"{table}: no ok serial layer rows to compare against")
    sp = series(df)
    n_r = sp["routing"].nunique()
    fig, axes = pc.grid(sp.groupby(list(SHAPE)).ngroups, 2 * n_r)
    colors = pc.palette(sp["line"])
    pc.draw_grid(axes[:, :n_r], sp, SHAPE, "line", "latency_ms", "latency (ms), lower is better",
              colors, hlines=(), logy=True)  # fmt: skip
    pc.draw_grid(axes[:, n_r:], sp, SHAPE, "line", "speedup", "speedup vs serial, higher is better",
              colors)  # fmt: skip
    title = "The MoE layer (scope layer): latency and speedup against serial"
    return pc.save(pc.finish(fig, axes, colors, f"{title}\n{pc.transport_note(df)}"), out_dir, name)


if __name__ == "__main__":
    pc.main(plot, "results/layer.parquet", "layer")
