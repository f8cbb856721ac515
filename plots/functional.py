"""The functional run (experiment overlap_functional[_ranks]): the overlap system's Triton kernels
in Triton's CPU interpreter on tiny loopback cells, each checked against the reference layer. Not
a timing: one bar per overlap cell, its max relative error on a log axis (lower is better)
against the tolerance that gated it (dashed), and its status (alone where it has no error)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from plots.common import load, main, save, transport_note

CELL = ["world_size", "experts_per_rank", "routing", "tokens_per_rank", "hidden", "out", "ffn"]
COLOURS = {"ok": "tab:green", "fail": "tab:red", "error": "tab:gray", "skipped": "tab:gray"}


def cells(df: pd.DataFrame) -> pd.DataFrame:
    """One row per overlap cell in grid order: its label ("W=2 E=2 balanced T=32 K=32 N=64 op",
    and the layout where the table has several), status, max_rel_err and tol (NaN where none)."""
    o = df[df["system"] == "overlap"]
    if o.empty:
        raise ValueError("a functional table needs overlap rows")
    o = o.assign(ffn=o["ffn"] if "ffn" in o else 0)
    layouts = o["p_layout"].astype(str) if "p_layout" in o else pd.Series("", index=o.index)
    o = o.assign(layout=layouts if layouts.nunique() > 1 else "")
    o = o.sort_values([*CELL, "layout"], kind="stable")
    lab = [
        f"W={w} E={e} {r} T={t} K={k} N={n} {f'F={f}' if f else 'op'} {lay}".rstrip()
        for w, e, r, t, k, n, f, lay in o[[*CELL, "layout"]].values
    ]
    o = o.assign(cell=lab, tol=o["tol"] if "tol" in o else float("nan"))
    return o[["cell", "status", "max_rel_err", "tol"]].reset_index(drop=True)


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table, status=None)
    c = cells(df)
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.3 * len(c)))
    y = range(len(c))
    err = c["max_rel_err"].where(c["max_rel_err"] > 0)
    ax.barh(y, err, color=[COLOURS.get(s, "k") for s in c["status"]])
    floor = (err.min() / 10) if err.notna().any() else 1e-6
    for i, (s, e) in enumerate(zip(c["status"], err)):
        ax.text(floor if e != e else e, i, f" {s}", va="center", fontsize=7)
    for t in sorted(set(c["tol"].dropna())):
        ax.axvline(t, color="k", ls="--", lw=0.8, label=f"tolerance {t:g}")
    ax.set_xscale("log")
    top = max([1.0, *c["tol"].dropna(), *err.dropna()])
    ax.set_xlim(min(1e-5, floor), 2 * top)  # decades wide: major ticks only, none crowded
    ax.set_yticks(list(y), list(c["cell"]), fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("max relative error against the reference (lower is better)", fontsize=8)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right")
    ok = int((c["status"] == "ok").sum())
    title = (
        "The overlap system's kernels on the CPU: functional (Triton interpreter), not a timing\n"
        f"{ok} of {len(c)} cells ok; {transport_note(df[df['system'] == 'overlap'], timing=False)}"
    )
    return save(fig, out_dir, name, title)


if __name__ == "__main__":
    main(plot, "results/overlap_functional.parquet", "cpu_overlap_functional")
