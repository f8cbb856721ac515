"""Padding of the remote-aligned layout against W, with both bounds; lower is better. One column
per routing, one colour per E (the smallest, middle and largest); rows: max zero rows per rank
with the paper's bound (W-1)(tile_m-1) (black dashed) and E(W-1)(tile_m-1) (dotted); padding share
of all GEMM rows (solid) and on the busiest rank (dashed); that share per tile_m at one E; (tables
with m_tiles_*) row tiles of the aligned layout over the compact one's."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from harness.routing import ROUTINGS
from plots.common import grid, load, main, save


def _pick(values: pd.Series, default: int) -> int:
    """`default` where the table has it, else its middle value."""
    vals = sorted(set(int(v) for v in values))
    return default if default in vals else vals[len(vals) // 2]


def _lines(ax, sub: pd.DataFrame, colour: dict, curves: list[tuple[str, str]]) -> None:
    """Per E, each (column, style) of `curves` against W; the first one labelled E=<e>."""
    for e, c in colour.items():
        s = sub[sub["experts_per_rank"] == e].sort_values("world_size")
        for k, (col, style) in enumerate(curves):
            ax.plot(s["world_size"], s[col], style, color=c, label=None if k else f"E={e}")


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    if df.empty or "m_pad_share" not in df:
        raise ValueError(f"{table}: no padding rows with status ok to plot")
    tm, tpr = _pick(df["p_tile_m"], 128), int(df["tokens_per_rank"].max())
    e_fix = _pick(df["experts_per_rank"], 16)
    d = df[df["tokens_per_rank"] == tpr].assign(
        share=100 * df["m_pad_share"], busiest=100 * df["m_pad_share_critical_rank"]
    )
    routings = [r for r in ROUTINGS if r in set(d["routing"])] or sorted(set(d["routing"]))
    es = sorted(set(int(v) for v in d["experts_per_rank"]))
    es = sorted({es[0], es[len(es) // 2], es[-1]})
    colour = {e: plt.get_cmap("viridis")(i / max(1, len(es) - 1)) for i, e in enumerate(es)}
    tiles = "m_tiles_compact_total" in d  # tables before the compact layout lack it
    if tiles:
        d["tiles"] = d["m_tiles_aligned_total"] / d["m_tiles_compact_total"]
    fig, axes = grid(4 if tiles else 3, len(routings), 4.6, 3.7)
    for col, routing in enumerate(routings):
        sub = d[(d["routing"] == routing) & (d["p_tile_m"] == tm)]
        ax_rows, ax_share, ax_tile = axes[0, col], axes[1, col], axes[2, col]
        _lines(ax_rows, sub, colour, [("m_pad_rows_max", "o-"), ("m_bound_expert_rows", ":")])
        w = sorted(set(sub["world_size"]))
        ax_rows.plot(w, [(x - 1) * (tm - 1) for x in w], "k--", lw=2, label="paper (W-1)(tm-1)")
        ax_rows.plot([], [], "k:", label="E(W-1)(tm-1)")
        _lines(ax_share, sub, colour, [("share", "o-"), ("busiest", "x--")])
        ax_share.plot([], [], "kx--", label="busiest rank")
        at_e = d[(d["routing"] == routing) & (d["experts_per_rank"] == e_fix)]
        for tmv, s in at_e.groupby("p_tile_m"):
            s = s.sort_values("world_size")
            ax_tile.plot(s["world_size"], s["share"], "o-", label=f"tile_m={tmv:g}")
        ax_rows.set_yscale("log")
        ax_rows.set_title(f"{routing}, tile_m={tm}", fontsize=9)
        labels = ["max zero rows per rank", "padding share of GEMM rows (%)",
                  f"padding share, E={e_fix} (%)"]  # fmt: skip
        if tiles:
            _lines(axes[3, col], sub, colour, [("tiles", "o-")])
            axes[3, col].set_yscale("log", base=2)
            labels.append("row tiles, aligned / compact")
        for ax, what in zip(axes[:, col], labels):
            ax.set_xscale("log", base=2)
            ax.set(xlabel="ranks W (logical)", ylabel=what)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        ax_share.set_ylim(0, 100)
        ax_tile.set_ylim(0, 100)
    title = ("Zero padding of the remote-aligned layout (lower is better), CPU: exact counts "
             f"from the routing\ntokens/rank={tpr}, top-{int(d['top_k'].iloc[0])}")  # fmt: skip
    return save(fig, out_dir, name, title)


if __name__ == "__main__":
    main(plot, "results/padding.parquet", "padding")
