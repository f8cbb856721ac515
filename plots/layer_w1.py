"""The whole MoE layer on ONE GPU at W=1 (experiment layer_w1): every system from x [T, H] and
the routing to out [T, H]; nothing is overlapped. One panel row per shape (H, F), one column per
routing, against experts per rank; higher is better. <name>_systems: latency(serial) /
latency(system), each system's CUDA-graph replay where capturable, else eager (the legend says
which). <name>_graph: the eager device dispatch and the NCCL dispatch (host sync, so eager) of
serial and overlap, each over that system's graph replay."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from plots import common as pc

SHAPE = {"hidden": "H", "ffn": "F"}
CELL = ["world_size", "tokens_per_rank", *SHAPE, "experts_per_rank", "top_k", "routing", "dtype"]
#: how a serial or overlap row was timed, other than a graph replay -> its line in <name>_graph
MODES = {"eager": "eager step / CUDA graph", "nccl": "NCCL dispatch (host sync) / CUDA graph"}


def systems(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, line) of df's ok rows (CUDA-graph rows where a cell has them):
    latency_ms (median), ref_ms (serial's), speedup, and `line`, the label with its timing
    ("... [eager]"). A Megatron system with both routes (p_capacity dropless: eager; padded:
    CUDA graph) is one line, its faster route per cell: what its users would pick."""
    d = pc.prefer_graph(df[df["status"] == "ok"])
    how = pc.graphed(d).map({True: " [CUDA graph]", False: " [eager]"})
    d = d.assign(line=pc.line_label(d) + how)
    if "p_capacity" in d:
        routes = d[d["p_capacity"].notna()]
        both = routes.groupby("system")["p_capacity"].nunique()
        mixed = routes[routes["system"].isin(both[both > 1].index)]
        fastest = mixed.loc[mixed.groupby([*CELL, "system"])["latency_ms"].idxmin()]
        tag = " [faster of padded, CUDA graph / dropless, eager]"
        fastest = fastest.assign(line=pc.line_label(fastest) + tag)
        d = pd.concat([d.drop(index=mixed.index), fastest])
    out = pc.against(d, CELL, ["system", "line"], agg="median")
    return out[out["ref_ms"].notna()]


def modes(df: pd.DataFrame) -> pd.Series:
    """Per row, how its step was timed: "graph" (CUDA-graph replay), "eager" (the device
    dispatch) or "nccl" (the NCCL dispatch, also a row without p_dispatch_used)."""
    used = df["p_dispatch_used"] if "p_dispatch_used" in df else pd.Series(None, index=df.index)
    eager = used.map(lambda u: "eager" if u == "device" else "nccl")
    return eager.where(~pc.graphed(df), "graph")


def graph_gain(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, line) of serial's and overlap's ok eager rows whose cell has a graph
    replay of the system: gain = latency(eager) / latency(graph replay); `line` names the
    system and the eager mode (MODES)."""
    d = df[(df["status"] == "ok") & df["system"].isin(["serial", "overlap"])]
    d = d.assign(mode=modes(d), line=pc.line_label(d))
    keys = [*CELL, "system", "line"]
    lat = d.groupby([*keys, "mode"], as_index=False)["latency_ms"].median()
    graph = lat[lat["mode"] == "graph"].drop(columns="mode")
    out = lat[lat["mode"] != "graph"].merge(graph, on=keys, suffixes=("", "_graph"))
    out["gain"] = out["latency_ms"] / out["latency_ms_graph"]
    return out.assign(line=out["line"] + ": " + out["mode"].map(MODES))


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = pc.load(table, prefer=False)
    sp, gain = systems(df), graph_gain(df)
    pc.need(sp, table, "ok serial layer rows to compare against")
    n = int(df["gpu_count"].max()) if "gpu_count" in df and df["gpu_count"].notna().any() else 0
    model = pc.machine(df).split("x")[0].upper()
    gpus = "the CPU" if n == 0 else ("one " + model if n == 1 else f"{n} {model}s")
    w = ", ".join(str(int(v)) for v in sorted(df["world_size"].dropna().unique()))
    t = "/".join(str(int(v)) for v in sorted(df["tokens_per_rank"].dropna().unique()))
    head = f"The MoE layer on {gpus}, W={w}, T={t}"
    drawn = pc.prefer_graph(df)
    title = f"{head}: speedup against serial, higher is better\n{pc.transport_note(drawn)}"
    fig = pc.panel_grid(sp, "line", "speedup", "speedup vs serial", title, SHAPE, ncol=2)
    paths = pc.save(fig, out_dir, name + "_systems")
    if gain.empty:  # no graph replay to compare with: no figure, and none left looking current
        pc.drop_figures(Path(out_dir), [name + "_graph"])
        return paths
    ours = df[df["system"].isin(["serial", "overlap"])]
    title = (f"{head}: what CUDA-graph replay buys, higher is better\neager latency / graph "
             f"replay latency of the same system and cell\n"
             f"{pc.transport_note(ours, timing=False)}")  # fmt: skip
    order = sorted(gain["system"].unique())  # a system's eager line dark, its NCCL line light
    lines = gain[["line", "system", "mode"]].drop_duplicates().itertuples(index=False)
    colors = {line: plt.cm.tab20(2 * order.index(s) + (m == "nccl")) for line, s, m in lines}
    fig = pc.panel_grid(gain, "line", "gain", "eager / CUDA graph", title, SHAPE, colors, ncol=2)
    return paths + pc.save(fig, out_dir, name + "_graph")


if __name__ == "__main__":
    pc.main(plot, "results/layer_w1.parquet", "layer_w1")
