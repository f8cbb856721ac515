"""The producer against CUTLASS and cuBLAS: the overlap system's expert GEMM alone, on one GPU.

One workload = (T, K, N, E, top_k, routing, W, dtype): the routing of W ranks is drawn as in
every experiment (harness.workload.routing_of) and rank 0's expert problem is built from it:
rows[e][s] = rows owner s sends to rank 0's expert e, laid out by the real stage-A builder
(systems.overlap.testing.synthetic_plan -> build_plan), X [P, K] (zero padding rows included),
weights [E, K, N]. Per workload, side by side in one run:

  overlap           the persistent Triton producer, alone on all SMs, with its ready flags
                    (option `flags`), per point of the overlap system's sweep (tile_m, layout,
                    order) and per tile-configuration variant (option `configs`, CONFIGS)
  torch_grouped_mm  torch._grouped_mm (CUTLASS) on the valid rows only, grouped by expert
  cublas            one dense torch.matmul [R, K] x [K, N] with R = the valid rows: the same
                    useful FLOPs as one GEMM
  cublas_bmm        one torch.bmm (cuBLAS, batched) [E, m, K] x [E, K, N] with m = R // E: the
                    same FLOPs (less up to E - 1 rows) and the same E x K x N weight bytes as
                    the grouped GEMM, split evenly: what a dense library does on this problem's
                    shape with no routing at all

Every kernel is checked against the float32 reference of its rows (harness/check.py) before it
is timed; a failing one records `fail`. Timed: one launch (CUDA events, torch.cuda). Metrics:
m_tflops (useful FLOPs 2 R K N / time; the bmm's own rows for cublas_bmm), m_valid_rows,
m_gemm_rows (rows the kernel computes, padding included), m_flags. The ratios the method-speed
issue asks for (producer against torch._grouped_mm and cuBLAS) are read across the rows of one
workload (plots/producer.py).
Options (experiment.options): flags (list of bool, default [true]); configs (list of CONFIGS
names, default ["table"]: the shape table the overlap system runs; the others are the variants
tried against it, recorded whether they win or lose, or `error` where Triton cannot build them;
CUTLASS_CONFIGS name the CUTLASS producer, systems/overlap/cutlass_producer.py, `skipped` where
its library is not built: `make cutlass`); local (list of LOCALS, default ["copy"]: the local
rows stored in Y; "direct" stores them in a receive buffer through row_dst, the overlap system's
default path, and is checked by reading each local row back from there; `skipped` for CUTLASS).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from harness.check import check
from harness.measure import hash_cell, selected_systems, system_points
from harness.records import Row, command_line, provenance
from harness.routing import imbalance
from harness.system import RunContext, list_param
from harness.timing import time_fn
from harness.workload import DTYPES, WorkloadSpec, routing_of
from systems.overlap.cutlass_producer import CutlassUnavailable
from systems.overlap.plan import LAYOUTS, ORDERS, owner_expert_counts

AXES = (
    "world_size",
    "tokens_per_rank",
    "hidden",
    "out",
    "experts_per_rank",
    "top_k",
    "routing",
    "dtype",
)
GRID_AXES = AXES  # the grid axes this experiment reads (harness.preflight.unread_settings)
ONE_RANK = True  # rank 0's expert GEMM of a W-rank grid, one rank (preflight.check_memory)
REFERENCES = ("torch_grouped_mm", "cublas", "cublas_bmm")
OPTIONS = {"flags": [True], "configs": ["table"], "local": ["copy"]}
#: where the producer stores the local rows: "copy" (in Y, as the tables before this option) or
#: "direct" (in the own receive buffer through row_dst, as the overlap system runs by default);
#: a cell's params name `local` only when it is "direct", so the older cells keep their hashes
LOCALS = ("copy", "direct")
#: the overlap system's knobs that shape its producer (the rest belong to the consumer)
PRODUCER_KNOBS = ("tile_m", "layout", "order")
#: tile-configuration variants of the producer: name -> change to the table's TileConfig
#: (kernels/producer.py pick_config); "table" is what the overlap system runs
CONFIGS: dict[str, dict[str, Any]] = {
    "table": {},
    "stages4": {"num_stages": 4},
    "group8": {"group_m": 8, "expert_groups": False},
    "g8s4": {"group_m": 8, "num_stages": 4, "expert_groups": False},
    # Triton 3.6's Hopper warp specialisation of the tile loop (add_hopper_warpspec), unflattened
    "ws": {"warp_specialize": True, "flatten": False},
    # the flag variants (kernels/producer.py): per-warp deferred releases, per-thread immediate,
    # per-thread in the middle of the next tile's main loop (its MMAs in flight)
    "warp": {"flag": "warp"},
    "thread": {"flag": "thread"},
    "mid": {"flag": "mid"},
    # the epilogue's store in column halves or quarters (a smaller layout-conversion scratch)
    "split4": {"epi_split": 4},
    "mid4": {"flag": "mid", "epi_split": 4},
    "split2": {"epi_split": 2},
    # with the quarter-slice epilogue (16 KB of layout scratch, not 64): a deeper pipeline,
    # other swizzle groups, K steps of 128
    "s4st4": {"epi_split": 4, "num_stages": 4},
    "s4g4": {"epi_split": 4, "group_m": 4, "expert_groups": False},
    "s4g16": {"epi_split": 4, "group_m": 16, "expert_groups": False},
    "s4k128": {"epi_split": 4, "block_k": 128, "num_stages": 2},
    # the table before the expert groups (rev 5476e40 to c17c39e): fixed groups of 8 (N >= 8192)
    # and of 4 (4096 <= N < 8192)
    "fixed8": {"epi_split": 4, "expert_groups": False, "group_m": 8},
    "fixed4": {"epi_split": 4, "expert_groups": False, "group_m": 4},
    # swizzle groups = one expert's run of bands, cut into groups of at most 4 ... 64
    # (plan.producer_groups): each weight strip read from HBM once per group
    "eg4": {"epi_split": 4, "expert_groups": True, "group_m": 4},
    "eg8": {"epi_split": 4, "expert_groups": True, "group_m": 8},
    "eg16": {"epi_split": 4, "expert_groups": True, "group_m": 16},
    "eg32": {"epi_split": 4, "expert_groups": True, "group_m": 32},
    "eg64": {"epi_split": 4, "expert_groups": True, "group_m": 64},
    # the expert groups with a 4-deep pipeline (48 KB a stage; 208 KB with the epilogue scratch)
    "eg16s4": {"epi_split": 4, "expert_groups": True, "group_m": 16, "num_stages": 4},
    "eg32s4": {"epi_split": 4, "expert_groups": True, "group_m": 32, "num_stages": 4},
    # Triton 3.6's Hopper warp specialisation with the expert groups of 32: the tile loop
    # unflattened (as "ws") and flattened
    "ws_eg32": {
        "epi_split": 4,
        "expert_groups": True,
        "group_m": 32,
        "warp_specialize": True,
        "flatten": False,
    },
    "wsf_eg32": {"epi_split": 4, "expert_groups": True, "group_m": 32, "warp_specialize": True},
}
#: the producer in two launches (plan.split_tail_bands): the table's config over the bands with
#: more than block_m rows, then a second config (these changes to the table's) over the bands
#: with at most its block_m rows, so an expert's last band of a few rows no longer computes a
#: whole tile_m-row tile. "tails64" keeps 8 warps (the same flag increment per tile as the
#: table's, what the consumer counts), "tails64w4" takes the table's 64-row entry (4 warps)
TAIL_CONFIGS: dict[str, dict[str, Any]] = {
    "tails64": {"block_m": 64},
    "tails64w4": {"block_m": 64, "num_warps": 4, "num_stages": 4},
}
#: the CUTLASS producer (kernels/cutlass_producer.cu, tile 128x256x64, flags in its epilogue):
#: name -> (grouping, cluster M x N); grouping "band" follows the cell's visiting order, "expert"
#: groups each expert's rows (torch._grouped_mm's structure) whatever the cell's order
CUTLASS_CONFIGS: dict[str, tuple[str, tuple[int, int]]] = {
    "cutlass": ("band", (1, 2)),
    "cutlass_expert": ("expert", (2, 1)),
    "cutlass_expert_c12": ("expert", (1, 2)),
}


def options(cfg: Any) -> dict[str, Any]:
    """OPTIONS overridden by experiment.options; unknown keys are an error."""
    given = dict(cfg.experiment.get("options") or {})
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise ValueError(f"producer: unknown option(s) {unknown}; accepted: {sorted(OPTIONS)}")
    merged = {**OPTIONS, **given}
    for key, value in merged.items():  # every option is a non-empty list
        list_param("producer", f"options.{key}", value, nonempty=True)
    if not all(isinstance(f, bool) for f in merged["flags"]):
        raise ValueError(f"producer: options.flags holds true / false, got {list(merged['flags'])}")
    return merged


def cells(cfg: Any, process_world: int) -> list[dict]:
    """Per workload: the two references, then the overlap producer per (sweep point, flags,
    tile-configuration variant)."""
    g = cfg.experiment.grid
    axes = [list(g.world_size) or [process_world]] + [list(getattr(g, k)) for k in AXES[1:]]
    systems = selected_systems(cfg)
    points = {name: system_points(name, conf) for name, conf in systems.items()}
    flags = [bool(f) for f in options(cfg)["flags"]]
    configs = [str(c) for c in options(cfg)["configs"]]
    locals_ = [{} if str(v) == "copy" else {"local": str(v)} for v in options(cfg)["local"]]
    out = []
    for values in itertools.product(*axes):
        base = {"experiment": cfg.experiment.name, "seed": cfg.seed, **dict(zip(AXES, values))}
        todo = [(ref, {}) for ref in REFERENCES]
        for system in systems:
            seen = []
            for p in points[system]:
                knobs = {k: p[k] for k in PRODUCER_KNOBS}
                if knobs not in seen:  # consumer knobs do not change the producer
                    seen.append(knobs)
                    todo += [
                        (system, {**knobs, "flags": f, "config": c, **lo})
                        for c in configs
                        for f in flags
                        for lo in locals_
                    ]
        for system, params in todo:
            cell = {**base, "system": system, "params": params}
            cell["cell_hash"] = hash_cell(cfg, process_world, cell)
            out.append(cell)
    return out


def spec_of(cell: dict) -> WorkloadSpec:
    return WorkloadSpec(**{k: cell[k] for k in AXES}, seed=cell["seed"])


def validate(cfg: Any, cells: list[dict], sm_count: int) -> None:
    """Clear errors before any GPU work: the workload, the systems, the dtype, the tile."""
    known = {*CONFIGS, *TAIL_CONFIGS, *CUTLASS_CONFIGS}
    bad = sorted(set(map(str, options(cfg)["configs"])) - known)
    if bad:
        raise ValueError(f"producer: unknown config(s) {bad}; accepted: {sorted(known)}")
    bad = sorted(set(map(str, options(cfg)["local"])) - set(LOCALS))
    if bad:
        raise ValueError(f"producer: unknown local mode(s) {bad}; accepted: {list(LOCALS)}")
    for cell in cells:
        spec = spec_of(cell)  # a bad routing, a non-positive size
        if cell["system"] not in (*REFERENCES, "overlap"):
            raise ValueError(f"producer times the overlap system's producer, not {cell['system']}")
        if spec.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"producer: dtype must be float16 or bfloat16, got {spec.dtype}")
        if spec.top_k > spec.world_size * spec.experts_per_rank:
            raise ValueError(f"producer: top_k {spec.top_k} > W x E")
        if cell["system"] == "overlap" and cell["params"]["tile_m"] not in (64, 128):
            raise ValueError(f"producer: tile_m must be 64 or 128, got {cell['params']['tile_m']}")
        tail = TAIL_CONFIGS.get(cell["params"].get("config"), {}).get("block_m")
        if cell["system"] == "overlap" and tail and cell["params"]["tile_m"] <= tail:
            raise ValueError(
                f"producer: config {cell['params']['config']} splits off {tail}-row tiles, so "
                f"it needs tile_m > {tail}, got {cell['params']['tile_m']}"
            )
        if cell["system"] == "overlap" and cell["params"].get("order") not in ORDERS:
            raise ValueError(f"producer: order must be one of {ORDERS}, got {cell['params']}")
        if cell["system"] == "overlap" and cell["params"].get("layout", "aligned") not in LAYOUTS:
            raise ValueError(
                f"producer: layout must be one of {', '.join(LAYOUTS)}, "
                f"got {cell['params'].get('layout')!r}"
            )
        if spec.hidden % 8 or spec.out % 8:
            raise ValueError("producer: K and N must be multiples of 8 (16-byte rows)")


def rank0_rows(spec: WorkloadSpec) -> tuple[list[list[int]], dict]:
    """rows[e][s]: rows owner s sends to rank 0's local expert e, from the spec's routing."""
    ids = routing_of(spec).expert_ids
    counts = owner_expert_counts(ids, spec.experts_per_rank)  # [W, W*E]
    rows = counts[:, : spec.experts_per_rank].t().tolist()
    return rows, imbalance(ids, spec.world_size, spec.experts_per_rank)


#: the last workload's operands (x_recv, weights): cells run workload by workload, and drawing
#: E x K x N weights again per cell would cost seconds at E=64
_OPERANDS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _operands(spec: WorkloadSpec, n_rows: int, device: torch.device):
    """x_recv [R, K] and weights [E, K, N] of a workload, drawn on the device from the seed."""
    key = (spec, n_rows, str(device))
    if key not in _OPERANDS:
        _OPERANDS.clear()  # one workload at a time
        dt = DTYPES[spec.dtype]
        g = torch.Generator(device=device).manual_seed(spec.seed)
        x_recv = (torch.randn(n_rows, spec.hidden, generator=g, device=device) * 0.5).to(dt)
        w = torch.randn(spec.experts_per_rank, spec.hidden, spec.out, generator=g, device=device)
        _OPERANDS[key] = (x_recv, (w / math.sqrt(spec.hidden)).to(dt))
    return _OPERANDS[key]


def problem(spec: WorkloadSpec, tile_m: int, layout: str, device: torch.device):
    """Rank 0's expert problem: plan, X [P, K] padded, weights [E, K, N], the valid rows grouped
    by expert x_valid [R, K] with their expert offsets, and the float32 references."""
    from systems.overlap.plan import padded_input
    from systems.overlap.testing import reference_y, synthetic_plan

    rows, imb = rank0_rows(spec)
    plan = synthetic_plan(rows, rank=0, tile_m=tile_m, device=device, layout=layout)
    x_recv, w = _operands(spec, plan.n_rows, device)
    x = padded_input(x_recv, plan.gather_index)
    valid = plan.gather_index >= 0
    per_expert = [sum(r) for r in rows]
    # the valid rows of the padded layout in order are grouped by expert (each expert's band
    # range holds only its own rows)
    return SimpleNamespace(
        plan=plan,
        x=x,
        w=w,
        valid=valid,
        x_valid=x[valid],
        offsets=torch.tensor(per_expert, device=device).cumsum(0).to(torch.int32),
        per_expert=per_expert,
        ref_y=lambda: reference_y(plan, x, w),
        imbalance=imb,
    )


def batched_rows(x_valid: torch.Tensor, e: int) -> torch.Tensor:
    """The cublas_bmm reference's input [E, R // E, K] from the valid rows [R, K] (the first
    E x (R // E) of them); with fewer rows than experts, one row each, zeros past the valid."""
    r = x_valid.shape[0]
    if r >= e:
        return x_valid[: e * (r // e)].reshape(e, r // e, -1)
    xb = x_valid.new_zeros(e, 1, x_valid.shape[1])
    xb[:r, 0] = x_valid
    return xb


def _row(cell: dict, spec: WorkloadSpec) -> Row:
    return Row(
        experiment=cell["experiment"],
        system=cell["system"],
        cell_hash=cell["cell_hash"],
        scope="expert gemm",
        world_size=spec.world_size,
        transport="none",
        tokens_per_rank=spec.tokens_per_rank,
        hidden=spec.hidden,
        out=spec.out,
        experts_per_rank=spec.experts_per_rank,
        top_k=spec.top_k,
        routing=spec.routing,
        dtype=spec.dtype,
        params=dict(cell["params"]),
        command=command_line(),
        timestamp=time.time(),
        **provenance(),
    )


def _kernel(ctx: RunContext, cell: dict, pb) -> tuple[Any, torch.Tensor, torch.Tensor, dict]:
    """(launch, output, its float32 reference, metrics) of one cell's kernel."""
    valid_rows = int(pb.x_valid.shape[0])
    if cell["system"] == "torch_grouped_mm":
        out = torch._grouped_mm(pb.x_valid, pb.w, offs=pb.offsets)
        ref = pb.ref_y()[pb.valid]

        def go():
            torch._grouped_mm(pb.x_valid, pb.w, offs=pb.offsets)

        return go, out, ref, {"gemm_rows": float(valid_rows), "impl": "torch._grouped_mm"}
    if cell["system"] == "cublas":
        w0 = pb.w[0]
        out = torch.matmul(pb.x_valid, w0)
        ref = pb.x_valid.float() @ w0.float()

        def go():
            torch.matmul(pb.x_valid, w0)

        return go, out, ref, {"gemm_rows": float(valid_rows), "impl": "torch.matmul (cuBLAS)"}
    if cell["system"] == "cublas_bmm":
        e = pb.w.shape[0]
        xb = batched_rows(pb.x_valid, e)
        m = xb.shape[1]
        out = torch.bmm(xb, pb.w)
        ref = torch.bmm(xb.float(), pb.w.float())

        def go():
            torch.bmm(xb, pb.w)

        impl = "torch.bmm (cuBLAS batched, R // E rows an expert)"
        return go, out, ref, {"gemm_rows": float(e * m), "impl": impl}
    from systems.overlap.kernels import launch_producer, pick_config
    from systems.overlap.plan import (
        local_row_map,
        producer_groups,
        producer_order,
        split_groups,
        split_tail_bands,
    )

    p, flags = pb.plan, bool(cell["params"]["flags"])
    direct = cell["params"].get("local", "copy") == "direct"
    if cell["params"].get("config") in CUTLASS_CONFIGS:
        if direct:
            raise CutlassUnavailable("the CUTLASS producer has no local=direct epilogue")
        return _cutlass_kernel(ctx, cell, pb)
    name = cell["params"].get("config", "table")
    cfg = pick_config(int(cell["params"]["tile_m"]), pb.x.shape[1], pb.w.shape[2], pb.x.dtype)
    cfg = replace(cfg, **CONFIGS.get(name, {}))
    order = producer_order(p) if cell["params"].get("order") == "expert" else None
    # per plan, like the order (the overlap runner builds both once per plan)
    groups = producer_groups(p, order, cfg.group_m) if cfg.expert_groups else None
    # (plan, config, visiting order, groups) of each launch
    launches = [(p, cfg, order, groups)]
    if name in TAIL_CONFIGS:
        tail = replace(cfg, **TAIL_CONFIGS[name])
        if tail.block_m >= cfg.block_m:
            raise ValueError(f"producer: {name} needs tile_m > {tail.block_m}")
        parts = zip(split_tail_bands(p, order, tail.block_m), (cfg, tail))
        launches = [
            (sub, c, vis, split_groups(sub, vis, c.group_m) if c.expert_groups else None)
            for (sub, vis), c in ((part, c) for part, c in parts if part is not None)
        ]
    y = torch.zeros(p.n_padded, pb.w.shape[2], dtype=pb.x.dtype, device=pb.x.device)
    ready = torch.zeros(p.n_bands, dtype=torch.int32, device=pb.x.device)
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    local_to = None
    if direct:  # the local rows go to a receive buffer [S, N] through row_dst [P]
        row_dst = local_row_map(p)
        recv = torch.zeros(int(row_dst.max()) + 1, pb.w.shape[2], dtype=y.dtype, device=y.device)
        local_to = (recv, row_dst)

    def go():
        for plan, c, vis, grp in launches:
            launch_producer(
                pb.x,
                pb.w,
                y,
                plan,
                ready,
                num_programs=sms,
                config=c,
                signal=flags,
                order=vis,
                groups=grp,
                local_to=local_to,
            )

    go()
    if flags:  # one run: every remote band's counter holds one run's increment
        for plan, c, _, _ in launches:
            got = ready[plan.schedule[: plan.n_remote_bands]]
            if not bool((got == c.band_increment(pb.w.shape[2])).all()):
                raise RuntimeError("producer: a ready flag is wrong after one run")
    metrics = {"gemm_rows": float(p.n_padded), "impl": "overlap producer (triton)"}
    metrics["config"] = json.dumps(cfg.__dict__, default=str)
    if len(launches) > 1 or launches[0][1] is not cfg:
        metrics["config"] = json.dumps(
            [{"bands": int(pl.schedule.numel()), **c.__dict__} for pl, c, _, _ in launches],
            default=str,
        )
    out = y
    if direct:  # each local row read back from where the epilogue put it
        mine = row_dst >= 0
        out = y.clone()
        out[mine] = recv[row_dst[mine]]
    return go, out[pb.valid], pb.ref_y()[pb.valid], metrics


def _cutlass_kernel(
    ctx: RunContext, cell: dict, pb
) -> tuple[Any, torch.Tensor, torch.Tensor, dict]:
    """The CUTLASS producer's cell; flags off = no band signalled (n_signal 0, no store wait)."""
    from systems.overlap import cutlass_producer as cp
    from systems.overlap.plan import producer_order

    p, params = pb.plan, cell["params"]
    flags = bool(params["flags"])
    n_signal = None if flags else 0
    if int(params["tile_m"]) != cp.BLOCK_M:
        raise ValueError(f"the CUTLASS producer has tile_m {cp.BLOCK_M} only")
    grouping, cluster = CUTLASS_CONFIGS[params["config"]]
    prod = cp.CutlassProducer(cluster, grouping)
    order = producer_order(p) if params.get("order") == "expert" else None
    n = pb.w.shape[2]
    y = torch.zeros(p.n_padded, n, dtype=pb.x.dtype, device=pb.x.device)
    ready = torch.zeros(p.n_bands, dtype=torch.int32, device=pb.x.device)
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count

    def go():
        prod.launch(pb.x, pb.w, y, p, ready, num_programs=sms, order=order, n_signal=n_signal)

    go()
    torch.cuda.synchronize(ctx.device)
    got, want = ready[p.schedule[: p.n_remote_bands]], cp.band_increment(n) if flags else 0
    if not bool((got == want).all()):
        vals = sorted(set(got.tolist()))[:8]
        raise RuntimeError(f"cutlass producer: ready flags {vals} after one run, want {want}")
    local = ready[p.schedule[p.n_remote_bands :]]
    if bool((local != 0).any()):
        raise RuntimeError("cutlass producer: a local band was signalled")
    metrics = {"gemm_rows": float(p.n_padded), "impl": "overlap producer (cutlass)"}
    metrics["config"] = json.dumps(
        {"impl": "cutlass", "tile": [128, 256, 64], "cluster": cluster, "grouping": grouping}
    )
    return go, y[pb.valid], pb.ref_y()[pb.valid], metrics


def run_cell(ctx: RunContext, cfg: Any, cell: dict) -> list[Row]:
    spec = spec_of(cell)
    row = _row(cell, spec)
    if ctx.device.type != "cuda":
        row.status = "skipped"
        row.reason = f"the producer and its references need a CUDA GPU, not {ctx.device.type}"
        return [row]
    try:
        p = cell["params"]
        pb = problem(spec, int(p.get("tile_m", 128)), p.get("layout", "aligned"), ctx.device)
        row.imbalance_rank = pb.imbalance["imbalance_rank"]
        row.imbalance_expert = pb.imbalance["imbalance_expert"]
        go, out, ref, m = _kernel(ctx, cell, pb)
        torch.cuda.synchronize(ctx.device)
        row.impl = m.pop("impl")
        extra = {"config": m.pop("config")} if "config" in m else {}
        row.extra = json.dumps({**extra, "per_expert_rows": pb.per_expert})
        res = check(out, ref, tol=float(cfg.measure.tol))
        row.max_rel_err, row.max_row_rel_err = res.max_rel_err, res.max_row_rel_err
        valid = float(pb.x_valid.shape[0])
        row.metrics.update(valid_rows=valid, flags=float(bool(p.get("flags", False))), **m)
        if not res.ok:
            row.status, row.reason = "fail", res.message
            return [row]
        t = time_fn(go, device=ctx.device, warmup=cfg.measure.warmup, iters=cfg.measure.iters)
        row.latency_ms, row.latency_p10_ms, row.latency_p90_ms = t.median_ms, t.p10_ms, t.p90_ms
        row.latency_ci_lo_ms, row.latency_ci_hi_ms = t.ci_lo_ms, t.ci_hi_ms
        row.compute_ms = t.median_ms
        # useful rows: the valid rows, or the bmm's own E x (R // E) (all useful, none padding)
        done = row.metrics["gemm_rows"] if cell["system"] == "cublas_bmm" else valid
        flops = 2.0 * done * spec.hidden * spec.out
        row.metrics["tflops"] = flops / t.median_ms / 1e9
    except CutlassUnavailable as exc:
        row.status, row.reason = "skipped", str(exc)
    except torch.cuda.OutOfMemoryError as exc:
        row.status, row.reason = "error", f"out of memory: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - a failing cell must not stop the sweep
        row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"[:500]
    return [row]
