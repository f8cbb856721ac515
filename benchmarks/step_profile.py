"""Where a timed step's time goes, per rank: harness cells' kernel timelines (torch.profiler).

Every cell of the composed grid (the Hydra overrides of harness.run) is set up and checked as
harness.measure does; then `--steps` timed steps run back to back under the profiler, each
behind a 1-cycle marker kernel. Per step and part (PARTS, else the kernel's name): first start
and last end from the marker's end, and busy time; a row keeps the median over the steps. The
overlap system's waits the compute does not hide: `lead_us` (step start to the producer's
start: the handshake all-reduce, the launches), `tail_us` (producer end to consumer end: the
combine left after the compute), `after_us` (consumer end to step end: the receive wait and the
scale). One process plays W > 1 cells on one GPU (loopback, a proxy); under torchrun every rank
profiles its own timeline and rank 0 writes them all to DIR/step_profile.parquet (a row per
cell, rank and part). --idle prints instead the device's idle time per step (idle_report): the
host's share of a step that synchronises inside (the layer scope's dispatch).
Usage: python -m benchmarks.step_profile [--steps 20] [--out DIR] [--idle] -- <overrides>
       torchrun --nproc-per-node 2 -m benchmarks.step_profile [--steps 20] [--out DIR] -- <...>
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (any order, overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def idle_gaps(kernels: list[tuple[float, float, str]]) -> dict:
    """Device idle time of one step's kernels [(start_us, end_us, name)], never empty (its
    marker; every stream): span (first start to last end), busy (union of the kernels), idle =
    span - busy, and `gaps`: {kernel name: idle us just before it}."""
    ks = sorted(kernels)
    span = max(e for _, e, _ in ks) - ks[0][0]
    busy = busy_union([(s, e) for s, e, _ in ks])
    gaps: dict[str, float] = {}
    end = ks[0][1]
    for s, e, name in ks[1:]:
        if s > end:
            gaps[name] = gaps.get(name, 0.0) + s - end
        end = max(end, e)
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "gaps": gaps}


#: torch.cuda._sleep's kernel (demangled "at::cuda::(anonymous namespace)::spin_kernel(long)"):
#: the step boundaries of idle_report
MARKER = "spin_kernel"


def split_steps(kernels: list[tuple[float, float, str]]) -> list[list[tuple[float, float, str]]]:
    """One list per step: its MARKER kernel, the kernels up to the next marker, and that next
    marker renamed "(next step)" (so the host's time between steps counts as idle there);
    kernels before the first marker and after the last are dropped."""
    steps: list[list] = []
    for k in sorted(kernels):
        if MARKER in k[2]:
            if steps:
                steps[-1].append((k[0], k[1], "(next step)"))
            steps.append([k])
        elif steps:
            steps[-1].append(k)
    return steps[:-1]


def marked_kernels(step: Callable[[], object], calls: int) -> list[tuple[float, float, str]]:
    """Every device kernel [(start_us, end_us, name)] of `calls` back-to-back calls of `step`,
    each behind a 1-cycle MARKER kernel, under torch.profiler after 3 unprofiled calls."""
    from torch.autograd import DeviceType

    def marked():
        torch.cuda._sleep(1)
        step()

    for _ in range(3):
        marked()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            marked()
        torch.cuda.synchronize()
    return [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]


def _top(per_step: list[list[tuple[str, float]]], top: int) -> dict[str, float]:
    """(name, us) pairs of each step summed per name over the steps, per step, the `top` most."""
    total: dict[str, float] = {}
    for pairs in per_step:
        for name, us in pairs:
            total[name] = total.get(name, 0.0) + us / len(per_step)
    return dict(sorted(total.items(), key=lambda kv: -kv[1])[:top])


def idle_report(step: Callable[[], object], reps: int, top: int = 16) -> str:
    """The device's idle time per step of `step` (eager or a graph's replay) over `reps` marked
    steps (marked_kernels): the median step's idle_gaps span, busy and idle us, then the us per
    step idle before and busy in each kernel name (the `top` most), averaged over the steps."""
    ks = marked_kernels(step, reps + 1)  # the last marker closes the last step
    steps = split_steps(ks)[1:]  # the 1st: the profiler's start
    if not steps:
        names = sorted({k[2][:80] for k in ks})[:12]
        raise RuntimeError(f"device_idle: no {MARKER} step markers among the kernels {names}")
    per = [idle_gaps(k) for k in steps]
    r = sorted(per, key=lambda r: r["idle_us"])[len(per) // 2]
    gaps = _top([list(p["gaps"].items()) for p in per], top)
    kernels = _top([[(name, e - s) for s, e, name in k] for k in steps], top)
    head = (
        f"device, median of {len(per)} steps: span {r['span_us']:.1f} us, busy "
        f"{r['busy_us']:.1f}, idle {r['idle_us']:.1f} "
        f"({r['idle_us'] / max(r['span_us'], 1e-9):.1%}); idle us per step before:"
    )
    lines = [head, *(f"  {us:7.1f} us  {k[:100]}" for k, us in gaps.items())]
    lines.append("kernel time per step:")
    lines += [f"  {us:7.1f} us  {k[:100]}" for k, us in kernels.items()]
    return "\n".join(lines)


Parts = dict[str, dict[str, float]]  # part -> {start_us, end_us, busy_us}
#: part -> substrings of the kernel names that make it (the first match wins)
PARTS = {
    "handshake": ("AllReduce",),  # the overlap system's handshake is one all-reduce
    "producer": ("_producer_kernel",),
    "consumer": ("_consumer_kernel",),
    "wait": ("_wait_signals_kernel",),
    "scale": ("_scale_kernel",),
    "nccl": ("nccl",),
}


def step_parts(step: list[tuple[float, float, str]]) -> Parts:
    """One step's kernels [(start_us, end_us, name)], its marker first (split_steps): per part
    (PARTS, else the kernel's name cut to 60 characters) {start_us, end_us, busy_us}, times from
    the marker's end; "step" holds every kernel."""
    origin = step[0][1]
    by: dict[str, list[tuple[float, float]]] = {}
    for s, e, name in step[1:]:
        if name == "(next step)":
            continue
        iv = (s - origin, e - origin)
        part = next((p for p, keys in PARTS.items() if any(k in name for k in keys)), name[:60])
        by.setdefault(part, []).append(iv)
        by.setdefault("step", []).append(iv)
    return {
        part: {
            "start_us": min(s for s, _ in iv),
            "end_us": max(e for _, e in iv),
            "busy_us": busy_union(iv),
        }
        for part, iv in by.items()
    }


def median_parts(steps: list[Parts]) -> Parts:
    """The median over steps of each part's start, end and busy time (parts in every step)."""
    common = set.intersection(*(set(s) for s in steps)) if steps else set()
    return {
        p: {k: statistics.median(s[p][k] for s in steps) for k in ("start_us", "end_us", "busy_us")}
        for p in sorted(common)
    }


def cell_rows(cell: dict, rank: int, processes: int, parts: Parts, stamp: dict) -> list[dict]:
    """One row per part, with the cell's workload and params, the number of processes (1 with
    W > 1: played on one GPU, loopback), lead_us, tail_us and after_us where a producer and a
    consumer ran (module docstring), and `stamp` (git_rev, GPU, versions)."""
    base = {k: cell[k] for k in ("system", "world_size", "out", "experts_per_rank", "routing")}
    base |= {"params": " ".join(f"{k}={v}" for k, v in sorted(cell["params"].items()))}
    base |= {"rank": rank, "processes": processes}
    if {"producer", "consumer", "step"} <= set(parts):
        prod, cons, step = parts["producer"], parts["consumer"], parts["step"]
        base["lead_us"] = prod["start_us"]
        base["tail_us"] = max(0.0, cons["end_us"] - prod["end_us"])
        base["after_us"] = step["end_us"] - max(cons["end_us"], prod["end_us"])
    return [base | stamp | {"part": p} | v for p, v in parts.items()]


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2 (as harness.run)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def prepared_cells(overrides: list[str], who: str):
    """Yield (ctx, world, cell name, cell, prepared cell or its not-ok Row) for every cell of
    the composed grid, set up and checked as harness.measure does; one line for bad input."""
    from hydra import compose, initialize_config_dir

    from harness import measure
    from harness.config import register_configs
    from harness.errors import HarnessUserError
    from harness.preflight import preflight
    from harness.system import RunContext

    if not torch.cuda.is_available():
        fail(f"{who} profiles CUDA kernels: it needs a CUDA GPU")
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:  # the harness's own checks, before any process group
        preflight(cfg, world, table=False)
    except HarnessUserError as exc:
        fail(str(exc))
    # torchrun's process group, else one process on GPU 0
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    kw = {"timeout": timedelta(seconds=120), "device_id": dev}
    if "RANK" in os.environ:
        dist.init_process_group("nccl", **kw)
    else:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, **kw)
    ctx = RunContext(int(os.environ.get("RANK", 0)), world, dev, None, "nccl")
    for cell in measure.expand_grid(cfg, world):
        name = f"{cell['system']} {cell['params']} E={cell['experts_per_rank']} "
        name += f"N={cell['out']} {cell['routing']}"
        yield ctx, world, name, cell, measure.prepare_cell(ctx, cfg, cell)
    dist.destroy_process_group()


def _show(name: str, found: pd.DataFrame) -> None:
    """Print one cell's parts per rank and its derived waits."""
    show = found.pivot_table(index=["rank", "part"], values=["start_us", "end_us", "busy_us"])
    waits = found.groupby("rank")[[c for c in ("lead_us", "tail_us", "after_us") if c in found]]
    print(f"== {name}\n{show.round(1).to_string()}", flush=True)
    if waits.ngroups and len(waits.first().columns):
        print(waits.first().round(1).to_string(), flush=True)


def main() -> None:
    from harness.records import Row, provenance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="", help="folder for step_profile.parquet")
    ap.add_argument("--idle", action="store_true", help="the device's idle time per step")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.steps < 1:
        fail(f"--steps must be >= 1, got {args.steps}")
    rows: list[dict] = []
    for ctx, world, name, cell, p in prepared_cells(args.overrides, "step_profile"):
        ok = not isinstance(p, Row)
        if ok and args.idle:
            how = "graph replay" if p.row.graph else "eager"  # the step the harness times
            print(f"== {name} [{how}] (rank {ctx.rank})\n{idle_report(p.step, args.steps)}")
            continue
        got = None
        if ok:
            # +2: the last marker closes the last step, the first (the profiler's start) drops
            ks = marked_kernels(p.step, args.steps + 2)
            parts = median_parts([step_parts(s) for s in split_steps(ks)[1:]])
            got = cell_rows(cell, ctx.rank, world, parts, provenance())
        every = [got]
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, got)
        if ctx.rank != 0:
            continue
        if not ok:
            print(f"== {name}: {p.status} {p.reason}", flush=True)
            continue
        found = pd.DataFrame([r for rank_rows in every if rank_rows for r in rank_rows])
        rows += found.to_dict("records")
        _show(name, found)
    if rows and args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(Path(args.out) / "step_profile.parquet", index=False)


if __name__ == "__main__":
    main()
