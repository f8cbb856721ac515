"""Padding study: the exact zero rows of the remote-aligned layout, W = 2..64, on the CPU.

Padding is a pure function of the routing, W, E and tile_m: counted exactly from the global
routing for EVERY rank of the logical W (no plan is built, nothing is timed):
  C[s, g]    rows owner s sends to global expert g
  pad[r]     sum over remote owners s != r and r's experts g of (-C[s, g]) mod tile_m
  gemm[r]    rows rank r's experts compute after padding = valid[r] + pad[r]
  tiles_<layout>[r]  row tiles r's producer computes per layout (plan.row_tiles; compact's equal
             torch._grouped_mm's). Both bounds per rank: docs/method.md, Padding bounds.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import torch

from harness.measure import hash_cell, selected_systems, system_points, unused_knobs
from harness.records import Row, cell_row
from harness.routing import owner_expert_counts
from harness.system import RunContext, int_param
from harness.workload import WorkloadSpec, imbalance_of, routing_of
from systems.overlap.plan import TILE_COUNT_LAYOUTS, padding_rows, row_tiles

AXES = ("world_size", "tokens_per_rank", "experts_per_rank", "top_k", "routing")
GRID_AXES = AXES  # the grid axes this experiment reads (harness.preflight.unread_settings)


def cells(cfg: Any, process_world: int) -> list[dict]:
    """One cell per (W, tokens, E, top_k, routing) x each point of the overlap system's sweep
    (tile_m), the sweep innermost (the routing is reused)."""
    g = cfg.experiment.grid
    axes = [list(g.world_size) or [process_world]] + [list(getattr(g, k)) for k in AXES[1:]]
    points = {name: system_points(name, conf) for name, conf in selected_systems(cfg).items()}
    out = []
    for values in itertools.product(*axes):
        base = {"experiment": cfg.experiment.name, "seed": cfg.seed, **dict(zip(AXES, values))}
        for system, params in ((s, p) for s, ps in points.items() for p in ps):
            cell = {**base, "system": system, "params": params}
            cell["cell_hash"] = hash_cell(cfg, process_world, cell)
            out.append(cell)
    return out


def _spec(cell: dict) -> WorkloadSpec:
    keys = ("tokens_per_rank", "experts_per_rank", "top_k", "world_size", "routing", "seed")
    return WorkloadSpec(hidden=1, out=1, **{k: cell[k] for k in keys})


def validate(cfg: Any, cells: list[dict], sm_count: int) -> None:
    """Clear errors before any work: shapes, routing names, tile heights."""
    for cell in cells:
        _spec(cell)  # raises on a bad routing, top_k > W*E, non-positive sizes
        unused_knobs("padding", cell["system"], cell["params"], ("tile_m",))
        int_param("padding", "tile_m", cell["params"]["tile_m"])
        if cell["params"]["tile_m"] < 1:
            raise ValueError(
                f"tile_m must be >= 1, got {cell['params']['tile_m']} "
                "(set experiment.systems.overlap.sweep.tile_m)"
            )


def counts_of(spec: WorkloadSpec) -> tuple[torch.Tensor, dict]:
    """C [W, W*E] of a spec's routing and its imbalance (routing_of caches the routing, so the
    tile_m sweep of one workload draws it once)."""
    ids = routing_of(spec).expert_ids
    return owner_expert_counts(ids, spec.experts_per_rank), imbalance_of(spec)


def padding_metrics(counts: torch.Tensor, experts_per_rank: int, tile_m: int) -> dict[str, float]:
    """All padding numbers of one (routing, tile_m) from C [W, W*E]."""
    W, E, tm = counts.shape[0], experts_per_rank, tile_m
    pad = padding_rows(counts, E, tm).double()  # [W]
    valid = counts.view(W, W, E).sum((0, 2)).double()  # rows each rank's experts compute
    gemm = valid + pad
    remote = counts.view(W, W, E) * (1 - torch.eye(W, dtype=counts.dtype))[:, :, None]
    groups = (remote > 0).sum((0, 2)).double()  # non-empty remote (owner, expert) groups
    share = torch.where(gemm > 0, pad / gemm.clamp(min=1), 0.0)
    crit = int(gemm.argmax())  # the busiest rank sets the layer's compute time
    b_paper = (W - 1) * (tm - 1)
    b_expert = E * b_paper
    nan = float("nan")
    tiles = {lay: row_tiles(counts, E, tm, lay).double() for lay in TILE_COUNT_LAYOUTS}  # [W] each
    return {
        **{f"tiles_{lay}_max": float(t.max()) for lay, t in tiles.items()},
        **{f"tiles_{lay}_total": float(t.sum()) for lay, t in tiles.items()},
        "pad_rows_max": float(pad.max()),
        "pad_rows_mean": float(pad.mean()),
        "pad_rows_min": float(pad.min()),
        "pad_rows_total": float(pad.sum()),
        "valid_rows_total": float(valid.sum()),
        "gemm_rows_total": float(gemm.sum()),
        "pad_share": float(pad.sum() / gemm.sum()),
        "pad_share_max_rank": float(share.max()),
        "pad_share_critical_rank": float(share[crit]),
        "critical_rows_inflation": float(gemm.max() / valid.max() - 1),
        "bound_paper_rows": float(b_paper),
        "bound_expert_rows": float(b_expert),
        "pad_max_over_paper_bound": float(pad.max()) / b_paper if b_paper else nan,
        "pad_max_over_expert_bound": float(pad.max()) / b_expert if b_expert else nan,
        "ranks_over_paper_bound": float((pad > b_paper).sum()),
        "remote_groups_mean": float(groups.mean()),
        "pad_per_remote_group": float(pad.sum() / groups.sum()) if groups.sum() else nan,
        "bound_paper_share": b_paper / (float(valid.mean()) + b_paper),
        "bound_expert_share": b_expert / (float(valid.mean()) + b_expert),
    }


DEFINITION = (
    "pad rows of rank r = sum over remote owners s != r and local experts e of "
    "(-rows(s -> e)) mod tile_m (remote-aligned layout, local rows unpadded); "
    "pad_share = total pad / total GEMM rows after padding, over all W ranks"
)


def run_cell(ctx: RunContext, cfg: Any, cell: dict) -> list[Row]:
    spec = _spec(cell)
    counts, imb = counts_of(spec)
    shape = {k: getattr(spec, k) for k in AXES}
    impl = "exact count (systems.overlap.plan.padding_rows)"
    row = cell_row(cell, impl=impl, transport="none", **shape, **imb)
    row.extra = json.dumps({"definition": DEFINITION, "seed": spec.seed})
    row.metrics = padding_metrics(counts, spec.experts_per_rank, cell["params"]["tile_m"])
    return [row]
