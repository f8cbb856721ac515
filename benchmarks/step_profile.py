"""Where a timed step's time goes, per rank: the kernel timeline of harness cells from
torch.profiler, each step cut at a marker kernel and reduced to its parts.

Every cell of the composed grid (the same Hydra overrides as harness.run) is set up and checked
as harness.measure does; then `--steps` timed steps run back to back under the profiler, each
behind a 1-cycle marker kernel on the step's stream. Per step and part (the kernels of one kind,
PARTS; any other kernel under its own name) it takes the first start and the last end, relative
to the marker's end, and the busy time (the union of the part's kernels); the row keeps the
median over the steps. For the overlap system the derived `lead_us` (step start to the
producer's start: the handshake on the step's stream, the launches), `tail_us` (the producer's
end to the consumer's: the combine left after the compute) and `after_us` (the consumer's end to
the step's: the receive wait and the scale) split its step into the waits the compute does not
hide.

One process: W > 1 cells are played on one GPU (loopback, a proxy). Under torchrun, one process
per GPU: every rank profiles its own timeline and rank 0 prints and writes them all.

Usage: python -m benchmarks.step_profile [--steps 20] [--out DIR] -- <overrides>
       torchrun --nproc-per-node 2 -m benchmarks.step_profile [--steps 20] [--out DIR] -- <...>
Writes DIR/step_profile.parquet (one row per cell, rank and part).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from benchmarks.profiling import busy_union, marked_kernels, split_steps

ROOT = Path(__file__).resolve().parents[1]

#: part -> substrings of the kernel names that make it (the first match wins)
PARTS = {
    "handshake": ("AllReduce", "barrier"),
    "producer": ("_producer_kernel",),
    "consumer": ("_consumer_kernel",),
    "wait": ("_wait_signals_kernel",),
    "scale": ("_scale_kernel", "_scale_persistent_kernel"),
    "nccl": ("nccl",),
}


def part_of(kernel: str) -> str:
    """The PARTS name of a kernel, or its name cut to 60 characters."""
    for part, keys in PARTS.items():
        if any(k in kernel for k in keys):
            return part
    return kernel[:60]


def step_parts(step: list[tuple[float, float, str]]) -> dict[str, dict[str, float]]:
    """One step's kernels [(start_us, end_us, name)], its marker first (split_steps): per part
    {start_us, end_us, busy_us}, times from the marker's end; "step" holds every kernel."""
    origin = step[0][1]
    by: dict[str, list[tuple[float, float]]] = {}
    for s, e, name in step[1:]:
        if name == "(next step)":
            continue
        iv = (s - origin, e - origin)
        by.setdefault(part_of(name), []).append(iv)
        by.setdefault("step", []).append(iv)
    return {
        part: {
            "start_us": min(s for s, _ in iv),
            "end_us": max(e for _, e in iv),
            "busy_us": busy_union(iv),
        }
        for part, iv in by.items()
    }


def median_parts(steps: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The median over steps of each part's start, end and busy time (parts in every step)."""
    common = set.intersection(*(set(s) for s in steps)) if steps else set()
    return {
        p: {k: statistics.median(s[p][k] for s in steps) for k in ("start_us", "end_us", "busy_us")}
        for p in sorted(common)
    }


def derived(parts: dict[str, dict[str, float]]) -> dict[str, float]:
    """lead_us, tail_us, after_us of an overlapped step (module docstring); {} without a
    producer and consumer."""
    if not {"producer", "consumer", "step"} <= set(parts):
        return {}
    prod, cons, step = parts["producer"], parts["consumer"], parts["step"]
    return {
        "lead_us": prod["start_us"],
        "tail_us": max(0.0, cons["end_us"] - prod["end_us"]),
        "after_us": step["end_us"] - max(cons["end_us"], prod["end_us"]),
    }


def profile_steps(fn, steps: int, warmup: int = 3) -> list[dict[str, dict[str, float]]]:
    """step_parts of `steps` marked, back-to-back calls of fn (the first profiled step, which
    holds the profiler's start, is dropped)."""
    ks = marked_kernels(fn, steps + 2, warmup)  # the last marker closes the last step
    return [step_parts(s) for s in split_steps(ks)[1:]]


def cell_rows(
    cell: dict, rank: int, processes: int, parts: dict[str, dict[str, float]], stamp: dict
) -> list[dict]:
    """One row per part, with the cell's workload and params, the derived waits, the number of
    processes (1 with W > 1: played on one GPU, loopback) and `stamp` (git_rev, GPU, versions)."""
    base = {k: cell[k] for k in ("system", "world_size", "out", "experts_per_rank", "routing")}
    base |= {"params": " ".join(f"{k}={v}" for k, v in sorted(cell["params"].items()))}
    base |= {"rank": rank, "processes": processes} | derived(parts) | stamp
    return [base | {"part": p} | v for p, v in parts.items()]


def _context():
    """(RunContext, world): torchrun's process group, else one process on GPU 0."""
    from harness.system import RunContext

    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    kw = {"timeout": timedelta(seconds=120), "device_id": dev}
    if "RANK" in os.environ:
        dist.init_process_group("nccl", **kw)
    else:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, **kw)
    return RunContext(rank, world, dev, None, "nccl"), world


def _fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2 (as harness.run)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main() -> None:
    from hydra import compose, initialize_config_dir

    from harness import measure
    from harness.config import register_configs
    from harness.errors import HarnessUserError
    from harness.records import Row, provenance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="", help="folder for step_profile.parquet")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.steps < 1:
        _fail(f"--steps must be >= 1, got {args.steps}")
    if not torch.cuda.is_available():
        _fail("step_profile profiles CUDA kernels: it needs a CUDA GPU")
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=args.overrides)
    try:  # the harness's own checks, before any process group: one line for bad input
        from harness.preflight import preflight

        preflight(cfg, int(os.environ.get("WORLD_SIZE", 1)), table=False)
    except HarnessUserError as exc:
        _fail(str(exc))
    ctx, world = _context()
    rows: list[dict] = []
    for cell in measure.expand_grid(cfg, world):
        name = f"{cell['system']} {cell['params']} E={cell['experts_per_rank']} "
        name += f"N={cell['out']} {cell['routing']}"
        p = measure.prepare_cell(ctx, cfg, cell)
        got = None
        if not isinstance(p, Row):
            parts = median_parts(profile_steps(p.system.timed, args.steps))
            got = cell_rows(cell, ctx.rank, world, parts, provenance())
        every = [None] * world
        if world > 1:
            dist.all_gather_object(every, got)
        else:
            every = [got]
        if ctx.rank != 0:
            continue
        if isinstance(p, Row):
            print(f"== {name}: {p.status} {p.reason}", flush=True)
            continue
        found = pd.DataFrame([r for rank_rows in every if rank_rows for r in rank_rows])
        rows += found.to_dict("records")
        show = found.pivot_table(index=["rank", "part"], values=["start_us", "end_us", "busy_us"])
        waits = found.groupby("rank")[[c for c in ("lead_us", "tail_us", "after_us") if c in found]]
        print(f"== {name}\n{show.round(1).to_string()}", flush=True)
        if waits.ngroups and len(waits.first().columns):
            print(waits.first().round(1).to_string(), flush=True)
    if ctx.rank == 0 and args.out and rows:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(Path(args.out) / "step_profile.parquet", index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
