"""Summarise a consumer-placement table (the overlap system's `consumer` x cCTA, one table):
per workload the step latency (ms) of every placement, its ratio to the first placement, and
latency / compute_ms (compute_ms: the producer alone on ALL SMs, no consumer), the distance to
the compute bound that the cCTA SMs and the consumer's concurrent copies cost.
Usage: python -m benchmarks.consumer_summary T.parquet"""

from __future__ import annotations

import sys

import pandas as pd

from harness.records import read_table
from plots.common import placements


def summarize(df: pd.DataFrame) -> str:
    ok = placements(df)
    if ok.empty:
        return "no ok overlap rows"
    keys = ["out", "experts_per_rank", "routing"]
    lat = ok.pivot_table(index=keys, columns="placement", values="latency_ms", aggfunc="min")
    ok["x_compute"] = ok["latency_ms"] / ok["compute_ms"]
    bound = ok.pivot_table(index=keys, columns="placement", values="x_compute", aggfunc="min")
    first = lat.columns[0]
    rel = lat.div(lat[first], axis=0)
    lines = ["latency (ms)", lat.round(3).to_string()]
    lines += [f"latency / {first}'s", rel.round(3).to_string()]
    lines += ["latency / compute on all SMs", bound.round(3).to_string()]
    med = pd.DataFrame({"rel_median": rel.median(), "x_compute_median": bound.median()})
    med["faster_than_first"] = (rel < 1).sum()
    lines += ["per placement", med.round(3).to_string()]
    return "\n".join(lines)


if __name__ == "__main__":
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        for path in sys.argv[1:]:
            print(f"== {path}")
            print(summarize(read_table(path)))
