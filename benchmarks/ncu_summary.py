"""A short table from Nsight Compute's raw CSV (`ncu -i R.ncu-rep --page raw --csv`): per kernel
its time, SM / tensor-pipe / DRAM activity, L2 hit rate, registers and shared memory, and the
share of its warps' sampled stalls per reason (the largest first).

Usage: python -m benchmarks.ncu_summary RAW.csv [RAW.csv ...] [--top 8] [--out summary.parquet]
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pandas as pd

#: column label -> candidate metric names (the first present is taken)
METRICS = {
    "us": ["gpu__time_duration.sum"],
    "sm_pct": ["sm__throughput.avg.pct_of_peak_sustained_elapsed"],
    "tensor_pct": [
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    ],
    "dram_pct": [
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    ],
    "l2_hit": ["lts__t_sector_hit_rate.pct"],
    "dram_gb": ["dram__bytes_read.sum"],
    "regs": ["launch__registers_per_thread"],
    "smem_kb": ["launch__shared_mem_per_block_dynamic"],
    "grid": ["launch__grid_size"],
    "block": ["launch__block_size"],
    "ipc": ["sm__inst_executed.avg.per_cycle_active"],
}
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"


def read_raw(path: str | Path) -> pd.DataFrame:
    """ncu's raw CSV (a header row, a units row, one row per kernel) -> DataFrame of strings."""
    text = Path(path).read_text()
    start = text.find('"ID"')
    df = pd.read_csv(io.StringIO(text[start:]), dtype=str)
    return df.iloc[1:].reset_index(drop=True)  # drop the units row


def _num(s: pd.Series) -> pd.Series:
    return pd.to_numeric(s.str.replace(",", ""), errors="coerce")


def summarize(df: pd.DataFrame, top: int) -> pd.DataFrame:
    """One row per kernel: the METRICS and the `top` stall reasons as shares of all samples."""
    out = pd.DataFrame({"id": df["ID"], "kernel": df["Kernel Name"].str.slice(0, 48)})
    for label, names in METRICS.items():
        col = next((n for n in names if n in df.columns), None)
        out[label] = _num(df[col]) if col else float("nan")
    out["us"] = out["us"] / 1e3  # ns -> us
    out["dram_gb"] = out["dram_gb"] / 1e9
    out["smem_kb"] = out["smem_kb"] / 1024
    stalls = [c for c in df.columns if c.startswith(STALL_PREFIX) and not c.endswith("_not_issued")]
    if stalls:
        s = df[stalls].apply(_num).fillna(0)
        s.columns = [c[len(STALL_PREFIX) :] for c in stalls]
        share = s.div(s.sum(axis=1).where(lambda v: v > 0), axis=0)
        out["stalls"] = [
            ", ".join(f"{k} {v:.0%}" for k, v in row.nlargest(top).items() if v > 0)
            for _, row in share.iterrows()
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", nargs="+")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    frames = []
    for path in args.raw:
        s = summarize(read_raw(path), args.top)
        s.insert(0, "file", Path(path).stem)
        frames.append(s)
    df = pd.concat(frames, ignore_index=True)
    with pd.option_context("display.width", 250, "display.max_colwidth", 200):
        print(df.drop(columns=["stalls"], errors="ignore").round(2).to_string(index=False))
        if "stalls" in df:
            for _, r in df.iterrows():
                print(f"{r['file']} {r['kernel'][:32]}: {r['stalls']}")
    if args.out:
        df.to_parquet(args.out, index=False)


if __name__ == "__main__":
    main()
