"""Everything decided before a rank starts: the world size, every setting and cell validated,
the table checked, the cells to run (the Plan), the start message and the dry run. Bad input
raises a one-line HarnessUserError (harness.run prints `error: ...`, exit 2).
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.config import GridConf, bad_experiment_name, nearest_key, typed_nodes
from harness.errors import HarnessUserError
from harness.records import KEEP_STATUSES, KEEP_STATUSES_REDO_FAILED, ResultsTable
from harness.workload import DTYPES

DRY_RUN_ROWS = 20
#: at most this many gloo processes per CPU core
MAX_RANKS_PER_CORE = 8


def table_path(cfg: Any) -> Path:
    return Path(cfg.table or Path(cfg.results_dir) / f"{cfg.experiment.name}.parquet")


def resolve_world(cfg: Any) -> int:
    """Number of processes to spawn; a clear error when it is not sane for the hardware."""
    hw = cfg.hardware
    if hw.device == "cuda":
        n_gpu = torch.cuda.device_count()
        if n_gpu == 0:
            raise HarnessUserError(
                f"hardware={hw.name} needs CUDA GPUs; none found (try hardware=cpu)"
            )
        world = hw.world_size or n_gpu
        if world < 0 or world > n_gpu:
            raise HarnessUserError(
                f"hardware.world_size={world} but {n_gpu} GPU(s) are present (0 = all of them)"
            )
        return world
    if hw.device != "cpu":
        raise HarnessUserError(f"hardware.device must be cpu or cuda, got {hw.device!r}")
    most = MAX_RANKS_PER_CORE * (os.cpu_count() or 1)
    if not 1 <= hw.world_size <= most:
        raise HarnessUserError(
            f"hardware.world_size must be 1..{most} on this {os.cpu_count()}-core CPU "
            f"(at most {MAX_RANKS_PER_CORE} gloo processes per core), got {hw.world_size}"
        )
    return hw.world_size


def unknown_keys(cfg: Any) -> None:
    """A key not in the schema is an error, also one Hydra's `+` added (a typo would be ignored)."""
    for path, schema in typed_nodes():
        node = cfg
        for part in filter(None, path.split(".")):
            node = node[part]
        extra = sorted(set(node.keys()) - set(schema.__dataclass_fields__) - {"hydra"})
        if extra:
            where = f"{path}." if path else ""
            near = nearest_key(f"{where}{extra[0]}")
            hint = f"; did you mean {near}?" if near else ""
            raise HarnessUserError(
                f"unknown key {where}{extra[0]}: not in the config schema (harness/config.py); "
                f"{path or 'top-level'} keys are {', '.join(schema.__dataclass_fields__)}{hint}"
            )


def validate_settings(cfg: Any, workload: str | None) -> None:
    """Checks that need no cell: keys, measure settings, time-out, axes, systems, workload group."""
    unknown_keys(cfg)
    bad_name = bad_experiment_name(cfg.experiment.name)
    if bad_name:
        raise HarnessUserError(bad_name)
    m, hw = cfg.measure, cfg.hardware
    inf = float("inf")
    for ok, why in (  # in this order: the first one broken is the error
        (m.iters >= 1, f"measure.iters must be >= 1, got {m.iters}"),
        (m.warmup >= 0, f"measure.warmup must be >= 0, got {m.warmup}"),
        (1 <= m.rounds <= m.iters, f"measure.rounds must be in [1, measure.iters], got {m.rounds}"),
        (0 < m.tol < inf, f"measure.tol must be a number > 0, got {m.tol}"),
        (
            (hw.device, hw.backend) in (("cpu", "gloo"), ("cuda", "nccl"), ("cuda", "gloo")),
            f"hardware.device={hw.device} with hardware.backend={hw.backend} is not supported; "
            "use cpu with gloo, or cuda with nccl",
        ),
        (0 < hw.timeout_s < inf, f"hardware.timeout_s must be > 0 seconds, got {hw.timeout_s}"),
        (hw.restarts >= 0, f"hardware.restarts must be >= 0, got {hw.restarts}"),
    ):
        if not ok:
            raise HarnessUserError(why)
    for axis, values in cfg.experiment.grid.items():
        values = list(values)
        if not values and axis != "world_size":  # empty world_size: the number of processes
            raise HarnessUserError(f"experiment.grid.{axis} is empty; give it at least one value")
        twice = sorted({repr(v) for i, v in enumerate(values) if v in values[:i]})
        if twice:  # the cell would run twice and the counts would be wrong
            raise HarnessUserError(f"experiment.grid.{axis} lists {', '.join(twice)} twice")
    if not cfg.experiment.systems:
        raise HarnessUserError(
            "experiment.systems is empty; name at least one system "
            "(e.g. '+experiment.systems.serial={}')"
        )
    if workload and not cfg.experiment.takes_workload:
        raise HarnessUserError(
            f"experiment {cfg.experiment.name} sets its own shape, so workload={workload} would be "
            "ignored; drop it, or set the shape with experiment.grid.<axis>=[...]"
        )


def unread_settings(cfg: Any, exp: Any) -> None:
    """A setting the experiment module would ignore is an error: a grid axis not in its
    GRID_AXES (if it has one) set away from the default, or experiment.options without `options`."""
    name = cfg.experiment.name
    read = getattr(exp, "GRID_AXES", None)
    if read is not None:
        default = GridConf()
        bad = [
            f"{axis}={list(cfg.experiment.grid[axis])}"
            for axis in GridConf.__dataclass_fields__
            if axis not in read and list(cfg.experiment.grid[axis]) != getattr(default, axis)
        ]
        if bad:
            raise HarnessUserError(
                f"experiment {name} reads experiment.grid.{', '.join(read)} only; "
                f"{', '.join(bad)} would be ignored"
            )
    given = dict(cfg.experiment.get("options") or {})
    if given and not hasattr(exp, "options"):
        raise HarnessUserError(
            f"experiment {name} takes no experiment.options; {sorted(given)} would be ignored"
        )


def memory_bytes(cfg: Any) -> int | None:
    """Bytes a rank's tensors live in: GPU 0's on cuda (None without a GPU), else the host's."""
    if cfg.hardware.device == "cuda":
        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rank_floor_bytes(cell: dict) -> int:
    """A lower bound on one rank's bytes for a workload cell (0 for another kind of cell): tokens
    x [T, K], experts' weights (E x K x N; FFN: E x 2 x H x F), expert rows out [T * k, N] (the
    busiest rank receives at least the mean), output [T, N]; an FFN cell dispatched on the
    device (params dispatch auto or device) also its worst-case receive buffer [W * T * k, K]."""
    keys = ("tokens_per_rank", "hidden", "out", "experts_per_rank", "top_k", "dtype")
    if not all(k in cell for k in keys) or cell["dtype"] not in DTYPES:
        return 0
    t, k, n, e, top = (int(cell[a]) for a in keys[:5])
    f = int(cell.get("ffn", 0) or 0)
    weights = e * 2 * k * f if f else e * k * n
    worst = 0
    if f and (cell.get("params") or {}).get("dispatch") in ("auto", "device"):
        worst = int(cell.get("world_size", 1) or 1) * t * top * k
    return (t * k + weights + t * top * n + t * n + worst) * DTYPES[cell["dtype"]].itemsize


def check_memory(cfg: Any, cells: list[dict], world: int, one_rank: bool = False) -> None:
    """A cell whose tensors cannot fit is an error before any process starts (else it fails in
    every rank with nothing to record); cells that `world` processes skip are not checked. The
    ranks sharing one memory: all on a CPU host; one per GPU, or all W where one process plays
    them; one where the experiment computes one rank's problem (`one_rank`: its ONE_RANK)."""
    have = memory_bytes(cfg)
    if have is None:
        return
    for cell in cells:
        w = int(cell.get("world_size", world) or world)
        if w != world and world != 1:
            continue
        sharing = 1 if one_rank else w if cfg.hardware.device != "cuda" or world == 1 else 1
        need = rank_floor_bytes(cell) * sharing
        if need > have:
            where = "the GPU" if cfg.hardware.device == "cuda" else "this host"
            raise HarnessUserError(
                f"cell {cell['system']} W={w} T={cell['tokens_per_rank']} K={cell['hidden']} "
                f"N={cell['out']} E={cell['experts_per_rank']} needs at least {need / 2**30:.1f} "
                f"GiB (tokens, weights, expert rows and output of {sharing} rank(s)), more than "
                f"the {have / 2**30:.1f} GiB of {where}"
            )


def load_experiment(cfg: Any):
    try:
        return importlib.import_module(cfg.experiment.module)
    except ModuleNotFoundError as exc:
        raise HarnessUserError(f"experiment module {cfg.experiment.module!r} not found") from exc


@dataclass
class Plan:
    """What a run will do: every cell of the config and the ones still to run."""

    cells: list[dict]
    todo: list[dict]
    #: status in the table of each cell of this config that is there
    found: dict[str, str]
    #: rows in the table that belong to no cell of this config (other settings or versions)
    others: int
    table: ResultsTable
    world: int


def preflight(
    cfg: Any, world: int, workload: str | None = None, *, table: bool = True, writable: bool = True
) -> Plan:
    """Build and validate every cell and read the table, before any rank starts."""
    try:
        validate_settings(cfg, workload)
        exp = load_experiment(cfg)
        unread_settings(cfg, exp)
        cells = exp.cells(cfg, world)
        sm = 0
        if cfg.hardware.device == "cuda" and torch.cuda.is_available():
            sm = torch.cuda.get_device_properties(0).multi_processor_count
        exp.validate(cfg, cells, sm)
        check_memory(cfg, cells, world, getattr(exp, "ONE_RANK", False))
    except ValueError as exc:  # the experiment's and the systems' own checks raise ValueError
        raise HarnessUserError(str(exc)) from exc
    except (TypeError, KeyError, AttributeError) as exc:  # a value of the wrong kind or shape
        raise HarnessUserError(
            f"a setting has the wrong type or shape ({type(exc).__name__}: {exc}); "
            "HYDRA_FULL_ERROR=1 shows where"
        ) from exc
    if not cells:
        raise HarnessUserError(f"experiment {cfg.experiment.name} has no cells with these settings")
    results = ResultsTable(table_path(cfg))
    found: dict[str, str] = {}
    others = 0
    if table:
        if writable:
            results.check_writable()
        in_table = results.statuses()
        results.check_schema()  # a core column of another type: no row could be added
        hashes = {c["cell_hash"] for c in cells}
        found = {h: s for h, s in in_table.items() if h in hashes}
        others = len(in_table) - len(found)
    keep = KEEP_STATUSES_REDO_FAILED if cfg.redo_failed else KEEP_STATUSES
    todo = [c for c in cells if found.get(c["cell_hash"]) not in keep]
    return Plan(cells, todo, found, others, results, world)


def start_message(cfg: Any, plan: Plan) -> str:
    kept = len(plan.cells) - len(plan.todo)
    todo = {c["cell_hash"] for c in plan.todo}
    retry = len(todo & set(plan.found))
    counts = Counter(s for h, s in plan.found.items() if h not in todo)
    why = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    msg = (
        f"[harness] {cfg.experiment.name}: {len(plan.cells)} cells; {kept} already in "
        f"{plan.table.path}{f' ({why})' if why else ''}, {len(plan.todo)} to run"
    )
    if retry:
        again = "failed or error" if cfg.redo_failed else "error"
        msg += f" ({retry} {again} cell(s) again)"
    msg += (
        f" on {plan.world} rank(s) ({cfg.hardware.device}, {cfg.hardware.backend}); "
        f"cell time-out {cfg.hardware.timeout_s:g} s"
    )
    if plan.others:
        msg += f"; {plan.others} row(s) of other settings in the table are kept"
    g = cfg.experiment.grid
    ignored = sorted(set(g.out) - set(g.hidden)) if any(g.ffn) else []
    if ignored:  # expand_grid: an FFN cell returns its input width
        msg += f"; FFN cells take out = hidden (experiment.grid.out {ignored} is not used for them)"
    return msg


def describe(cell: dict | None) -> str:
    """A cell in one short phrase: system, hash, workload, params."""
    if cell is None:
        return "(before the first cell)"
    keys = ("world_size", "tokens_per_rank", "hidden", "out", "ffn", "experts_per_rank", "top_k")
    short = ("W", "T", "K", "N", "F", "E", "k")
    shape = " ".join(f"{s}={cell[k]}" for k, s in zip(keys, short) if k in cell)
    tail = " ".join(str(cell[k]) for k in ("routing", "dtype") if k in cell)
    params = " ".join(f"{k}={v}" for k, v in cell.get("params", {}).items())
    return f"{cell['cell_hash']} ({cell['system']} {shape} {tail}{' ' + params if params else ''})"


def dry_run(cfg: Any, workload: str | None = None) -> None:
    """Print a short table of the cells, marking those already in the table (no GPU, no rank)."""
    hw = cfg.hardware
    n_gpu = torch.cuda.device_count() if hw.device == "cuda" else 0
    world = hw.world_size or n_gpu or 1
    if hw.device == "cpu":
        world = resolve_world(cfg)
    plan = preflight(cfg, world, workload, writable=False)
    import pandas as pd

    keep = {c["cell_hash"] for c in plan.cells} - {c["cell_hash"] for c in plan.todo}
    skip = ("experiment", "system", "seed", "cell_hash", "params")
    lines = []
    for c in plan.cells[:DRY_RUN_ROWS]:
        h = c["cell_hash"]
        status = plan.found.get(h)
        mark = "-" if status is None else status if h in keep else f"{status}, runs again"
        shape = {k: v for k, v in c.items() if k not in skip}
        params = " ".join(f"{k}={v}" for k, v in c.get("params", {}).items())
        row = {"cell_hash": h, "system": c["system"], **shape, "params": params}
        lines.append({**row, "in table": mark})
    print(pd.DataFrame(lines).to_string(index=False))
    if len(plan.cells) > DRY_RUN_ROWS:
        print(f"... and {len(plan.cells) - DRY_RUN_ROWS} more cell(s)")
    assumed = (
        "" if hw.world_size or n_gpu else " (hardware.world_size=0 and no GPU here: 1 assumed)"
    )
    print(
        f"[harness] dry run of {cfg.experiment.name}: {len(plan.cells)} cells on {world} "
        f"rank(s){assumed}; {len(keep)} already in {plan.table.path}, {len(plan.todo)} to run"
    )
