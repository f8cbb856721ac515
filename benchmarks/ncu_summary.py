"""A short table from Nsight Compute's raw CSV (`ncu -i R.ncu-rep --page raw --csv`, plain or
.gz): per kernel its time, SM cycles and clock, tensor-pipe activity, HBM bytes read and
written, HBM throughput (% of peak), warps active (% of peak), L2 hit rate, instructions
issued, registers and shared memory, and the share of its warps' sampled stalls per reason
(the largest first).

Usage: python -m benchmarks.ncu_summary RAW.csv[.gz] [...] [--top 8] [--out summary.parquet]
[--impls grouped_mm,cublas,...] (the implementations' names in the order ncu_producer printed)
"""

from __future__ import annotations

import argparse
import gzip
import io
from pathlib import Path

import pandas as pd

#: column label -> (metric, the unit it is reported in here)
METRICS = {
    "us": ("gpu__time_duration.sum", "us"),
    "mcycles": ("sm__cycles_elapsed.avg", "Mcycle"),
    "ghz": ("sm__cycles_elapsed.avg.per_second", "GHz"),
    "tensor_pct": ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", "%"),
    "dram_read_mb": ("dram__bytes_read.sum", "MB"),
    "dram_write_mb": ("dram__bytes_write.sum", "MB"),
    "dram_pct": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "%"),
    "warps_active_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active", "%"),
    "l2_hit_pct": ("lts__t_sector_hit_rate.pct", "%"),
    "minst": ("smsp__inst_executed.sum", "Minst"),
    "regs": ("launch__registers_per_thread", ""),
    "smem_kb": ("launch__shared_mem_per_block_dynamic", "KB"),
    "grid": ("launch__grid_size", ""),
    "block": ("launch__block_size", ""),
}
#: ncu's unit names -> factor to the units above
SCALE = {
    "ns": 1e-3,
    "us": 1.0,
    "ms": 1e3,
    "s": 1e6,
    "nsecond": 1e-3,
    "usecond": 1.0,
    "msecond": 1e3,
    "second": 1e6,
    "cycle": 1e-6,
    "Kcycle": 1e-3,
    "Mcycle": 1.0,
    "hz": 1e-9,
    "Khz": 1e-6,
    "Mhz": 1e-3,
    "Ghz": 1.0,
    "byte": 1e-6,
    "Kbyte": 1e-3,
    "Mbyte": 1.0,
    "Gbyte": 1e3,
    "inst": 1e-6,
    "Kinst": 1e-3,
    "Minst": 1.0,
    "Ginst": 1e3,
    "Kbyte/block": 1.0,
    "byte/block": 1e-3,
}
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"


def read_raw(path: str | Path) -> tuple[pd.DataFrame, pd.Series]:
    """ncu's raw CSV (a header row, a units row, one row per kernel) -> (rows as strings,
    the unit of each column)."""
    path = Path(path)
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode()
    df = pd.read_csv(io.StringIO(text[text.find('"ID"') :]), dtype=str)
    return df.iloc[1:].reset_index(drop=True), df.iloc[0].fillna("")


def _num(s: pd.Series) -> pd.Series:
    return pd.to_numeric(s.str.replace(",", ""), errors="coerce")


def summarize(
    df: pd.DataFrame, units: pd.Series, top: int, impls: list[str] | None = None
) -> pd.DataFrame:
    """One row per kernel: the METRICS and the `top` stall reasons as shares of all samples;
    impls names the main kernels in launch order (benchmarks/ncu_producer.py prints them)."""
    out = pd.DataFrame({"id": df["ID"], "kernel": df["Kernel Name"].str.slice(0, 48)})
    for label, (col, _) in METRICS.items():
        if col in df.columns:
            out[label] = _num(df[col]) * SCALE.get(units[col], 1.0)
        else:
            out[label] = float("nan")
    # the implementations' main kernels in launch order (their preparation kernels skipped)
    main = ~out["kernel"].str.contains("prepare")
    if impls:
        names = iter(impls)
        out["impl"] = [next(names, "") if m else "" for m in main]
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
    ap.add_argument("--impls", default="", help="comma-separated names of the main kernels")
    args = ap.parse_args()
    frames = []
    for path in args.raw:
        s = summarize(*read_raw(path), args.top, [i for i in args.impls.split(",") if i])
        s.insert(0, "file", Path(path).name.split(".")[0])
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
