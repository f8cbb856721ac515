"""Print a short summary of a results table: status counts per system, then the latency (ms) of
every ok row pivoted by workload x system, and where rows have them (GPU rows) the host's time
per step as a share of the step (near or above 1: host-bound) and its host syncs, per system.
Usage: python -m benchmarks.table_summary T.parquet [T2.parquet ...] [--by p_layout,p_consumer]
`--by`: instead the ok rows' latency per workload x variant (the system and the named columns:
"overlap/compact/shared"; a missing column reads ""), and serial / variant as x_<variant>."""

from __future__ import annotations

import argparse

import pandas as pd

from harness.records import read_table


def summarize(df: pd.DataFrame) -> str:
    lines = [df.groupby(["system", "status"]).size().unstack(fill_value=0).to_string()]
    bad = df[df["status"].isin(["fail", "error"])]
    for _, r in bad.head(10).iterrows():
        lines.append(f"{r['status']}: {r['system']} {r['cell_hash']}: {str(r['reason'])[:150]}")
    ok = df[df["status"] == "ok"]
    if len(ok):
        keys = [k for k in ("tokens_per_rank", "out", "experts_per_rank", "routing") if k in ok]
        best = ok.groupby(keys + ["system"])["latency_ms"].min().unstack("system")
        with pd.option_context("display.width", 250, "display.max_columns", 20):
            lines.append(best.round(3).to_string())
        if "m_host_ms" in ok and ok["m_host_ms"].notna().any():
            share = (ok["m_host_ms"] / ok["latency_ms"]).groupby(ok["system"])
            per = [f"{n} {g.median():.2f}, {g.max():.2f}" for n, g in share if g.notna().any()]
            lines.append("host time / step (median, max): " + ", ".join(per))
        if "m_host_syncs" in ok and ok["m_host_syncs"].notna().any():
            has = ok[ok["m_host_syncs"].notna()]
            syncs = has.groupby("system")["m_host_syncs"].agg(["min", "max"])
            per = [f"{n} {int(r['min'])}, {int(r['max'])}" for n, r in syncs.iterrows()]
            lines.append("host syncs / step (min, max): " + ", ".join(per))
    return "\n".join(lines)


def variants(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Latency (ms) of the ok rows [workload, variant], then serial / variant as x_<variant>
    columns where serial is in the table (the workload: the grid keys the rows have)."""
    ok = df[df["status"] == "ok"]
    label = ok["system"].astype(str)
    for col in by:
        vals = ok[col] if col in ok else pd.Series("", index=ok.index)
        label = label + "/" + vals.fillna("").astype(str)
    keys = [k for k in ("tokens_per_rank", "out", "experts_per_rank", "routing") if k in ok]
    keys = [k for k in keys if ok[k].nunique() > 1] or keys[-1:]
    lat = ok.assign(variant=label).pivot_table(index=keys, columns="variant", values="latency_ms")
    serial = [c for c in lat.columns if c.split("/")[0] == "serial"]
    if len(serial) == 1:
        for c in [c for c in lat.columns if c not in serial]:
            lat["x_" + c] = lat[serial[0]] / lat[c]
    return lat


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="+")
    ap.add_argument("--by", default="", help="row columns that name a variant, comma-separated")
    args = ap.parse_args()
    for path in args.tables:
        print(f"== {path}")
        df = read_table(path)
        if args.by:
            with pd.option_context("display.width", 250, "display.max_columns", 40):
                print(variants(df, args.by.split(",")).round(3).to_string())
        else:
            print(summarize(df))
