"""The dispatch's received-row labels (harness/kernels/dispatch.py recv_rows) at each bound.

The layer dispatch labels the rows a rank receives before its host sync, so at a bound on
their count (harness/dispatch.py LayerDispatch.bound). For each (W, E, T, k), with every rank
receiving its average T*k rows spread evenly over the W*E (source, expert) blocks:
  exact  rows = R = T*k (what a dispatch that waits for the sync launches)
  most   rows = W*T*k (the bound of revs acc12ad to d6155bc)
  bound  rows = min(W*T*k, 2*T*k) (the dispatch's first bound since 6ba15fe)
Columns: ms (median of iters, CUDA events around one call: the host's launch included),
kernel_us (the device's kernel time per call, torch.profiler), label_rows, label_mb (the four
int64 label arrays), status (every real row labelled, -1 past them).
Usage: python -m benchmarks.label_bound [--out DIR] [--small] (prints the table last; on the CPU
only under TRITON_INTERPRET=1, where --small keeps it short).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import pandas as pd
import torch

from benchmarks.plan_time import time_ms
from benchmarks.profiling import kernel_times
from harness.kernels.dispatch import recv_rows

FULL = {"world": [2, 8, 64], "experts": [4, 64], "tokens": [8192], "top_k": [2, 8]}
SMALL = {"world": [2, 4], "experts": [2], "tokens": [16], "top_k": [2]}


def measure(W: int, E: int, T: int, k: int, device: torch.device, iters: int) -> list[dict]:
    R = T * k
    counts = torch.full((W, E), R // (W * E), dtype=torch.int64)
    counts.view(-1)[: R % (W * E)] += 1
    offs = torch.zeros(W, E, dtype=torch.int64)  # offsets do not change the kernel's work
    counts, offs = counts.to(device), offs.to(device)
    modes = {"exact": R, "most": W * R, "bound": min(W * R, 2 * R)}
    rows = []
    for mode, n in modes.items():
        call = lambda n=n: recv_rows(counts, offs, n, True)  # noqa: E731
        ms = time_ms(call, device, 3, iters)
        us = sum(r["us"] for r in kernel_times(call, 5)) if device.type == "cuda" else float("nan")
        got = call()
        ok = int((got[0][:R] >= 0).sum()) == R and bool((got[0][R:] == -1).all())
        rows.append(
            dict(world_size=W, experts_per_rank=E, tokens_per_rank=T, top_k=k, mode=mode,
                 label_rows=n, label_mb=4 * 8 * n / 2**20, ms=statistics.median(ms), kernel_us=us,
                 status="ok" if ok else "wrong")
        )  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/label_bound")
    ap.add_argument("--small", action="store_true", help="a tiny grid (the CPU interpreter)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("label_bound: needs a CUDA GPU (or TRITON_INTERPRET=1 with --small)")
    device = torch.device("cuda" if cuda else "cpu")
    grid = SMALL if args.small or not cuda else FULL
    rows = []
    for W in grid["world"]:
        for E in grid["experts"]:
            for T in grid["tokens"]:
                for k in grid["top_k"]:
                    rows += measure(W, E, T, k, device, 20 if cuda else 2)
    df = pd.DataFrame(rows)
    df["gpu_name"] = torch.cuda.get_device_name() if cuda else "cpu"
    df["git_rev"] = os.environ.get("HARNESS_GIT_REV", "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out / "label_bound.parquet")
    keys = ["world_size", "experts_per_rank", "top_k"]
    wide = df.pivot_table(index=keys, columns="mode", values=["ms", "kernel_us"])
    print(wide.round(4).to_string())
    print("status:", df.status.value_counts().to_dict())


if __name__ == "__main__":
    main()
