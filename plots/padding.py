"""Padding of the remote-aligned layout against W, with both bounds. Lower is better.

Input: results/padding.parquet (experiments/padding.py). Output: <out>/<name>.png and .pdf.
Columns (one per routing):
  row 1  max zero rows per rank vs W, one line per E, with the paper's bound (W-1)(tile_m-1)
         (black dashed) and E(W-1)(tile_m-1) (dotted, the colour of its E)
  row 2  padding share of all GEMM rows (solid) and on the busiest rank (dashed), per E, and
         (dash-dot) what it would be with remote groups packed per expert (padded once)
  row 3  padding share of all GEMM rows per tile_m at one E
  row 4  (tables with m_tiles_*) the row tiles the producers compute, aligned (solid) and packed
         (dash-dot), over the compact layout's (= torch._grouped_mm's), per E
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from plots.common import FIG_DIR, load, save

ROUTINGS = ["balanced", "moderate_skew", "stress_skew"]


def _pick(values: pd.Series, want: int | None, default: int) -> int:
    vals = sorted(set(int(v) for v in values))
    if want is not None:
        if want not in vals:
            raise ValueError(f"{want} not in the table; choices: {vals}")
        return want
    return default if default in vals else vals[len(vals) // 2]


def plot(
    table: str | Path,
    out_dir: str | Path,
    name: str,
    tile_m: int | None = None,
    tokens: int | None = None,
    experts: int | None = None,
) -> list[Path]:
    df = load(table)
    if df.empty or "m_pad_share" not in df:
        raise ValueError(f"{table}: no padding rows with status ok to plot")
    tm = _pick(df["p_tile_m"], tile_m, 128)
    tpr = _pick(df["tokens_per_rank"], tokens, int(df["tokens_per_rank"].max()))
    e_fix = _pick(df["experts_per_rank"], experts, 16)
    d = df[df["tokens_per_rank"] == tpr]
    routings = [r for r in ROUTINGS if r in set(d["routing"])] or sorted(set(d["routing"]))
    es = sorted(set(int(v) for v in d["experts_per_rank"]))
    cmap = plt.get_cmap("viridis")
    colour = {e: cmap(i / max(1, len(es) - 1)) for i, e in enumerate(es)}
    tiles = "m_tiles_compact_total" in d  # tables before the compact layout lack it
    n_rows = 4 if tiles else 3
    fig, axes = plt.subplots(
        n_rows, len(routings), figsize=(4.6 * len(routings), 3.7 * n_rows), squeeze=False
    )
    for col, routing in enumerate(routings):
        sub = d[(d["routing"] == routing) & (d["p_tile_m"] == tm)]
        ax_rows, ax_share, ax_tile = axes[0, col], axes[1, col], axes[2, col]
        if tiles:
            ax_tiles = axes[3, col]
            for e in es:
                s = sub[sub["experts_per_rank"] == e].sort_values("world_size")
                ref = s["m_tiles_compact_total"]
                ax_tiles.plot(
                    s["world_size"],
                    s["m_tiles_aligned_total"] / ref,
                    "o-",
                    color=colour[e],
                    label=f"E={e}",
                )
                ax_tiles.plot(
                    s["world_size"], s["m_tiles_packed_total"] / ref, "s-.", ms=3, color=colour[e]
                )
            ax_tiles.plot([], [], "k-", label="aligned")
            ax_tiles.plot([], [], "ks-.", ms=3, label="packed")
            ax_tiles.set_ylabel("row tiles / compact's (grouped_mm's)")
            ax_tiles.set_xscale("log", base=2)
            ax_tiles.set_yscale("log", base=2)
            ax_tiles.set_xlabel("ranks W (logical)")
            ax_tiles.grid(alpha=0.3)
            ax_tiles.legend(fontsize=6)
        for e in es:
            s = sub[sub["experts_per_rank"] == e].sort_values("world_size")
            if s.empty:
                continue
            c = colour[e]
            ax_rows.plot(s["world_size"], s["m_pad_rows_max"], "o-", color=c, label=f"E={e}")
            ax_rows.plot(s["world_size"], s["m_bound_expert_rows"], ":", color=c)
            ax_share.plot(s["world_size"], 100 * s["m_pad_share"], "o-", color=c, label=f"E={e}")
            ax_share.plot(s["world_size"], 100 * s["m_pad_share_critical_rank"], "x--", color=c)
            if "m_pad_share_packed" in s:  # tables before the packed study lack it
                ax_share.plot(s["world_size"], 100 * s["m_pad_share_packed"], "s-.", ms=3, color=c)
        w = sorted(set(sub["world_size"]))
        ax_rows.plot(w, [(x - 1) * (tm - 1) for x in w], "k--", lw=2, label="paper (W-1)(tm-1)")
        ax_rows.plot([], [], "k:", label="E(W-1)(tm-1)")
        ax_share.plot([], [], "k-", label="all ranks")
        ax_share.plot([], [], "kx--", label="busiest rank")
        if "m_pad_share_packed" in d:
            ax_share.plot([], [], "ks-.", ms=3, label="packed layout, all ranks")
        for tmv, s in d[(d["routing"] == routing) & (d["experts_per_rank"] == e_fix)].groupby(
            "p_tile_m"
        ):
            s = s.sort_values("world_size")
            ax_tile.plot(s["world_size"], 100 * s["m_pad_share"], "o-", label=f"tile_m={tmv:g}")
        ax_rows.set_yscale("log")
        ax_rows.set_ylabel("max zero rows per rank")
        ax_rows.set_title(f"{routing}, tile_m={tm}", fontsize=9)
        ax_share.set_ylabel("padding share of GEMM rows (%)")
        ax_share.set_ylim(0, 100)
        ax_tile.set_ylabel(f"padding share, E={e_fix} (%)")
        ax_tile.set_ylim(0, 100)
        for ax in (ax_rows, ax_share, ax_tile):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("ranks W (logical)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(
        f"Zero padding of the remote-aligned layout (lower is better)\n"
        f"exact counts from the routing, tokens/rank={tpr}, top-{int(d['top_k'].iloc[0])}",
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, out_dir, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default="results/padding.parquet")
    ap.add_argument("--out", default=str(FIG_DIR))
    ap.add_argument("--name", default="padding")
    ap.add_argument("--tile-m", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    args = ap.parse_args()
    paths = plot(args.table, args.out, args.name, args.tile_m, args.tokens, args.experts)
    for p in paths:
        print(p)


if __name__ == "__main__":
    main()
