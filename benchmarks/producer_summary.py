"""Print a short summary of an experiment=producer table: status counts, then per producer
variant the ratios time(reference) / time(producer) against each reference (min / median / max
and the cells >= 1.00), then per workload the references against each other (grouped_mm and
the batched cuBLAS GEMM of the same weights, each over dense cuBLAS: how far the problem's shape
alone, E weight matrices of R / E rows each, stays from one dense GEMM).
Usage: python -m benchmarks.producer_summary T.parquet"""

from __future__ import annotations

import sys

import pandas as pd

from harness.records import read_table
from plots.producer import WORKLOAD, ratios

COLUMNS = {"vs_grouped_mm": "grouped_mm", "vs_cublas": "cuBLAS", "vs_bmm": "bmm"}


def summarize(df: pd.DataFrame) -> str:
    lines = [df.groupby(["system", "status"]).size().unstack(fill_value=0).to_string()]
    r = ratios(df)
    for col, name in COLUMNS.items():
        g = r.dropna(subset=[col]).groupby("variant")[col]
        if not len(g):
            continue
        at_least = g.apply(lambda s: int((s >= 1).sum()))
        t = pd.DataFrame(
            {
                "min": g.min(),
                "median": g.median(),
                "max": g.max(),
                ">=1": at_least,
                "cells": g.size(),
            }
        )
        lines.append(f"time({name}) / time(producer)\n{t.round(3).to_string()}")
    ok = df[df["status"] == "ok"]
    refs = ok[ok["system"] != "overlap"].pivot_table(
        index=[k for k in WORKLOAD if k != "tokens_per_rank"], columns="system", values="latency_ms"
    )
    if "cublas" in refs:
        rel = pd.DataFrame({s: refs["cublas"] / refs[s] for s in refs if s != "cublas"})
        lines.append(f"time(cuBLAS) / time(reference) per workload\n{rel.round(3).to_string()}")
    return "\n".join(lines)


if __name__ == "__main__":
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(summarize(read_table(sys.argv[1])))
