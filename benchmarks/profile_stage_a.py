"""Kernel times of the layer's stage A on the device (build_plan_device + the padded gather),
from torch.profiler, per kernel, for a few Table 2 shapes: where its time goes.

Usage: python -m benchmarks.profile_stage_a [--world-size 2] [--layouts aligned,compact]
[--experts 16,64] [--label TEXT] [--out DIR]; prints one table per shape and layout (kernel,
calls, total us per plan) and writes stage_a_profile.parquet (--name changes the file name; the
rows carry --label, e.g. the code revision measured).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd
import torch

from benchmarks.profiling import kernel_times
from harness.layout import rank_layout
from harness.workload import WorkloadSpec
from systems.overlap.plan_device import build_plan_device, padded_input_device


def run(spec: WorkloadSpec, reps: int, layout: str) -> pd.DataFrame:
    dev = torch.device("cuda")
    lay = rank_layout(spec, 0)
    src, exp, dst = (t.to(dev) for t in (lay.recv_src, lay.recv_expert, lay.recv_dst_index))
    x = torch.randn(src.numel(), spec.hidden, device=dev, dtype=torch.bfloat16)
    send = lay.send_counts.to(dev)

    def stage_a():
        plan = build_plan_device(
            src,
            exp,
            dst,
            world_size=spec.world_size,
            rank=0,
            experts_per_rank=spec.experts_per_rank,
            tile_m=128,
            mgb=1,
            out_cols=spec.out,
            elem_bytes=2,
            send_counts=send,
            layout=layout,
        )
        return padded_input_device(x, plan)

    rows = [
        {"kernel": r["kernel"][:60], "calls": int(r["calls"]), "us_per_plan": r["us"]}
        for r in kernel_times(stage_a, reps)
    ]
    df = pd.DataFrame(rows).sort_values("us_per_plan", ascending=False)
    for k in ("tokens_per_rank", "out", "experts_per_rank", "world_size", "routing"):
        df[k] = getattr(spec, k)
    df["layout"] = layout
    return df


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layouts", default="aligned,compact")
    ap.add_argument("--experts", default="16,64")
    ap.add_argument("--label", default="")
    ap.add_argument("--name", default="stage_a_profile.parquet")
    args = ap.parse_args()
    layouts = [v for v in args.layouts.split(",") if v]
    bad = [v for v in layouts if v not in ("aligned", "compact")]
    if bad or not layouts:
        ap.error(f"--layouts: the device plan builds aligned or compact, got {args.layouts!r}")
    try:
        experts = [int(v) for v in args.experts.split(",") if v]
    except ValueError:
        experts = []
    if not experts or min(experts) < 1:
        ap.error(f"--experts: comma-separated integers >= 1, got {args.experts!r}")
    if not torch.cuda.is_available():
        sys.exit("error: profile_stage_a needs a CUDA GPU (it profiles the device plan's kernels)")
    frames = []
    for layout in layouts:
        for E in experts:
            for routing in ("balanced", "stress_skew"):
                spec = WorkloadSpec(8192, 4096, 4096, E, 2, args.world_size, routing, "bfloat16")
                df = run(spec, args.reps, layout)
                df["label"] = args.label
                frames.append(df)
                print(
                    f"== {layout} T=8192 E={E} W={args.world_size} {routing}: "
                    f"{df['us_per_plan'].sum():.0f} us of kernels per plan"
                )
                show = df[["kernel", "calls", "us_per_plan"]].round(1).head(8)
                print(show.to_string(index=False))
    path = Path(args.out) / args.name
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.concat(frames).to_parquet(path, index=False)


if __name__ == "__main__":
    main()
