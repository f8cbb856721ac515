"""Where the host's time per timed step goes: cProfile over harness cells' timed region.

Every cell of the composed grid (the same Hydra overrides as harness.run; one process, so the
ranks of W > 1 are played on one GPU: loopback) is set up and checked as harness.measure does,
then its timed region runs `--steps` times while the device sleeps, so no launch ever waits for
the device: the host's own time per step. Per cell it prints host ms per step, the device ms per
step (the same steps back to back) and the functions with the most own time (cProfile).

With --launches (overlap cells) it also times, in microseconds per call, each launch of the
step alone (the producer, the consumer without waiting, the scale) and, for each Triton kernel,
the parts of one launch: Triton's whole launch path with the same arguments, its argument binder
alone, and the compiled kernel's own launcher alone (what a launch would cost with no binder).
In the layer scope (overlap) it times the parts of a step after the dispatch instead: stage A
(plan + padded gather), fc1, the plan swap, fc2 with the combine, the scale.

With --idle it profiles the timed steps run eagerly, back to back (as harness.measure times
them), and prints the device's idle time per step (span of the kernels minus their union over
every stream) and the longest gaps with the kernels on either side: the host's share of a
step that synchronises inside (the layer scope's dispatch), which the queued timing cannot
show.

Usage: python -m benchmarks.host_profile [--steps 20] [--top 25] [--launches] [--idle]
       -- <overrides>
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from harness import measure
from harness.config import register_configs
from harness.records import Row
from harness.system import RunContext
from harness.timing import sleep_device

ROOT = Path(__file__).resolve().parents[1]


def profile_cell(p, steps: int, top: int) -> str:
    """Host ms per step, device ms per step and the top functions of one prepared cell."""
    fn = p.system.timed
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dev = torch.device("cuda", torch.cuda.current_device())
    sleep_device(dev, 3000)  # 3 s: every launch below is queued
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    a.record()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    b.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / steps
    late = a.query()  # the sleep ended before the host was done: host time includes waiting
    torch.cuda.synchronize()
    dev_ms = a.elapsed_time(b) / steps
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    head = f"host {host_ms:.3f} ms/step (profiled), device {dev_ms:.3f} ms/step"
    return head + (" [LATE: not queued]" if late else "") + "\n" + out.getvalue()


def _queued_us(fn, calls: int) -> float:
    """Host microseconds per fn() call, every call enqueued while the device sleeps."""
    fn()
    torch.cuda.synchronize()
    dev = torch.device("cuda", torch.cuda.current_device())
    sleep_device(dev, 2000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return us


def relaunch_rows(memos: dict, names, calls: int) -> dict[str, float]:
    """Host us per remembered relaunch of each named memo that holds a launch, through the
    fast path (resolved arguments to Triton's C launcher) and through CompiledKernel.run with
    the bound arguments (HARNESS_RELAUNCH=bound): harness/kernels/relaunch.py. Only memos whose
    relaunch is safe alone (no wait on another kernel) may be named."""
    from harness.kernels import relaunch

    rows = {}
    for name in names:
        memo = memos.get(name)
        if memo is None or memo.compiled is None:
            continue
        fast = relaunch.FAST
        try:
            for mode in (True, False):
                relaunch.FAST = mode
                path = "fast path" if mode and memo.raw is not None else "bound args"
                rows[f"remembered {name}: relaunch ({path})"] = _queued_us(memo.launch, calls)
        finally:
            relaunch.FAST = fast
    return rows


def launch_table(p, calls: int) -> str:
    """Host us per launch of an overlap cell's kernels, and per part of Triton's launch."""
    from triton.runtime.jit import JITFunction

    sysm = p.system
    impl = getattr(sysm, "mode", None)
    ranks = getattr(impl, "ranks", None)
    if ranks is None:
        return "(no overlap ranks in this cell)"
    rk = ranks[getattr(impl, "busy", 0)]
    run = rk.runner
    recv = run.transport.recv
    seen: dict[str, tuple] = {}
    orig = JITFunction.run

    def spy(self, *args, grid, warmup, **kwargs):  # the last arguments of every kernel
        seen[self.fn.__name__] = (self, args, kwargs, grid)
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = spy
    try:
        rows = {
            "step (overlapped + local + scale)": _queued_us(
                lambda: (rk.step(), rk.scale(recv)), calls
            ),
            "producer launch": _queued_us(
                lambda: run._produce(rk.x, rk.y, True, run.num_programs), calls
            ),
            "consumer launch (no wait)": _queued_us(lambda: run._consume(rk.y, 0, False), calls),
            "scale": _queued_us(lambda: rk.scale(recv), calls),
        }
    finally:
        JITFunction.run = orig
    rows.update(relaunch_rows(run.memos, ("produce", "comm"), calls))
    dev = torch.cuda.current_device()
    stream = torch.cuda.current_stream().cuda_stream
    for name, (fn, args, kwargs, grid) in seen.items():
        binder = fn.device_caches[dev][4]
        bound = list(binder(*args, **kwargs)[0].values())
        c = fn.run(*args, grid=grid, warmup=True, **kwargs)
        g3 = tuple(grid) + (1,) * (3 - len(grid))

        def triton_launch(fn=fn, a=args, k=kwargs, grid=grid):
            fn.run(*a, grid=grid, warmup=False, **k)

        def binder_only(b=binder, a=args, k=kwargs):
            b(*a, **k)

        def launcher_only(c=c, b=bound, g=g3):
            c.run(g[0], g[1], g[2], stream, c.function, c.packed_metadata, None, None, None, *b)

        rows[f"{name}: triton launch"] = _queued_us(triton_launch, calls)
        rows[f"{name}: binder only"] = _queued_us(binder_only, calls)
        rows[f"{name}: compiled launcher only"] = _queued_us(launcher_only, calls)
    return "\n".join(f"  {us:8.1f} us  {what}" for what, us in rows.items())


def layer_table(p, calls: int) -> str:
    """Host us per call of the parts of an overlap layer step after its dispatch (queued)."""
    lr = getattr(p.system.mode, "layer", None)
    if lr is None:
        return "(no overlap layer in this cell)"
    from harness.scale import Scaler

    d = lr.held[0]
    plan, x_pad = lr.plan_for(d)
    h = lr.fc1(plan, x_pad)
    y = lr._fc2_combine(plan, h)
    rows = {
        "stage A (the builder's plan + padded gather)": _queued_us(lambda: lr.plan_for(d), calls),
        "stage A (a new plan, as before the builder)": _queued_us(
            lambda: lr.plan_for(d, own_plan=True), calls
        ),
        "fc1 + activation": _queued_us(lambda: lr.fc1(plan, x_pad), calls),
        "use_plan (the builder's plan again)": _queued_us(lambda: lr.runner.use_plan(plan), calls),
        "fc2 + combine (use_plan, overlapped)": _queued_us(lambda: lr._fc2_combine(plan, h), calls),
        "local copy + wait + scale": _queued_us(
            lambda: (
                lr.runner.local_copy(y),
                Scaler.on_device(d.pos, lr.gate, lr.rows)(lr.runner.transport.recv),
            ),
            calls,
        ),
    }
    # the builder's rows, groups, fill and gather kernels rewrite the plan from the same
    # inputs: each relaunch alone is safe
    rows.update(relaunch_rows(lr.builder.memos, sorted(lr.builder.memos), calls))
    return "\n".join(f"  {us:8.1f} us  {what}" for what, us in rows.items())


def idle_report(p, steps: int) -> str:
    """The device's idle time per eager timed step and its longest gaps."""
    from benchmarks.profiling import device_idle

    r = device_idle(p.system.timed, steps)
    head = (
        f"device, median of {r['steps']} steps: span {r['span_us']:.1f} us, busy "
        f"{r['busy_us']:.1f}, idle {r['idle_us']:.1f} "
        f"({r['idle_us'] / max(r['span_us'], 1e-9):.1%}); idle us per step before:"
    )
    gaps = [f"  {us:7.1f} us  {name[:100]}" for name, us in r["gaps"].items()]
    return "\n".join([head, *gaps])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--launches", action="store_true", help="per-launch host times too")
    ap.add_argument("--idle", action="store_true", help="device idle time of eager steps")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: host_profile needs a CUDA GPU (it profiles the host side of GPU steps)")
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=args.overrides)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = dist.HashStore()
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=120), device_id=dev
    )
    ctx = RunContext(0, 1, dev, None, "nccl")
    for cell in measure.expand_grid(cfg, 1):
        shape = {k: cell[k] for k in ("world_size", "out", "experts_per_rank", "routing")}
        name = f"{cell['system']} {cell['params']} {shape}"
        p = measure.prepare_cell(ctx, cfg, cell)
        if isinstance(p, Row):
            print(f"== {name}: {p.status} {p.reason}", flush=True)
            continue
        if args.idle:
            print(f"== {name}\n{idle_report(p, args.steps)}", flush=True)
        else:
            print(f"== {name}\n{profile_cell(p, args.steps, args.top)}", flush=True)
        if args.launches and cell["system"] == "overlap":
            lay = getattr(p.system, "layer", False)
            # the layer's parts launch up to ~10 kernels a call: 20 calls stay below the depth
            # of the device's launch queue (past it the host blocks until the sleep ends)
            print(layer_table(p, 20) if lay else launch_table(p, 200), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
