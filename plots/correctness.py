"""The correctness matrix: every overlap cell's check against the float32 reference. A check is
a row with status ok (passed) or fail; skipped and error rows were not checked (counted apart).
Per (layout, transport, W, dtype) group, a heatmap of log10 max_rel_err over (E, N, routing) x
(cCTA, mgb), failed cells crossed; below, histograms of both errors with their bounds. Lower is
better."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from harness.check import DEFAULT_TOL, ROW_TOL_FACTOR
from plots.common import _col, grid, main, need, save, transport_note

GROUP = ["layout", "transport", "world_size", "dtype"]
QUANTILES = (0.5, 0.9, 0.99)


def with_layout(df: pd.DataFrame) -> pd.DataFrame:
    """df with `layout` (p_layout, else `aligned`), the asked transport where a row skipped
    before setup has none, and `max_row_rel_err` (NaN in tables older than the per-row check)."""
    tr = df["transport"].fillna("").astype(str)
    tr = tr.where(tr != "", _col(df, "p_transport").fillna("").astype(str))
    layout = _col(df, "p_layout").fillna("aligned").astype(str)
    row = _col(df, "max_row_rel_err").astype(float)
    return df.assign(layout=layout, transport=tr, max_row_rel_err=row)


def _stats(g: pd.DataFrame) -> dict:
    checked = g[g["status"].isin(["ok", "fail"])]
    rel, row = checked["max_rel_err"].dropna(), checked["max_row_rel_err"].dropna()
    ok = int((checked["status"] == "ok").sum())
    out = dict(checks=len(checked), passed=ok, failed=len(checked) - ok,
               not_checked=len(g) - len(checked), rel_err_max=rel.max())  # fmt: skip
    out |= {f"rel_err_p{round(100 * q)}": rel.quantile(q) for q in QUANTILES}
    return out | dict(row_err_max=row.max(), row_err_p99=row.quantile(0.99))


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Checks, passes, failures, not checked and error quantiles per GROUP, and for all."""
    df = with_layout(df[df["system"] == "overlap"])
    rows = [{**dict(zip(GROUP, key)), **_stats(g)} for key, g in df.groupby(GROUP, sort=True)]
    rows.append({**{k: "all" for k in GROUP}, **_stats(df)})
    return pd.DataFrame(rows)


def _heatmap(ax: plt.Axes, g: pd.DataFrame, tol: float) -> plt.cm.ScalarMappable:
    g = g.assign(ccta=pd.to_numeric(g["p_ccta"]), mgb=pd.to_numeric(g["p_mgb"]))
    ys = ["experts_per_rank", "out", "routing"]
    m = g.pivot_table(index=ys, columns=["ccta", "mgb"], values="max_rel_err", aggfunc="max")
    # inf (a broken output) and the 1e30 of an unmeasured rank show as the top colour (1.0)
    colour = np.log10(np.clip(m.to_numpy(dtype=float), 1e-8, 1.0))
    # one scale from a decade under the smallest error to the tolerance: alike errors look alike
    lo = min(np.floor(np.nanmin(colour)), np.log10(tol) - 1)
    im = ax.imshow(colour, aspect="auto", cmap="viridis", vmin=lo, vmax=np.log10(tol))
    failed = g[g["status"] == "fail"].set_index(ys + ["ccta", "mgb"]).index
    for i, y in enumerate(m.index):
        for j, x in enumerate(m.columns):
            if (*y, *x) in failed:
                ax.text(j, i, "x", color="red", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(m.columns)), [f"{c:g}/{b:g}" for c, b in m.columns], fontsize=5,
                  rotation=90)  # fmt: skip
    ax.set_yticks(range(len(m.index)), [f"E={e} N={n} {r}" for e, n, r in m.index], fontsize=5)
    ax.set_xlabel("cCTA / mgb")
    return im


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = with_layout(pd.read_parquet(table))
    checked = df[(df["system"] == "overlap") & df["status"].isin(["ok", "fail"])]
    df = need(checked, table, "checked overlap rows (status ok or fail)")
    groups = list(df.groupby(GROUP, sort=True))
    fig, axes = grid(2, max(2, len(groups)), 5.5, 5)
    tol = float(df["tol"].max()) if "tol" in df and df["tol"].notna().any() else DEFAULT_TOL
    for ax, (key, g) in zip(axes[0], groups):
        im = _heatmap(ax, g, tol)
        layout, tr, w, dt = key
        n_fail = int((g["status"] == "fail").sum())
        ax.set_title(f"{layout}, {tr}, W={w}, {dt}: {len(g) - n_fail}/{len(g)} passed", fontsize=8)
        fig.colorbar(im, ax=ax, label="log10 max_rel_err", format="%.2f")  # no offset notation
    for ax in axes[0][len(groups) :]:
        ax.axis("off")
    hists = (("max_rel_err", tol, "whole-tensor"), ("max_row_rel_err", ROW_TOL_FACTOR * tol, "row"))
    for ax, (col, bound, what) in zip(axes[1], hists):
        for key, g in groups:
            v = g[col].replace([np.inf], np.nan).dropna()
            v = v[v > 0]
            if len(v):
                ax.hist(np.log10(v), bins=30, histtype="step", label=", ".join(map(str, key)))
        ax.axvline(np.log10(bound), color="k", ls="--", label=f"bound {bound:.0e}")
        ax.set_xlabel(f"log10 {col} ({what} check; lower is better)")
        ax.set_ylabel("cells")
        ax.legend(fontsize=6)
    for ax in axes[1][2:]:
        ax.axis("off")
    s = summary(df).iloc[-1]
    work = [c for c in ("world_size", "experts_per_rank", "out", "routing", "dtype") if c in df]
    n, d = len(df[work].drop_duplicates()), len(df[[*work, "max_rel_err"]].drop_duplicates())
    title = (
        f"Correctness matrix: {s['passed']}/{s['checks']} checks passed ({n} workloads, {d} "
        f"distinct errors), max rel. error {s['rel_err_max']:.2e} (tol {tol:.0e})\n"
        f"{transport_note(df, timing=False)}"
    )
    return save(fig, out_dir, name, title)


if __name__ == "__main__":
    main(plot, "results/correctness.parquet", "correctness", summary)
