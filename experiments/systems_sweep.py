"""The generic experiment: every system of the config on every cell of the grid (smoke,
operator, layer, the cCTA x mgb sweeps, ...), each cell measured by harness.measure.measure_cell
(check, then latency and the bounds).
"""

from __future__ import annotations

from typing import Any

import torch

from harness.measure import expand_grid, measure_cell, measure_workload, validate_cells
from harness.records import Row
from harness.system import RunContext

cells = expand_grid
#: the cells of one workload, timed in interleaved rounds (measure.rounds > 1)
run_workload = measure_workload


def validate(cfg: Any, cells: list[dict], sm_count: int) -> None:
    hw = cfg.hardware
    processes = hw.world_size or (torch.cuda.device_count() if hw.device == "cuda" else 1)
    validate_cells(cells, sm_count, processes, hw.device)


def run_cell(ctx: RunContext, cfg: Any, cell: dict) -> list[Row]:
    return [measure_cell(ctx, cfg, cell)]
