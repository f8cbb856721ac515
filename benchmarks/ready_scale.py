"""Can the scale hide under the producer? The ready scale prototype on one GPU, W=1.

The step's scale (out[t] = sum_j gate[t, j] * recv[pos[t, j]]) runs after the last row has
arrived: 5-11% of the overlapped step on one GPU playing W=2
(results/reference/h200/step_profile_loopback_923cfb7.parquet: 48 us at N=4096, 95 us at
N=8192). systems/overlap/kernels/ready_scale.py starts it with the producer and scales each
token tile once the bands holding its rows are signalled (ready_order.py sorts the tokens by
their latest band in the waves model of benchmarks/token_ready.py). At W=1 every row is the own
producer's (local=direct, every band signalled), so this measures what the idea can buy before
any peer's rows are involved: per workload (T=8192, K=2048, compact, the auto order, the
shipped tile table, bf16) the producer then the Scaler on one stream (`sequential`, what the
step does today), the producer alone, the Scaler alone, and per VARIANT the producer with the
ready scale beside it (`beside*`: the producer on all SMs and the programs next to its CTAs,
when that many fit beside them by the compiled kernels' registers and shared memory; skipped
with the reason otherwise) or with SMs left to it (`own*`: the producer on SMs - programs; the
scheduler may still put scale programs beside producer CTAs). The producer runs on a
high-priority stream so its CTAs are placed first. Every variant's output is first checked
equal to the sequential one, within bf16's rounding, in 3 runs with the receive buffer and the
output filled with NaN first (a row read before its band was signalled shows); then a control
run that does not wait (target 0) must fail that check (`control_caught`), else the scale did
not overlap the producer and the check proved nothing. Each time is the median of CUDA-event
timings queued ahead (harness.timing.time_fn); the tokens' order comes from the waves model at
the variant's producer grid. hidden = (sequential - variant) / scale alone:
the share of the scale the variant took off the step. alone_ms: the variant's kernel by
itself once every band is signalled (its own speed against the Scaler's `scale` row; with a
claim counter it includes the counter's reset, a memset), tail_alone_ms the same for a tail launch.
producer_span_ms / producer_beside_ms: the producer's span between two one-thread %globaltimer
stamps queued around it (observer.stamp; median of 5 runs, each queued behind a sleep kernel so
the host's launch time is not inside the span; in ready_scale_908d066.parquet it was, and the
spans ran 0.1-0.2 ms longer than the event-timed producer), alone at the variant's grid and
inside the concurrent run: what the scale's programs cost the producer beside them.

Each workload runs in a process of its own that appends every row as it is made
(DIR/ready_scale_rows/<N>_<E>_<routing>.jsonl): a process that dies (a CUDA fault ends its
context) leaves an error row for the variant it was running, the next process runs the rest,
and a second run over the same DIR resumes without duplicates.

Usage: python -m benchmarks.ready_scale [--out DIR] [--n 4096,8192] [--experts 4,16,64]
[--routing balanced,stress_skew] [--variants beside132,own16] [--iters 20] [--timeout 240];
writes ready_scale.parquet and prints a table. Measured: results/reference/h200/ready_scale_*.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import pandas as pd
import torch

from benchmarks.token_ready import parse_grid, rank_plans, wave_band_times
from harness.records import provenance
from harness.scale import Scaler
from harness.timing import time_fn
from harness.workload import WorkloadSpec
from systems.overlap.autotune import auto_order

T, K, TOP_K, TILE_M, LAYOUT = 8192, 2048, 2, 128, "compact"


@dataclass(frozen=True)
class Variant:
    """The ready scale beside the producer: programs, tokens per tile, columns per step, warps,
    SMs taken from the producer, ns slept between polls, poll (atomic reads or ld.acquire loads
    of the band counters); tail_per_sm > 0: the programs take tiles from a shared counter and a
    second launch queued after the producer (tail_per_sm x SMs programs, tail_block_n columns a
    step, tail_warps) takes the tiles not yet taken on every SM the producer leaves."""

    programs: int
    block_t: int = 8
    block_n: int = 256
    warps: int = 4
    taken: int = 0
    backoff_ns: int = 200
    poll: str = "atomic"
    tail_per_sm: int = 0
    tail_block_n: int = 1024
    tail_warps: int = 4


SLEEP_CYCLES = 4_000_000  # ~2 ms at the H200's clock: longer than queuing one concurrent run

VARIANTS = {
    "beside32": Variant(32),
    "beside132": Variant(132),
    "beside264": Variant(264),
    "beside132_n1024": Variant(132, 4, 1024),
    "own16": Variant(16, taken=16),
    "own32": Variant(32, taken=32),
    "beside132_n1024_ld": Variant(132, 4, 1024, poll="load"),
    "beside132_n1024_b2k": Variant(132, 4, 1024, backoff_ns=2000),
    "beside264_n1024_ld": Variant(264, 4, 1024, poll="load"),
    "beside132_t8n1024w8_ld": Variant(132, 8, 1024, 8, poll="load"),
    "beside32_tail4": Variant(32, 4, 1024, poll="load", tail_per_sm=4),
    "beside132_tail4": Variant(132, 4, 1024, poll="load", tail_per_sm=4),
    "beside132_tail2w8": Variant(132, 4, 1024, poll="load", tail_per_sm=2, tail_warps=8),
    "beside132_n1024_ld_b2k": Variant(132, 4, 1024, backoff_ns=2000, poll="load"),
    "beside132_tail4_b2k": Variant(132, 4, 1024, backoff_ns=2000, tail_per_sm=4),
    "beside132_tail4_ld_b2k": Variant(132, 4, 1024, backoff_ns=2000, poll="load", tail_per_sm=4),
}


def measure_workload(spec: WorkloadSpec, variants: list[str], iters: int, emit) -> None:
    """emit(row) for one workload: the sequential step, its two parts, then every variant (a
    line `[ready_scale] variant <name>` on stdout before each, so a crash names its variant)."""
    from systems.overlap.errors import new_error_buffer, raise_if_error, read_error
    from systems.overlap.kernels import launch_producer, pick_config
    from systems.overlap.kernels.consumer import prefer_shared_carveout
    from systems.overlap.kernels.observer import stamp
    from systems.overlap.kernels.ready_scale import launch_ready_scale
    from systems.overlap.plan import local_row_map, producer_groups, producer_order
    from systems.overlap.ready_order import band_of_recv_rows, ready_order
    from systems.overlap.runner import residency_report

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n, e = spec.out, spec.experts_per_rank
    order = auto_order(T, TOP_K, e, TILE_M)
    ((lay, plan_cpu),) = rank_plans(spec, TILE_M, LAYOUT)
    plan = plan_cpu.to(dev)
    B = plan.n_bands
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(plan.n_padded, K, generator=gen, device=dev).to(torch.bfloat16)
    w = (torch.randn(e, K, n, generator=gen, device=dev) / math.sqrt(K)).to(torch.bfloat16)
    y = torch.empty(plan.n_padded, n, dtype=torch.bfloat16, device=dev)
    recv = torch.zeros(lay.send_pos.numel(), n, dtype=torch.bfloat16, device=dev)
    row_dst = local_row_map(plan)
    flags = torch.zeros(B + 1, dtype=torch.int32, device=dev)  # the band counters, then claim
    ready, claim = flags[:B], flags[B:]
    cfg = pick_config(TILE_M, K, n, torch.bfloat16)
    visit = producer_order(plan) if order == "expert" else None
    groups = producer_groups(plan, visit, cfg.group_m) if cfg.expert_groups else None
    target = cfg.band_increment(n)
    band = band_of_recv_rows(plan_cpu, row_dst.cpu(), recv.shape[0])

    def tables(grid: int):  # the tokens in the waves model's order at this producer grid
        times = wave_band_times(plan_cpu, order, n, K, grid)
        return [t.to(dev) for t in ready_order(lay.send_pos, lay.gate, band, times)]

    scaler = Scaler.for_layout(lay, dev)
    err = new_error_buffer(dev)
    out = torch.empty(T, n, dtype=torch.bfloat16, device=dev)
    stamps = torch.zeros(2, dtype=torch.int64, device=dev)  # %globaltimer around the producer

    def produce(grid: int, zero: bool = True):
        if zero:
            flags.zero_()
        return launch_producer(
            x, w, y, plan, ready, n_signal=B, num_programs=grid, config=cfg,
            local_to=(recv, row_dst), order=visit, groups=groups,
        )  # fmt: skip

    def sequential():
        produce(sms)
        return scaler(recv)

    want = sequential()
    torch.cuda.synchronize()
    base = {"out": n, "experts_per_rank": e, "routing": spec.routing, "order": order}
    base.update(bands=B, sms=sms)

    def timed(fn) -> float:
        return time_fn(fn, device=dev, warmup=3, iters=iters, queue_ahead=True).median_ms

    seq_ms, prod_ms = timed(sequential), timed(lambda: produce(sms))
    scale_ms = timed(lambda: scaler(recv))
    emit({**base, "variant": "sequential", "status": "ok", "ms": seq_ms})
    emit({**base, "variant": "producer", "status": "ok", "ms": prod_ms})
    emit({**base, "variant": "scale", "status": "ok", "ms": scale_ms})
    cur, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
    high = torch.cuda.Stream(dev, priority=torch.cuda.Stream.priority_range()[1])
    forked, produced = torch.cuda.Event(), torch.cuda.Event()
    for name in variants:
        print(f"[ready_scale] variant {name}", flush=True)
        v = VARIANTS[name]
        programs, taken = v.programs, v.taken
        kw = dict(programs=programs, block_t=v.block_t, block_n=v.block_n, num_warps=v.warps)
        kw.update(backoff_ns=v.backoff_ns, poll=v.poll)
        tail_kw = None
        if v.tail_per_sm:
            kw["claim"] = claim
            tail_kw = dict(programs=v.tail_per_sm * sms, block_t=v.block_t, claim=claim)
            tail_kw.update(block_n=v.tail_block_n, num_warps=v.tail_warps, poll=v.poll)
        row = {**base, "variant": name, "producer_sms": sms - taken, **asdict(v)}
        tok, pos, bnd, gate = tables(sms - taken)
        # first run after the producer has finished: compiles and loads the kernel (a module
        # loaded while the producer runs would wait for it), sets its carve-out
        kp = produce(sms - taken)
        torch.cuda.synchronize()
        ks = launch_ready_scale(recv, tok, pos, bnd, gate, out, ready, err, target, **kw)
        if tail_kw:
            claim.zero_()
            launch_ready_scale(recv, tok, pos, bnd, gate, out, ready, err, target, **tail_kw)
        torch.cuda.synchronize()
        prefer_shared_carveout(ks, 100)
        res = residency_report(kp, ks, dev)
        row["beside_producer"] = res["consumers_beside_producer"]
        if taken == 0 and res["consumers_beside_producer"] * sms < programs:
            why = f"{programs} programs do not fit beside the producer's CTAs: {res}"
            emit({**row, "status": "skipped", "reason": why})
            continue

        def concurrent(
            kw=kw, tail_kw=tail_kw, taken=taken, tabs=(tok, pos, bnd, gate), goal=target,
            stamped=False,
        ):  # fmt: skip
            flags.zero_()
            forked.record(cur)  # after the zeroing, before the producer: the scale starts now
            high.wait_event(forked)
            with torch.cuda.stream(high):
                if stamped:  # the producer's span inside the concurrent run
                    stamp(stamps[0:])
                produce(sms - taken, zero=False)
                if stamped:
                    stamp(stamps[1:])
                if tail_kw:  # the tiles no beside program has taken, on every free SM
                    launch_ready_scale(recv, *tabs, out, ready, err, goal, **tail_kw)
                produced.record(high)
            side.wait_event(forked)
            with torch.cuda.stream(side):
                launch_ready_scale(recv, *tabs, out, ready, err, goal, **kw)
            cur.wait_event(produced)
            cur.wait_stream(side)
            return out

        def checked(**over) -> float:
            """max rel. difference to the sequential output of one run from NaN-filled buffers
            (a row read before its band was signalled, or a tile never written, shows)."""
            recv.fill_(float("nan"))
            out.fill_(float("nan"))
            concurrent(**over)
            torch.cuda.synchronize()
            return float(((out.float() - want.float()).abs() / (want.float().abs() + 1e-2)).max())

        rels = [checked() for _ in range(3)]
        rec = read_error(err)
        if rec is not None:  # the producer never waits, so the next variant can still run
            emit({**row, "status": "error", "reason": rec.message()})
            err.zero_()
            continue
        if not max(rels) <= 8e-3:  # bf16's epsilon: the kernels may round the sum differently
            emit({**row, "status": "error", "reason": f"differs: max rel. {max(rels)}"})
            continue
        control = checked(goal=0)  # no wait at all: must read rows not yet written
        row.update(max_rel_diff=max(rels), control_caught=not control <= 8e-3)
        ms = timed(concurrent)
        raise_if_error(err)

        def alone(kw, tabs=(tok, pos, bnd, gate)):  # every band done: the kernel's own speed
            if "claim" in kw:
                claim.zero_()
            launch_ready_scale(recv, *tabs, out, ready, err, target, **kw)
            return out

        def span(run) -> float:
            """median ms between the stamps around the producer over 5 runs of run(), each
            queued behind a ~2 ms sleep so the host's launches are not inside the span"""
            got = []
            for _ in range(5):
                torch.cuda._sleep(SLEEP_CYCLES)
                run()
                torch.cuda.synchronize()
                got.append((stamps[1] - stamps[0]).item() / 1e6)
            return sorted(got)[2]

        def stamped_producer(grid=sms - taken):
            stamp(stamps[0:])
            produce(grid)
            stamp(stamps[1:])

        row["producer_span_ms"] = span(stamped_producer)
        row["producer_beside_ms"] = span(lambda: concurrent(stamped=True))
        produce(sms - taken)  # every row written, every band signalled
        alone_ms = timed(partial(alone, kw))
        if tail_kw:
            row["tail_alone_ms"] = timed(partial(alone, tail_kw))
        raise_if_error(err)
        row_ms = {"ms": ms, "hidden": (seq_ms - ms) / scale_ms, "alone_ms": alone_ms}
        emit({**row, "status": "ok", **row_ms})


def read_rows(path: Path) -> list[dict]:
    """The rows a workload's processes wrote so far (one JSON object a line)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_workload(key: str, variants: list[str], iters: int, path: Path, timeout_s: int) -> None:
    """Every variant of workload key ("N,E,routing") into path, each process resuming where the
    last stopped: a process that dies (a CUDA fault ends its context) leaves an error row for the
    variant it was running, with the error's last line, and the next process runs the rest."""
    n, e, routing = key.split(",")
    base = {"out": int(n), "experts_per_rank": int(e), "routing": routing, "status": "error"}
    base.update(provenance())
    for _ in range(len(variants) + 1):
        have = {r["variant"] for r in read_rows(path)}
        todo = [v for v in variants if v not in have]
        if "sequential" in have and not todo:
            return
        cmd = [sys.executable, "-m", "benchmarks.ready_scale", "--one", key, "--rows", str(path)]
        cmd += ["--variants", ",".join(todo), "--iters", str(iters)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, err = -1, f"timed out after {timeout_s} s"
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        print(out, end="", flush=True)
        if rc == 0:
            continue
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[W")]
        why = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
        marks = re.findall(r"\[ready_scale\] variant (\S+)", out)
        failed = [marks[-1]] if marks else ["sequential", *todo]  # before any variant: all of it
        with path.open("a") as f:
            for v in failed:
                f.write(json.dumps({**base, "variant": v, "reason": f"rc {rc}: {why}"}) + "\n")
        print(f"[ready_scale] {key} {failed}: rc {rc}: {why}", flush=True)
        if not marks:
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--n", default="4096,8192")
    ap.add_argument("--experts", default="4,16,64")
    ap.add_argument("--routing", default="balanced,stress_skew")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout", type=int, default=240, help="seconds a workload's process")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # "N,E,routing": one workload, this process
    ap.add_argument("--rows", help=argparse.SUPPRESS)  # where --one appends its rows
    a = ap.parse_args()
    ns, experts, routings = parse_grid(ap, a)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or a.iters < 1:
        ap.error(f"--variants from {sorted(VARIANTS)} (got {bad}) and --iters >= 1")
    if not torch.cuda.is_available():
        sys.exit("error: ready_scale needs a CUDA GPU (the producer and the scale run there)")
    if a.one:  # a child of run_workload: append each row as it is made
        n, e, routing = a.one.split(",")
        spec = WorkloadSpec(T, K, int(n), int(e), TOP_K, 1, routing, "bfloat16")
        path = Path(a.rows)
        prov = provenance()
        seen = {r["variant"] for r in read_rows(path)}

        def emit(row: dict) -> None:
            if row["variant"] in seen:  # a base row an earlier process wrote
                return
            with path.open("a") as f:
                f.write(json.dumps({**row, **prov}) + "\n")

        measure_workload(spec, variants, a.iters, emit)
        return
    out = Path(a.out)
    parts = out / "ready_scale_rows"
    parts.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in ns:
        for e in experts:
            for routing in routings:
                key = f"{n},{e},{routing}"
                path = parts / f"{n}_{e}_{routing}.jsonl"
                run_workload(key, variants, a.iters, path, a.timeout)
                rows += read_rows(path)
                print(f"[ready_scale] N={n} E={e} {routing}: done", flush=True)
    df = pd.DataFrame(rows).drop_duplicates(["out", "experts_per_rank", "routing", "variant"])
    df.to_parquet(out / "ready_scale.parquet", index=False)
    cols = ["out", "experts_per_rank", "routing", "variant", "status", "ms", "hidden", "alone_ms"]
    cols += ["tail_alone_ms", "producer_span_ms", "producer_beside_ms"]
    cols = [c for c in cols + ["control_caught"] if c in df.columns]
    print(df[cols].round(4).to_string(index=False))


if __name__ == "__main__":
    main()
