"""Figs 6-8: the overlap system against serial per cCTA and mgb (operator scope, one run): per
shape (rows) and routing (columns), latency(serial) / latency(overlap) against cCTA, one line per
(transport, mgb), higher is better; star: the measured optimum; red diamond: the auto pick at the
cCTA it ran with. Without serial rows (loopback) the panels show latency in ms. The notes say
whether the best, the runner-up and the auto pick lie apart beyond their 95% CIs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from plots.common import WORKLOAD_KD, load, main, need, palette, panels, save, transport_note

SHAPE = {"tokens_per_rank": "T", "hidden": "K", "out": "N", "experts_per_rank": "E"}


def overlap_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The ok overlap rows with `ccta`/`mgb` (NaN for `auto`), `auto` (both asked auto), `order`
    (p_order_used, else p_order) and `serial_ms`/`speedup` against serial (NaN without)."""
    df = df[df["status"] == "ok"]
    ser = df[df["system"] == "serial"].groupby(WORKLOAD_KD, as_index=False)["latency_ms"].min()
    o = df[df["system"] == "overlap"].copy()
    o["ccta"] = pd.to_numeric(o["p_ccta"], errors="coerce")
    o["mgb"] = pd.to_numeric(o["p_mgb"], errors="coerce")
    o["auto"] = (o["p_ccta"].astype(str) == "auto") & (o["p_mgb"].astype(str) == "auto")
    order = o["p_order"] if "p_order" in o else pd.Series("remote_first", index=o.index)
    o["order"] = (o["p_order_used"].fillna(order) if "p_order_used" in o else order).astype(str)
    o = o.merge(ser.rename(columns={"latency_ms": "serial_ms"}), on=WORKLOAD_KD, how="left")
    o["speedup"] = o["serial_ms"] / o["latency_ms"]
    return o


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per workload and transport: best measured (cCTA, mgb), its speedup over serial, cCTA=2
    against serial and against the best (> 1: slower), and the auto pick against the best."""
    o = overlap_rows(df)
    rows = []
    for key, g in o.groupby(WORKLOAD_KD + ["transport"], sort=True):
        swept = g.dropna(subset=["ccta", "mgb"])
        if swept.empty:
            continue
        best = swept.loc[swept["latency_ms"].idxmin()]
        hi = best["latency_ci_hi_ms"]  # apart: the best's 95% CI below the other row's
        rest = swept[swept.index != best.name]
        nxt = rest.loc[rest["latency_ms"].idxmin()] if len(rest) else None
        two = swept[swept["ccta"] == 2]["latency_ms"].min()
        auto = g[g["auto"]]
        a = auto.iloc[0] if len(auto) else dict.fromkeys(("p_ccta_used", "p_mgb_used"), np.nan)
        rows.append(dict(zip(WORKLOAD_KD + ["transport"], key)) | dict(
            best_ccta=int(best["ccta"]), best_mgb=int(best["mgb"]), best_ms=best["latency_ms"],
            serial_ms=best["serial_ms"], best_speedup=best["speedup"],
            ccta2_vs_serial=two / best["serial_ms"], ccta2_vs_best=two / best["latency_ms"],
            auto_ccta=a["p_ccta_used"], auto_mgb=a["p_mgb_used"],
            auto_vs_best=a.get("latency_ms", np.nan) / best["latency_ms"],
            best_apart=nxt is not None and bool(hi < nxt["latency_ci_lo_ms"]),
            auto_apart=bool(hi < a["latency_ci_lo_ms"]) if len(auto) else False,
        ))  # fmt: skip
    return pd.DataFrame(rows)


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    o = overlap_rows(df)
    need(o.dropna(subset=["ccta", "mgb"]), table, "ok overlap rows with a numeric cCTA and mgb")
    vs_serial = o["speedup"].notna().any()
    y = "speedup" if vs_serial else "latency_ms"
    ylabel = "speedup vs serial (higher is better)" if vs_serial else "ms (lower is better)"
    summ = summary(df).set_index(WORKLOAD_KD + ["transport"])
    order = (", " + o["order"] + " order") if o["order"].nunique() > 1 else ""
    o["line"] = o["transport"].astype(str) + order + ", mgb=" + o["mgb"].map("{:g}".format)
    colors = palette(o["line"].dropna())
    fig, cells = panels(o, SHAPE, 4.8, 3.8)
    for ax, _, sub, (t, k, n, e, routing) in cells:
        notes = []
        for line, s in sub.dropna(subset=["ccta", "mgb"]).groupby("line"):
            s = s.sort_values("ccta")
            ax.plot(s["ccta"], s[y], "o-", ms=3, color=colors[line], label=line)
        for key, g in sub.groupby(WORKLOAD_KD + ["transport"]):
            if key not in summ.index:
                continue
            r = summ.loc[key]
            best = r["best_speedup"] if vs_serial else r["best_ms"]
            ax.plot(r["best_ccta"], best, "k*", ms=12, label="best measured")
            a = g[g["auto"]]
            if len(a):
                ax.plot(a["p_ccta_used"], a[y], "rD", ms=7, label="auto pick")
            ci = "apart" if r["auto_apart"] else "within CIs"
            pick = f"best/auto ({r['auto_ccta']:g}, {r['auto_mgb']:g}) "
            pick += f"{1 / r['auto_vs_best']:.3f}x, {ci}"
            two = f"serial/cCTA=2 {1 / r['ccta2_vs_serial']:.2f}x, " if vs_serial else ""
            near = "apart from" if r["best_apart"] else "within CIs of"
            notes.append(
                f"{key[-1]}: best ({r['best_ccta']:g}, {r['best_mgb']:g}), {near} the next\n"
                f"{two}best/cCTA=2 {1 / r['ccta2_vs_best']:.2f}x\n"
                + (pick if pd.notna(r["auto_vs_best"]) else "auto not measured")
            )
        if vs_serial:
            ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"T={t} K={k} N={n} E={e}, {routing}\n" + "\n".join(notes), fontsize=7)
        ax.set(xlabel="cCTA (consumer SMs)", ylabel=ylabel)
        ax.legend(fontsize=6)
    what = "against serial" if vs_serial else "latency (no serial rows in this table)"
    return save(fig, out_dir, name, f"Overlap cCTA x mgb {what}\n{transport_note(df)}")


if __name__ == "__main__":
    main(plot, "results/ccta_mgb.parquet", "ccta_mgb", summary)
