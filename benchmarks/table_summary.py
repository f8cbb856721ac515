"""Print a short summary of a results table: status counts per system, then the latency (ms) of
every ok row pivoted by workload x system, and where the rows have it (GPU rows, harness.timing)
the host's time per step as a share of the step, per system (near or above 1: host-bound).
Usage: python -m benchmarks.table_summary T.parquet"""

from __future__ import annotations

import sys

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
            lines.append(
                "host time / step (median, max): "
                + ", ".join(
                    f"{name} {g.median():.2f}, {g.max():.2f}"
                    for name, g in share
                    if g.notna().any()
                )
            )
        if "m_host_syncs" in ok and ok["m_host_syncs"].notna().any():
            has = ok[ok["m_host_syncs"].notna()]
            syncs = has.groupby("system")["m_host_syncs"].agg(["min", "max"])
            lines.append(
                "host syncs / step (min, max): "
                + ", ".join(f"{n} {int(r['min'])}, {int(r['max'])}" for n, r in syncs.iterrows())
            )
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(f"== {path}")
        print(summarize(read_table(path)))
