"""Fig 3a: the consumer's bandwidth against transfer (segment) size, per cCTA and transport.

The experiment: docs/experiments.md (`bandwidth`); transports: docs/method.md, Stage B. One cell
= (segment size, the overlap system's cCTA and transport). Every rank's consumer kernel (default
ConsumerConfig) ships n_seg segments of one band each, round-robin to its peers, the producer's
ready flags pre-set (still polled per band), one signal per segment. One run is checked (every
receiver holds exactly the rows its peers sent), then one launch is timed (CUDA events, max over
ranks). bytes_sent: bytes that LEAVE the sending GPU; gbps = bytes_sent / median time of one
launch. Loopback plays W = `loopback_ranks` ranks in one process. Reference `nccl_all_to_all`
(>= 2 processes; gloo on the CPU, where tests check the data movement). Options: OPTIONS.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from harness.measure import (
    agree,
    experiment_options,
    guarded,
    hash_cell,
    selected_systems,
    set_latency,
    system_points,
    unused_knobs,
)
from harness.preflight import memory_bytes
from harness.records import Row, cell_row
from harness.system import RunContext, int_param, list_param
from harness.timing import barrier, time_fn
from harness.workload import DTYPES

REFERENCE = "nccl_all_to_all"
#: the grid axes this experiment reads, one value each (harness.preflight.unread_settings)
GRID_AXES = ("out", "dtype")
OPTIONS = {"segment_kib": [16 << i for i in range(11)], "min_total_mib": 64, "loopback_ranks": 4}
TRANSPORTS = ("loopback", "p2p", "nvshmem")
MAX_SEGMENTS = 8192


def options(cfg: Any) -> dict[str, Any]:
    """OPTIONS overridden by experiment.options; unknown keys are an error."""
    merged = experiment_options(cfg, "bandwidth", OPTIONS)
    for k in list_param("bandwidth", "options.segment_kib", merged["segment_kib"], True):
        int_param("bandwidth", "options.segment_kib", k, least=1)
    int_param("bandwidth", "options.min_total_mib", merged["min_total_mib"], least=1)
    int_param("bandwidth", "options.loopback_ranks", merged["loopback_ranks"], least=2)
    return merged


def cells(cfg: Any, process_world: int) -> list[dict]:
    """Segment sizes (outer) x the overlap system's points (cCTA, transport), then the NCCL
    reference once per size when several processes run."""
    opt = options(cfg)
    g = cfg.experiment.grid
    for axis in GRID_AXES:
        if len(g[axis]) != 1:
            got = list(g[axis])
            raise ValueError(f"bandwidth: experiment.grid.{axis} takes one value, got {got}")
    points = {name: system_points(name, conf) for name, conf in selected_systems(cfg).items()}
    for p in points.get("overlap", ()):
        unused_knobs("bandwidth", "overlap", p, ("ccta", "transport"))
    base = dict(experiment=cfg.experiment.name, seed=cfg.seed, out=list(g.out)[0])
    base |= dict(dtype=list(g.dtype)[0], min_total_mib=opt["min_total_mib"])
    todo = []  # (system, W, segment KiB, params: the consumer's knobs, no GEMM here)
    for kib, (system, params) in itertools.product(
        opt["segment_kib"], [(s, p) for s, ps in points.items() for p in ps]
    ):
        tr = params.get("transport") or ("loopback" if process_world == 1 else "p2p")
        world = opt["loopback_ranks"] if tr == "loopback" else process_world
        todo.append((system, world, kib, {"ccta": params["ccta"], "transport": tr}))
    todo += [(REFERENCE, process_world, kib, {}) for kib in opt["segment_kib"] if process_world > 1]
    out = []
    for system, world, kib, params in todo:
        cell = dict(base, system=system, world_size=world, segment_kib=kib, params=params)
        cell["cell_hash"] = hash_cell(cfg, process_world, cell)
        out.append(cell)
    return out


def validate(cfg: Any, cells: list[dict], sm_count: int) -> None:
    """Clear errors before any process starts."""
    opt = options(cfg)  # checks segment_kib and loopback_ranks
    for cell in cells:
        if cell["dtype"] not in DTYPES or cell["dtype"] == "float32":
            raise ValueError(f"bandwidth: dtype must be float16 or bfloat16, got {cell['dtype']}")
        row_bytes = cell["out"] * DTYPES[cell["dtype"]].itemsize
        if row_bytes % 16 or cell["segment_kib"] * 1024 < row_bytes:
            raise ValueError(
                f"bandwidth: a row is {row_bytes} bytes; it must be a multiple of 16 and at most "
                f"the smallest segment ({cell['segment_kib']} KiB)"
            )
        p = cell["params"]
        if cell["system"] == REFERENCE:
            continue
        if cell["system"] != "overlap":
            raise ValueError(
                f"bandwidth measures the overlap system's consumer, not {cell['system']}"
            )
        if p["transport"] not in TRANSPORTS:
            raise ValueError(f"bandwidth: transport must be one of {TRANSPORTS}")
        int_param("bandwidth", "ccta", p["ccta"])
        if p["ccta"] < 1 or (sm_count and p["ccta"] >= sm_count):
            raise ValueError(f"bandwidth: ccta={p['ccta']} must be in [1, {sm_count or 'SMs'})")
    # loopback cells run only on one process on a GPU (skip_reason); check those
    on_gpu = cfg.hardware.device == "cuda"
    procs = cfg.hardware.world_size or (torch.cuda.device_count() if on_gpu else 1)
    need, have = loopback_bytes(cells), memory_bytes(cfg)
    if on_gpu and procs == 1 and have is not None and need > have:
        raise ValueError(
            f"bandwidth: loopback_ranks={opt['loopback_ranks']} needs {need / 2**30:.1f} GiB of "
            f"receive buffers (W x W regions of the largest cell: its segment size times at "
            f"least cCTA segments), more than the {have / 2**30:.1f} GiB here; use fewer "
            f"loopback_ranks, smaller segment_kib or a smaller cCTA sweep"
        )


def loopback_bytes(cells: list[dict]) -> int:
    """Bytes of the largest loopback fabric of the run: W receive buffers of W regions each,
    a region holding the largest cell's rows per source (_transport, LoopbackFabric)."""
    most = 0
    for c in cells:
        if c["system"] == REFERENCE or c["params"]["transport"] != "loopback":
            continue
        rows_per_seg, n_seg, row_bytes = sizes(c, int(c["params"]["ccta"]))
        most = max(most, c["world_size"] ** 2 * rows_per_seg * n_seg * row_bytes)
    return most


def sizes(cell: dict, ccta: int) -> tuple[int, int, int]:
    """(rows per segment, segments, row bytes) of a cell: enough segments for min_total_mib
    per run, a multiple of cCTA (at least one per consumer CTA), at most MAX_SEGMENTS."""
    row_bytes = cell["out"] * DTYPES[cell["dtype"]].itemsize
    rows_per_seg = max(1, cell["segment_kib"] * 1024 // row_bytes)
    seg = rows_per_seg * row_bytes
    n_seg = max(ccta, -(-cell["min_total_mib"] * (1 << 20) // seg))
    n_seg = min(-(-n_seg // ccta) * ccta, MAX_SEGMENTS)
    return rows_per_seg, n_seg, row_bytes


def sender_plan(me: int, world: int, rows_per_seg: int, n_seg: int, device: torch.device):
    """Rank `me`'s plan: segment i = one band of rows_per_seg rows to peer i mod (W-1); each
    source writes its own region of a receiver's buffer (rows me * n_seg * rows_per_seg on)."""
    from systems.overlap.plan import plan_from_rows

    peers = [d for d in range(world) if d != me]
    rows = [[0] * world for _ in range(n_seg)]
    for i in range(n_seg):
        rows[i][peers[i % len(peers)]] = rows_per_seg
    base = [me * n_seg * rows_per_seg] * world
    return plan_from_rows(rows, rank=me, tile_m=rows_per_seg, device=device, dst_base=base)


def sender_y(cell: dict, me: int, n_rows: int, device: torch.device) -> torch.Tensor:
    """The rows rank `me` sends [n_rows, N], seeded by (seed, rank): any rank can rebuild them."""
    gen = torch.Generator(device=device).manual_seed(cell["seed"] * 1009 + me)  # same on all GPUs
    y = torch.randn(n_rows, cell["out"], generator=gen, device=device)
    return y.to(DTYPES[cell["dtype"]])


def expected_region(plan, y: torch.Tensor, dst: int, recv: torch.Tensor) -> None:
    """Write into recv what plan's consumer sends to `dst` (pure torch)."""
    rows, valid = plan.band_row.tolist(), plan.band_valid.tolist()
    bdst, off = plan.band_dst.tolist(), plan.band_offset.tolist()
    for b in plan.schedule[: int(plan.n_remote_bands)].tolist():
        if bdst[b] == dst:
            recv[off[b] : off[b] + valid[b]] = y[rows[b] : rows[b] + valid[b]]


_TRANSPORTS: dict[tuple, Any] = {}
#: the symmetric-memory transport this process has used (its backend cannot change after use)
_SYMMETRIC_USED: dict[str, str] = {}


def _fabric_key(cell: dict) -> tuple:
    """What the cells of one transport share: its name, W, N and dtype."""
    return cell["params"]["transport"], cell["world_size"], cell["out"], cell["dtype"]


def _transport(ctx: RunContext, cfg: Any, cell: dict):
    """The cell's transport, allocated ONCE per run at the size of its largest cell (torch's
    NVSHMEM symmetric memory refuses a buffer that grew after a smaller one was freed): W
    regions (one per source) of the largest rows-per-source of the cells of its _fabric_key."""
    from systems.overlap.transport import LoopbackFabric, nvshmem_transport, p2p_transport

    name, world = cell["params"]["transport"], cell["world_size"]
    key = _fabric_key(cell)
    if key in _TRANSPORTS:
        return _TRANSPORTS[key]
    most = 0
    for c in cells(cfg, ctx.world_size):
        if c["system"] != REFERENCE and _fabric_key(c) == key:
            rows_per_seg, n_seg, _ = sizes(c, int(c["params"]["ccta"]))
            most = max(most, rows_per_seg * n_seg)
    rows = world * most
    dt = DTYPES[cell["dtype"]]
    if name == "loopback":
        made = LoopbackFabric([rows] * world, cell["out"], dt, ctx.device)
    else:
        make = p2p_transport if name == "p2p" else nvshmem_transport
        _SYMMETRIC_USED.setdefault("transport", name)
        made = make(ctx.group, rows, cell["out"], dt, ctx.device)
    _TRANSPORTS[key] = made
    return made


def skip_reason(ctx: RunContext, cell: dict) -> str | None:
    if cell["system"] == REFERENCE:
        if ctx.world_size < 2:
            return f"the reference needs >= 2 processes (this run has {ctx.world_size})"
        return None
    if ctx.device.type != "cuda":
        return f"the consumer needs a CUDA GPU; this run is on {ctx.device.type}"
    tr = cell["params"]["transport"]
    if tr == "loopback" and ctx.world_size != 1:
        return "loopback plays every rank in one process: run with hardware.world_size=1"
    if tr in ("p2p", "nvshmem") and ctx.world_size < 2:
        return f"{tr} needs >= 2 processes, one per GPU (this run has {ctx.world_size})"
    used = _SYMMETRIC_USED.get("transport")
    if tr in ("p2p", "nvshmem") and used not in (None, tr):
        return (
            f"torch symmetric memory keeps one backend per process and this run already used "
            f"{used}; run {tr} alone: experiment.systems.overlap.sweep.transport=[{tr}]"
        )
    return None


def run_cell(ctx: RunContext, cfg: Any, cell: dict) -> list[Row]:
    row = cell_row(cell, out=cell["out"], dtype=cell["dtype"], scope="combine")
    reason = skip_reason(ctx, cell)
    if reason:
        row.status, row.reason = "skipped", reason
        return [row]
    guarded(ctx, row, lambda: _measure(ctx, cfg, cell, row))  # a failure: the row's error
    return [row]


def _measure(ctx: RunContext, cfg: Any, cell: dict, row: Row) -> None:
    """Check one launch of the cell, then time it (latency_ms, gbps)."""
    if cell["system"] == REFERENCE:
        go, ok, sent, extra = _nccl(ctx, cell)
        row.transport, row.impl = ctx.backend, "torch.distributed.all_to_all_single"
    else:
        go, ok, sent, extra = _consumer(ctx, cfg, cell)
        row.transport, row.impl = cell["params"]["transport"], "consumer kernel (triton)"
    row.metrics.update(extra)
    row.max_rel_err = 0.0 if ok else 1.0
    if not ok:
        row.status, row.reason = "fail", "a receive buffer differs from the rows sent"
        return
    m = cfg.measure
    t = time_fn(go, device=ctx.device, group=ctx.group, warmup=m.warmup, iters=m.iters)
    set_latency(row, t)
    row.metrics.update(bytes_sent=float(sent), gbps=sent / t.median_ms / 1e6)


def _consumer(ctx: RunContext, cfg: Any, cell: dict):
    """(launch, checked ok, bytes leaving this GPU per launch, metrics) of one consumer cell."""
    from systems.overlap.errors import new_error_buffer, raise_if_error
    from systems.overlap.runner import run_consumer
    from systems.overlap.tuning import ConsumerConfig

    ccta, name, W = int(cell["params"]["ccta"]), cell["params"]["transport"], cell["world_size"]
    rows_per_seg, n_seg, row_bytes = sizes(cell, ccta)
    me = 0 if name == "loopback" else ctx.rank
    plan = sender_plan(me, W, rows_per_seg, n_seg, ctx.device)
    y = sender_y(cell, me, int(plan.n_padded), ctx.device)
    made = _transport(ctx, cfg, cell)
    tr = made.transport(0) if name == "loopback" else made
    ready = torch.ones(plan.max_bands, dtype=torch.int32, device=ctx.device)
    err = new_error_buffer(ctx.device)
    clock = torch.zeros(ccta, dtype=torch.int64, device=ctx.device)
    kw = dict(ready_target=1, ccta=ccta, config=ConsumerConfig())
    go = partial(run_consumer, y, plan, ready, tr, err, clock, **kw)
    receivers = range(1, W) if name == "loopback" else [ctx.rank]
    bufs = {d: (made.recv(d) if name == "loopback" else tr.recv) for d in receivers}
    for b in bufs.values():
        b.zero_()
    barrier(ctx.group, ctx.device)
    go()
    torch.cuda.synchronize(ctx.device)
    raise_if_error(err)
    barrier(ctx.group, ctx.device)
    ok = True
    for d, buf in bufs.items():
        want = torch.zeros_like(buf)
        senders = [0] if name == "loopback" else [s for s in range(W) if s != d]
        for s in senders:
            plan_s = plan if s == me else sender_plan(s, W, rows_per_seg, n_seg, ctx.device)
            y_s = sender_y(cell, s, int(plan_s.n_padded), ctx.device)
            expected_region(plan_s, y_s, d, want)
        ok = ok and torch.equal(buf, want)
    ok = agree(ctx, 0.0 if ok else 1.0) == 0.0
    sent = n_seg * rows_per_seg * row_bytes  # every row of this rank goes to a peer
    metrics = {"segment_bytes": float(rows_per_seg * row_bytes), "n_segments": float(n_seg)}
    return go, ok, sent, metrics


def _nccl(ctx: RunContext, cell: dict):
    """NCCL all_to_all_single moving the same bytes out of this GPU, even over the peers."""
    W, me = ctx.world_size, ctx.rank
    rows_per_seg, n_seg, row_bytes = sizes(cell, 1)
    per_peer = -(-n_seg * rows_per_seg // (W - 1))
    split = [0 if d == me else per_peer for d in range(W)]
    x = sender_y(cell, me, per_peer * (W - 1), ctx.device)
    out = torch.empty_like(x)
    go = partial(dist.all_to_all_single, out, x, split, split, group=ctx.group)
    go()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)

    def sent_here(s: int) -> torch.Tensor:  # source s's rows for this rank: its slot among peers
        j = me - (me > s)
        return sender_y(cell, s, per_peer * (W - 1), ctx.device)[j * per_peer : (j + 1) * per_peer]

    want = torch.cat([sent_here(s) for s in range(W) if s != me])
    ok = agree(ctx, 0.0 if torch.equal(out, want) else 1.0) == 0.0
    metrics = {"segment_bytes": float(rows_per_seg * row_bytes), "n_segments": float(W - 1)}
    return go, ok, per_peer * (W - 1) * row_bytes, metrics
