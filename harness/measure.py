"""Cell expansion and the generic measurement of one system on one cell.

Per cell: workload -> capability gate -> system.setup -> correctness gate vs the reference
(reference_local, float32) -> timed forward, compute-only and comm-only -> one Row.
A cell that fails the check records status=fail and no latency.
"""

from __future__ import annotations

import itertools
import json
import random
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from harness.check import check
from harness.layout import rank_layout
from harness.records import Row, cell_hash, command_line, overlap_ratio, provenance
from harness.reference import dispatch, dispatch_local, reference_local
from harness.system import CellInputs, RunContext, get_system
from harness.timing import time_fn
from harness.workload import WorkloadSpec, imbalance_of, make_rank_weights, make_tokens

SPEC_KEYS = ("tokens_per_rank", "hidden", "out", "experts_per_rank", "top_k", "routing", "dtype")
PARAM_KEYS = ("ccta", "mgb", "tile_m", "transport")


def expand_grid(cfg: Any, process_world: int) -> list[dict]:
    """All cells of an experiment: the product of the grid axes, then the systems (innermost).

    The systems of one workload run in a seeded random order, different per workload, so slow
    drift of the machine does not favour one system (the same order on every rank).
    """
    g = cfg.experiment.grid
    worlds = list(g.world_size) or [process_world]
    axes = {k: list(getattr(g, k)) for k in SPEC_KEYS + PARAM_KEYS}
    cells = []
    names = list(axes)
    rng = random.Random(cfg.seed)
    for values in itertools.product(worlds, *(axes[k] for k in names)):
        base = {"world_size": values[0], **dict(zip(names, values[1:]))}
        systems = list(cfg.experiment.systems)
        rng.shuffle(systems)
        for system in systems:
            cell = {"experiment": cfg.experiment.name, "system": system, "seed": cfg.seed, **base}
            cell["cell_hash"] = cell_hash(cell)
            cells.append(cell)
    return cells


def spec_of(cell: dict) -> WorkloadSpec:
    return WorkloadSpec(
        world_size=cell["world_size"], seed=cell["seed"], **{k: cell[k] for k in SPEC_KEYS}
    )


def params_of(cell: dict, extra: dict | None = None) -> dict:
    return {**(extra or {}), **{k: cell[k] for k in PARAM_KEYS}}


def validate_cells(cells: list[dict], sm_count: int, params: dict | None = None) -> None:
    """Clear errors for bad cells before any GPU work: unknown system, routing, shapes."""
    for cell in cells:
        info = get_system(cell["system"])
        spec = spec_of(cell)
        if sm_count and cell["ccta"] >= sm_count:
            raise ValueError(f"ccta={cell['ccta']} must be below the GPU's {sm_count} SMs")
        info.load().validate(spec, params_of(cell, params), sm_count)


def base_row(cell: dict, spec: WorkloadSpec) -> Row:
    imb = imbalance_of(spec)
    fields = {k: cell[k] for k in ("experiment", "system", "cell_hash", "world_size", *SPEC_KEYS)}
    return Row(
        **fields,
        imbalance_rank=imb["imbalance_rank"],
        imbalance_expert=imb["imbalance_expert"],
        ccta=cell["ccta"],
        mgb=cell["mgb"],
        tile_m=cell["tile_m"],
        command=command_line(),
        timestamp=time.time(),
        **provenance(),
    )


class _RefCache:
    """Reference output and inputs of the last workload, shared by the systems of a cell."""

    key: str = ""
    value: tuple | None = None


def _inputs(ctx: RunContext, spec: WorkloadSpec) -> tuple[CellInputs, torch.Tensor]:
    if _RefCache.key != spec.key():
        _RefCache.value = None
        lay = rank_layout(spec, ctx.rank)
        x = make_tokens(spec, ctx.rank, ctx.device)
        w = make_rank_weights(spec, ctx.rank, ctx.device)
        if spec.world_size == ctx.world_size:
            x_recv = dispatch(x, lay, ctx.group)
        else:
            x_recv = dispatch_local(spec, lay, ctx.device)
        ref = reference_local(spec, ctx.rank, ctx.device)
        _RefCache.key, _RefCache.value = spec.key(), (CellInputs(spec, lay, x, w, x_recv), ref)
    return _RefCache.value  # type: ignore[return-value]


def _agree(ctx: RunContext, value: float, op=dist.ReduceOp.MAX) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op, group=ctx.group)
    return float(t.item())


def measure_cell(ctx: RunContext, cfg: Any, cell: dict) -> Row:
    """Run one system on one cell on this rank; every rank returns the same Row values."""
    spec = spec_of(cell)
    row = base_row(cell, spec)
    info = get_system(cell["system"])
    reason = info.unavailable_reason(ctx, spec.world_size)
    if reason is not None:
        row.status, row.reason = "skipped", reason
        return row
    try:
        system = info.load()(ctx, params_of(cell, dict(cfg.experiment.params)))
        inputs, ref = _inputs(ctx, spec)
        system.setup(inputs)
        row.impl, row.transport, row.scope = system.impl, system.transport, system.scope
        for k, v in system.row_fields().items():
            setattr(row, k, v)
        simulated = getattr(system, "simulated_ranks", None)
        if simulated:  # one process plays several ranks: check all of their outputs
            ref = torch.cat([reference_local(spec, r, ctx.device) for r in simulated])
        res = check(system.forward(), ref, cfg.measure.tol)
        err = _agree(ctx, res.max_rel_err if res.max_rel_err == res.max_rel_err else 1e30)
        ok = _agree(ctx, 0.0 if res.ok else 1.0) == 0.0
        row.max_rel_err = err
        if not ok:
            row.status, row.reason = "fail", res.message or "check failed on another rank"
            return row
        kw = dict(
            device=ctx.device, group=ctx.group, warmup=cfg.measure.warmup, iters=cfg.measure.iters
        )
        t = time_fn(getattr(system, "timed", system.forward), **kw)
        row.latency_ms, row.latency_p10_ms, row.latency_p90_ms = t.median_ms, t.p10_ms, t.p90_ms
        if system.has_bounds():
            row.compute_ms = time_fn(system.compute_only, **kw).median_ms
            row.comm_ms = time_fn(system.comm_only, **kw).median_ms
            row.overlap_ratio = overlap_ratio(row.compute_ms, row.comm_ms, row.latency_ms)
        extra = getattr(system, "extra", None)
        if extra:
            row.extra = json.dumps(extra, sort_keys=True, default=str)
    except torch.cuda.OutOfMemoryError as exc:
        row.status, row.reason = "error", f"out of memory: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - a failing cell must not stop the sweep
        row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"[:500]
        if ctx.rank == 0:
            traceback.print_exc()
    return row
