"""Fig 3a: consumer bandwidth against transfer (segment) size, one line per cCTA, one panel per
transport. Higher is better. Input: benchmarks/bandwidth.py's table (loopback on one GPU is a
local copy, never an interconnect figure; the panel title says which transport it is).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from plots.common import cli, save


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    import pandas as pd

    df = pd.read_parquet(table)
    df = df[df["status"] == "ok"]
    if df.empty:
        raise ValueError(f"{table}: no ok rows")
    transports = list(dict.fromkeys(df["transport"]))
    fig, axes = plt.subplots(
        1, len(transports), figsize=(4.5 * len(transports), 3.8), squeeze=False
    )
    for ax, tr in zip(axes[0], transports):
        sub = df[df["transport"] == tr]
        for ccta, s in sub.groupby("ccta"):
            s = s.sort_values("bytes")
            ax.plot(s["bytes"] / 1024, s["gbps"], marker="o", ms=3, label=f"cCTA={int(ccta)}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("segment size (KiB)")
        ax.set_ylabel("GB/s (higher is better)")
        ax.set_title(tr, fontsize=9)
        ax.legend(fontsize=7)
    gpu = ", ".join(sorted(set(df["gpu"].astype(str)))) if "gpu" in df else "?"
    fig.suptitle(
        f"Consumer bandwidth vs transfer size (Fig 3a); {gpu}, one GPU", fontsize=9, y=1.03
    )
    fig.tight_layout()
    return save(fig, out_dir, name)


if __name__ == "__main__":
    args = cli("results/reference/h200/bandwidth.parquet", "bandwidth")
    for p in plot(args.table, args.out, args.name):
        print(p)
