"""A test-only experiment: the systems_sweep cells, each held for a while on every rank.

HARNESS_TEST_SLEEP=<seconds> makes every rank touch HARNESS_TEST_MARK/<rank> (a folder) when it
starts a cell, then sleep that long before the cell runs as usual, so a test knows the ranks
are inside a cell and has time to act there. Use with `experiment.module=tests.slow_experiment`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from experiments import systems_sweep
from harness.system import RunContext

cells = systems_sweep.cells
validate = systems_sweep.validate


def run_cell(ctx: RunContext, cfg: Any, cell: dict):
    mark = os.environ.get("HARNESS_TEST_MARK")
    if mark:
        (Path(mark) / str(ctx.rank)).touch()
    time.sleep(float(os.environ.get("HARNESS_TEST_SLEEP", "0")))
    return systems_sweep.run_cell(ctx, cfg, cell)
