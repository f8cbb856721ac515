"""The producer against cuBLAS: the overlap system's expert GEMM alone, on one GPU.

The experiment and its references: docs/experiments.md (`producer`). One workload = (T, K, N, E,
top_k, routing, W, dtype): rank 0's expert problem from the routing of W ranks, laid out by the
real stage-A builder (problem). `overlap` runs the producer with the tuning table's tile
configuration per point of the overlap system's sweep (tile_m, layout, order), its local rows
stored through row_dst as the overlap system stores them; `cublas_bmm` multiplies [E, R // E, K]
x [E, K, N] (the same FLOPs, less up to E - 1 rows). Each kernel is checked against float32,
then one launch is timed (CUDA events); a failing one records `fail`. Metrics: m_tflops (2 R K N
/ time; the bmm's own rows for cublas_bmm), m_valid_rows, m_gemm_rows (padding included), m_flags.
Options (experiment.options): flags (list of bool, default [true]).
"""

from __future__ import annotations

import itertools
import json
import math
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from harness.check import check
from harness.measure import (
    SPEC_KEYS,
    experiment_options,
    hash_cell,
    selected_systems,
    set_latency,
    system_points,
)
from harness.records import Row, cell_row
from harness.routing import imbalance, owner_expert_counts
from harness.system import RunContext, list_param
from harness.timing import time_fn
from harness.workload import DTYPES, WorkloadSpec, routing_of
from systems.overlap.plan import LAYOUTS, ORDERS, padded_input, plan_from_rows

AXES = ("world_size", *SPEC_KEYS)
GRID_AXES = AXES  # the grid axes this experiment reads (harness.preflight.unread_settings)
ONE_RANK = True  # rank 0's expert GEMM of a W-rank grid, one rank (preflight.check_memory)
REFERENCES = ("torch_grouped_mm", "cublas", "cublas_bmm")
OPTIONS = {"flags": [True]}
#: the overlap system's knobs that shape its producer (the rest belong to the consumer)
PRODUCER_KNOBS = ("tile_m", "layout", "order")


def options(cfg: Any) -> dict[str, Any]:
    """OPTIONS overridden by experiment.options; unknown keys are an error."""
    merged = experiment_options(cfg, "producer", OPTIONS)
    list_param("producer", "options.flags", merged["flags"], nonempty=True)
    if not all(isinstance(f, bool) for f in merged["flags"]):
        raise ValueError(f"producer: options.flags holds true / false, got {list(merged['flags'])}")
    return merged


def cells(cfg: Any, process_world: int) -> list[dict]:
    """Per workload: the references, then the overlap producer per (sweep point, flags)."""
    g = cfg.experiment.grid
    axes = [list(g.world_size) or [process_world]] + [list(getattr(g, k)) for k in AXES[1:]]
    points = {name: system_points(name, conf) for name, conf in selected_systems(cfg).items()}
    flags = [bool(f) for f in options(cfg)["flags"]]
    todo = [(ref, {}) for ref in REFERENCES]
    for system, sweep in points.items():  # consumer knobs do not change the producer
        knobs = [{k: p[k] for k in PRODUCER_KNOBS} for p in sweep]
        unique = [kn for i, kn in enumerate(knobs) if kn not in knobs[:i]]
        todo += [(system, {**kn, "flags": f}) for kn in unique for f in flags]
    out = []
    for values in itertools.product(*axes):
        base = {"experiment": cfg.experiment.name, "seed": cfg.seed, **dict(zip(AXES, values))}
        for system, params in todo:
            cell = {**base, "system": system, "params": dict(params)}
            cell["cell_hash"] = hash_cell(cfg, process_world, cell)
            out.append(cell)
    return out


def spec_of(cell: dict) -> WorkloadSpec:
    return WorkloadSpec(**{k: cell[k] for k in AXES}, seed=cell["seed"])


def validate(cfg: Any, cells: list[dict], sm_count: int) -> None:
    """Clear errors before any GPU work: the workload, the systems, the dtype, the tile."""
    options(cfg)  # unknown or malformed options
    for cell in cells:
        spec = spec_of(cell)  # a bad routing, a non-positive size
        if cell["system"] not in (*REFERENCES, "overlap"):
            raise ValueError(f"producer times the overlap system's producer, not {cell['system']}")
        if spec.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"producer: dtype must be float16 or bfloat16, got {spec.dtype}")
        if spec.top_k > spec.world_size * spec.experts_per_rank:
            raise ValueError(f"producer: top_k {spec.top_k} > W x E")
        if spec.hidden % 8 or spec.out % 8:
            raise ValueError("producer: K and N must be multiples of 8 (16-byte rows)")
        if cell["system"] != "overlap":
            continue
        p = cell["params"]
        if p["tile_m"] not in (64, 128):
            raise ValueError(f"producer: tile_m must be 64 or 128, got {p['tile_m']}")
        if p.get("order") not in ORDERS:
            raise ValueError(f"producer: order must be one of {ORDERS}, got {p}")
        if p.get("layout", "aligned") not in LAYOUTS:
            raise ValueError(
                f"producer: layout must be one of {', '.join(LAYOUTS)}, got {p.get('layout')!r}"
            )


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


def problem(spec: WorkloadSpec, tile_m: int, layout: str, device: torch.device, **walk):
    """Rank 0's expert problem: plan (walk: the producer's order and group_cap, else build_plan's
    defaults), X [P, K] padded, weights [E, K, N], the valid rows grouped by expert x_valid
    [R, K] with their expert offsets, and the float32 reference Y [P, N]."""
    ids = routing_of(spec).expert_ids
    counts = owner_expert_counts(ids, spec.experts_per_rank)  # [W, W*E]
    rows = counts[:, : spec.experts_per_rank].t().tolist()  # rows owner s sends rank 0's expert e
    plan = plan_from_rows(rows, rank=0, tile_m=tile_m, device=device, layout=layout, **walk)
    x_recv, w = _operands(spec, int(plan.n_rows), device)
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
        ref_y=lambda: reference_y(plan.expert_row_start.tolist(), x, w),
        imbalance=imbalance(ids, spec.world_size, spec.experts_per_rank),
    )


def reference_y(starts: list[int], x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Y [P, N] float32 of X [P, K] and weights [E, K, N], expert e owning the rows
    starts[e]:starts[e+1] (zero padding rows give zero rows)."""
    y = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float32, device=x.device)
    for e, (a, b) in enumerate(zip(starts, starts[1:])):
        y[a:b] = x[a:b].float() @ w[e].float()
    return y


def batched_rows(x_valid: torch.Tensor, e: int) -> torch.Tensor:
    """The cublas_bmm reference's input [E, R // E, K] from the valid rows [R, K] (the first
    E x (R // E) of them); with fewer rows than experts, one row each, zeros past the valid."""
    r = x_valid.shape[0]
    if r >= e:
        return x_valid[: e * (r // e)].reshape(e, r // e, -1)
    xb = x_valid.new_zeros(e, 1, x_valid.shape[1])
    xb[:r, 0] = x_valid
    return xb


def _kernel(ctx: RunContext, cell: dict, pb) -> tuple[Any, torch.Tensor, torch.Tensor, dict]:
    """(launch, output, its float32 reference, metrics) of one cell's kernel."""
    rows = float(pb.x_valid.shape[0])
    if cell["system"] == "torch_grouped_mm":
        go = partial(torch._grouped_mm, pb.x_valid, pb.w, offs=pb.offsets)
        out, ref = go(), pb.ref_y()[pb.valid]
        impl = "torch._grouped_mm"
    elif cell["system"] == "cublas":
        go = partial(torch.matmul, pb.x_valid, pb.w[0])
        out, ref = go(), pb.x_valid.float() @ pb.w[0].float()
        impl = "torch.matmul (cuBLAS)"
    elif cell["system"] == "cublas_bmm":
        xb = batched_rows(pb.x_valid, pb.w.shape[0])
        go = partial(torch.bmm, xb, pb.w)
        out, ref = go(), torch.bmm(xb.float(), pb.w.float())
        rows = float(xb.shape[0] * xb.shape[1])
        impl = "torch.bmm (cuBLAS batched, R // E rows an expert)"
    else:
        return _producer_kernel(ctx, cell, pb)
    return go, out, ref, {"gemm_rows": rows, "impl": impl}


def _producer_kernel(ctx: RunContext, cell: dict, pb) -> tuple:
    """_kernel of an overlap cell: the table's tile configuration (pb.cfg; pb.plan built for its
    group_cap and the cell's order), the local rows stored in a receive buffer recv [L, N]
    through plan.row_dst [P]; checked by reading them back from there."""
    from systems.overlap.kernels import launch_producer

    p, cfg, flags = pb.plan, pb.cfg, bool(cell["params"]["flags"])
    n = p.sizes()
    dev, dt, n_out = pb.x.device, pb.x.dtype, pb.w.shape[2]
    y = torch.zeros(n["n_padded"], n_out, dtype=dt, device=dev)
    ready = torch.zeros(p.max_bands, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    row_dst = p.row_dst
    recv = torch.zeros(int(row_dst.max()) + 1 if n["n_padded"] else 0, n_out, dtype=dt, device=dev)
    kw = dict(num_programs=sms, config=cfg, signal=flags, recv=recv)
    go = partial(launch_producer, pb.x, pb.w, y, p, ready, **kw)
    go()
    # one run: every remote band's counter holds one run's increment
    got = ready[p.schedule[: n["n_remote_bands"]]]
    if flags and not bool((got == cfg.band_increment(n_out)).all()):
        raise RuntimeError("producer: a ready flag is wrong after one run")
    metrics = {"gemm_rows": float(n["n_padded"]), "impl": "overlap producer (triton)"}
    metrics["config"] = json.dumps(cfg.__dict__, default=str)
    mine = row_dst >= 0
    out = y.clone()
    out[mine] = recv[row_dst[mine]]
    return go, out[pb.valid], pb.ref_y()[pb.valid], metrics


def _cell_problem(cell: dict, spec: WorkloadSpec, device: torch.device):
    """problem() of a cell; an overlap cell's plan is built for its order and the tuning
    table's tile configuration (pb.cfg), as the overlap runner builds it."""
    p = cell["params"]
    tile_m, layout = int(p.get("tile_m", 128)), p.get("layout", "aligned")
    if cell["system"] != "overlap":
        return problem(spec, tile_m, layout, device)
    from systems.overlap.tuning import pick_config

    cfg = pick_config(tile_m, spec.hidden, spec.out, DTYPES[spec.dtype])
    pb = problem(spec, tile_m, layout, device, order=p["order"], group_cap=cfg.group_cap)
    pb.cfg = cfg
    return pb


def run_cell(ctx: RunContext, cfg: Any, cell: dict) -> list[Row]:
    spec = spec_of(cell)
    shape = {k: getattr(spec, k) for k in AXES}
    row = cell_row(cell, scope="expert gemm", transport="none", **shape)
    if ctx.device.type != "cuda":
        row.status = "skipped"
        row.reason = f"the producer and its references need a CUDA GPU, not {ctx.device.type}"
        return [row]
    try:
        p = cell["params"]
        pb = _cell_problem(cell, spec, ctx.device)
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
        set_latency(row, t)
        row.compute_ms = t.median_ms
        # useful rows: the valid rows, or the bmm's own E x (R // E) (all useful, none padding)
        done = row.metrics["gemm_rows"] if cell["system"] == "cublas_bmm" else valid
        flops = 2.0 * done * spec.hidden * spec.out
        row.metrics["tflops"] = flops / t.median_ms / 1e9
    except torch.cuda.OutOfMemoryError as exc:
        row.status, row.reason = "error", f"out of memory: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - a failing cell must not stop the sweep
        row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"[:500]
    return [row]
