"""Entry point: `python -m harness.run experiment=<name> [overrides]`.

Before any process starts, `preflight` validates everything (settings, systems and their params,
every cell, the table path and an existing table) and decides which cells to run: those not in
the table yet, and those that ended in `error`. Bad input prints one line `error: ...` and exits
with code 2 (the trace only with HYDRA_FULL_ERROR=1).

On one node the parent spawns W ranks (one process per GPU with NCCL, or W CPU processes with
gloo) and supervises them: every rank reports each cell it starts and a heartbeat through its
own pipe. A rank that dies, fails, or makes no progress for `hardware.timeout_s` (a stalled
peer, a hung collective or kernel) ends the whole run within that bound: the parent kills every
rank and prints one line naming the rank and the cell. Rank 0 writes each cell's rows as soon as
every rank finished it; the cell in flight is lost and runs again on the next (plain) re-run.
Under torchrun (RANK / WORLD_SIZE set) the ranks run without this supervisor, bounded by the
process-group time-out (`hardware.timeout_s`).

Exit codes: 0 done; 1 the run stopped (a rank failed) or some cell ended in `error`; 2 bad input.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from harness.config import GridConf, register_configs
from harness.errors import CommFailure, HarnessUserError, is_comm_failure, looks_like_comm_failure
from harness.records import (
    KEEP_STATUSES,
    KEEP_STATUSES_REDO_FAILED,
    ResultsTable,
    Row,
    provenance,
)
from harness.system import RunContext

register_configs()

#: bound on a rank's start (imports, rendezvous) before its first cell, in seconds
STARTUP_S = 120.0
#: a rank whose heartbeat is older than this when the run stops is named as the stalled one
STALE_BEAT_S = 2.0
#: after the first sign of trouble, how long the parent collects reports before it decides
GRACE_S = 1.0
#: most summary rows printed (the rest are in the table)
SUMMARY_ROWS = 15
#: most cells a dry run lists
DRY_RUN_ROWS = 20
#: at most this many gloo processes per CPU core
MAX_RANKS_PER_CORE = 8
GRID_AXES = [f for f in GridConf.__dataclass_fields__ if f != "world_size"]


def table_path(cfg: Any) -> Path:
    return Path(cfg.table or Path(cfg.results_dir) / f"{cfg.experiment.name}.parquet")


# ---------------------------------------------------------------- validation (before any work)


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


def validate_settings(cfg: Any, workload: str | None) -> None:
    """Checks that need no cell: measure settings, time-out, axes, systems, the workload group."""
    m = cfg.measure
    if m.iters < 1:
        raise HarnessUserError(f"measure.iters must be >= 1, got {m.iters}")
    if m.warmup < 0:
        raise HarnessUserError(f"measure.warmup must be >= 0, got {m.warmup}")
    if not (0 < m.tol < float("inf")):
        raise HarnessUserError(f"measure.tol must be a number > 0, got {m.tol}")
    hw = cfg.hardware
    if (hw.device, hw.backend) not in (("cpu", "gloo"), ("cuda", "nccl"), ("cuda", "gloo")):
        raise HarnessUserError(
            f"hardware.device={hw.device} with hardware.backend={hw.backend} is not supported; "
            "use cpu with gloo, or cuda with nccl"
        )
    if not (0 < cfg.hardware.timeout_s < float("inf")):
        raise HarnessUserError(
            f"hardware.timeout_s must be > 0 seconds, got {cfg.hardware.timeout_s}"
        )
    for axis in GRID_AXES:
        if len(cfg.experiment.grid[axis]) == 0:
            raise HarnessUserError(f"experiment.grid.{axis} is empty; give it at least one value")
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
    """Build and validate every cell, and read the table, before any rank starts. Every bad
    input is a HarnessUserError (one line for the user)."""
    try:
        validate_settings(cfg, workload)
        exp = load_experiment(cfg)
        cells = exp.cells(cfg, world)
        sm = 0
        if cfg.hardware.device == "cuda" and torch.cuda.is_available():
            sm = torch.cuda.get_device_properties(0).multi_processor_count
        exp.validate(cfg, cells, sm)
    except ValueError as exc:  # the experiment's and the systems' own checks raise ValueError
        raise HarnessUserError(str(exc)) from exc
    if not cells:
        raise HarnessUserError(f"experiment {cfg.experiment.name} has no cells with these settings")
    results = ResultsTable(table_path(cfg))
    found: dict[str, str] = {}
    others = 0
    if table:
        if writable:
            results.check_writable()
        in_table = results.statuses()
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
    counts: dict[str, int] = {}
    for h, s in plan.found.items():
        if h not in todo:
            counts[s] = counts.get(s, 0) + 1
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
    return msg


def describe(cell: dict | None) -> str:
    """A cell in one short phrase: system, hash, workload, params."""
    if cell is None:
        return "(before the first cell)"
    keys = ("world_size", "tokens_per_rank", "hidden", "out", "experts_per_rank", "top_k")
    short = ("W", "T", "K", "N", "E", "k")
    shape = " ".join(f"{s}={cell[k]}" for k, s in zip(keys, short) if k in cell)
    tail = " ".join(str(cell[k]) for k in ("routing", "dtype") if k in cell)
    params = " ".join(f"{k}={v}" for k, v in cell.get("params", {}).items())
    return f"{cell['cell_hash']} ({cell['system']} {shape} {tail}{' ' + params if params else ''})"


# ---------------------------------------------------------------------------------- dry run


def dry_run(cfg: Any, workload: str | None = None) -> None:
    """Print a short table of the cells, marking those already in the table; needs no GPU and
    starts no rank. The process count is hardware.world_size, or the GPUs present."""
    hw = cfg.hardware
    n_gpu = torch.cuda.device_count() if hw.device == "cuda" else 0
    world = hw.world_size or n_gpu or 1
    if hw.device == "cpu":
        world = resolve_world(cfg)
    plan = preflight(cfg, world, workload, writable=False)
    import pandas as pd

    keep = {c["cell_hash"] for c in plan.cells} - {c["cell_hash"] for c in plan.todo}
    lines = []
    for c in plan.cells[:DRY_RUN_ROWS]:
        h = c["cell_hash"]
        status = plan.found.get(h)
        mark = "-" if status is None else status if h in keep else f"{status}, runs again"
        row = {"cell_hash": h, "system": c["system"]}
        skip = ("experiment", "system", "seed", "cell_hash", "params")
        row.update({k: v for k, v in c.items() if k not in skip})
        row["params"] = " ".join(f"{k}={v}" for k, v in c.get("params", {}).items())
        row["in table"] = mark
        lines.append(row)
    print(pd.DataFrame(lines).to_string(index=False))
    if len(plan.cells) > DRY_RUN_ROWS:
        print(f"... and {len(plan.cells) - DRY_RUN_ROWS} more cell(s)")
    assumed = (
        "" if hw.world_size or n_gpu else " (hardware.world_size=0 and no GPU here: 1 assumed)"
    )
    print(
        f"[harness] dry run of {cfg.experiment.name}: {len(plan.cells)} cells on {world} "
        f"rank(s){assumed}; "
        f"{len(keep)} already in {plan.table.path}, {len(plan.todo)} to run"
    )


# ------------------------------------------------------------------------------- the ranks


class Reporter:
    """A rank's reports to the supervising parent through its own pipe (one writer per pipe, so
    a rank killed or stopped mid-write cannot block another rank's reports). Without a parent
    (torchrun) it only draws rank 0's progress bar."""

    def __init__(self, rank: int, conn: Connection | None, beat_s: float, bar: Any = None):
        self.rank, self.conn, self.bar = rank, conn, bar
        #: indexes of the cells whose rows this rank wrote
        self.written_cells: set[int] = set()
        self._lock = threading.Lock()
        if conn is not None:
            threading.Thread(target=self._beat, args=(beat_s,), daemon=True).start()

    def send(self, *msg: Any) -> None:
        if self.conn is not None:
            with self._lock:
                self.conn.send(msg)

    def _beat(self, every: float) -> None:
        while True:
            try:
                self.send("beat")
            except OSError:
                return
            time.sleep(every)

    def cell(self, index: int) -> None:
        self.send("cell", index)

    def written(self, index: int, rows: list[Row]) -> None:
        self.written_cells.add(index)
        self.send("written", index, [(r.system, r.status) for r in rows])
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rows[-1].system}:{rows[-1].status}")
            self.bar.update(1)

    def done(self) -> None:
        self.send("done")

    def failed(self, exc: BaseException) -> None:
        comm = is_comm_failure(exc)
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:400]
        self.send("failed", text, comm, traceback.format_exc())


def _init_group(cfg: Any, rank: int, world: int, device: torch.device, rendezvous) -> None:
    """The process group, its collectives bounded by hardware.timeout_s. With a rendezvous
    (host, port) every rank first waits on a TCP store until all have started (bounded by
    STARTUP_S), so slow imports of one rank do not count against the collectives' time-out."""
    timeout = timedelta(seconds=float(cfg.hardware.timeout_s))
    kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if rendezvous is None:  # torchrun / Slurm: env://
        dist.init_process_group(cfg.hardware.backend, timeout=timeout, **kw)
        return
    host, port = rendezvous
    store = dist.TCPStore(
        host, port, world, is_master=rank == 0, timeout=timedelta(seconds=STARTUP_S)
    )
    if store.add("harness/started", 1) == world:
        store.set("harness/go", "1")
    store.wait(["harness/go"])
    dist.init_process_group(
        cfg.hardware.backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw
    )


def worker(
    rank: int,
    world: int,
    local_rank: int,
    cfg_dict: dict,
    cells: list[dict],
    report: Reporter,
    rendezvous: tuple[str, int] | None,
) -> None:
    """One rank: init the process group once, walk the cells, rank 0 writes."""
    cfg = OmegaConf.create(cfg_dict)
    if cfg.hardware.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    _init_group(cfg, rank, world, device, rendezvous)
    ctx = RunContext(rank, world, device, None, cfg.hardware.backend)
    if rendezvous is None:  # torchrun: rank 0 read the table; every rank runs its choice
        todo = [[c["cell_hash"] for c in cells] if rank == 0 else None]
        dist.broadcast_object_list(todo, src=0)
        cells = [c for c in cells if c["cell_hash"] in set(todo[0])]
    _walk(ctx, cfg, cells, report)
    report.done()
    dist.destroy_process_group()


def _stamp(rows: list[Row], cfg: Any, ctx: RunContext) -> list[Row]:
    """Every row says how it was run (the settings that are part of its cell hash)."""
    for r in rows:
        r.hardware, r.backend = cfg.hardware.name, ctx.backend
        r.warmup, r.iters, r.tol = cfg.measure.warmup, cfg.measure.iters, cfg.measure.tol
    return rows


def _walk(ctx: RunContext, cfg: Any, todo: list[dict], report: Reporter) -> None:
    exp = load_experiment(cfg)
    table = ResultsTable(table_path(cfg))
    for i, cell in enumerate(todo):
        report.cell(i)
        try:
            rows = exp.run_cell(ctx, cfg, cell)
        except Exception as exc:  # noqa: BLE001 - the sweep survives a failing cell
            if is_comm_failure(exc):
                raise
            rows = [
                Row(
                    experiment=cfg.experiment.name,
                    system=cell.get("system", ""),
                    cell_hash=cell["cell_hash"],
                    status="error",
                    reason=f"{type(exc).__name__}: {exc}"[:500],
                    **provenance(),
                )
            ]
        for r in rows:  # an experiment that caught a broken process group itself
            if r.status == "error" and looks_like_comm_failure(r.reason):
                raise CommFailure(r.reason)
        if ctx.rank == 0:
            table.append(_stamp(rows, cfg, ctx))
            report.written(i, rows)


def _spawn_entry(
    rank: int,
    world: int,
    cfg_dict: dict,
    cells: list[dict],
    rendezvous: tuple[str, int],
    conn: Connection,
) -> None:
    beat_s = min(0.5, float(cfg_dict["hardware"]["timeout_s"]) / 10)
    report = Reporter(rank, conn, beat_s)
    try:
        worker(rank, world, rank, cfg_dict, cells, report, rendezvous)
    except BaseException as exc:  # noqa: BLE001 - reported once to the parent, which decides
        try:
            report.failed(exc)
        finally:
            os._exit(1)  # no teardown: a broken process group can hang in its destructor


# ---------------------------------------------------------------------- the supervisor


@dataclass
class _Rank:
    proc: Any
    conn: Connection | None
    phase: str = "start"  # start | cell | done
    cell: int = -1
    since: float = 0.0
    beat: float = 0.0
    written: set[int] = field(default_factory=set)
    failure: tuple[str, bool, str] | None = None  # (message, comm, traceback)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _proc_state(pid: int) -> str:
    """The process's scheduler state from /proc (Linux), e.g. 'stopped'; '' where unknown."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return {
        "T": "stopped",
        "t": "stopped (traced)",
        "Z": "exited",
        "D": "in uninterruptible I/O",
    }.get(state, "")


def supervise(ranks: list[_Rank], todo: list[dict], cfg: Any, bar: Any) -> str | None:
    """Watch the ranks until all are done (None) or the run must stop (the reason, one line)."""
    timeout = float(cfg.hardware.timeout_s)
    now = time.monotonic()
    for r in ranks:
        r.since = r.beat = now
    stale = min(STALE_BEAT_S, timeout / 2)
    trouble_at: float | None = None
    while True:
        conns = [r.conn for r in ranks if r.conn is not None]
        if not conns:
            time.sleep(0.1)
        for conn in wait(conns, timeout=0.1):
            rank = next(r for r in ranks if r.conn is conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                rank.conn = None
                continue
            t = time.monotonic()
            rank.beat = t
            if msg[0] == "cell":
                rank.phase, rank.cell, rank.since = "cell", msg[1], t
            elif msg[0] == "written":
                rank.written.add(msg[1])
                if bar is not None:
                    bar.set_postfix_str(f"{msg[2][-1][0]}:{msg[2][-1][1]}")
                    bar.update(1)
            elif msg[0] == "done":
                rank.phase, rank.since = "done", t
            elif msg[0] == "failed":
                rank.failure = (msg[1], msg[2], msg[3])
        now = time.monotonic()
        if all(r.phase == "done" and r.proc.exitcode is not None for r in ranks):
            return None
        for r in ranks:
            exited = r.proc.exitcode is not None
            limit = STARTUP_S if r.phase == "start" else timeout
            if r.phase == "done":  # its rows are written; a hang in teardown is not a failure
                if not exited and now - r.since > timeout:
                    r.proc.kill()
            elif trouble_at is None and (
                r.failure or exited or now - r.since > limit or now - r.beat > limit
            ):
                trouble_at = now
        if trouble_at is not None:
            settled = all(r.proc.exitcode is not None or r.failure for r in ranks)
            if settled or now - trouble_at > GRACE_S:
                return _diagnose(ranks, todo, timeout, now, stale)


def _diagnose(
    ranks: list[_Rank], todo: list[dict], timeout: float, now: float, stale_s: float
) -> str:
    """The root cause, in order: a rank's own failure, a rank that died, a rank that stopped
    (no heartbeat), a broken collective, a cell over the time-out."""

    def where(r: _Rank) -> str:
        if r.phase == "cell":
            return f"in cell {describe(todo[r.cell])}"
        return "before its first cell" if r.phase == "start" else "after its last cell"

    for r in ranks:
        if r.failure and not r.failure[1]:
            full = f"\n{r.failure[2]}" if os.environ.get("HYDRA_FULL_ERROR") == "1" else ""
            return f"rank {ranks.index(r)} failed {where(r)}: {r.failure[0]}{full}"
    for i, r in enumerate(ranks):
        code = r.proc.exitcode
        if code is not None and code != 0 and not r.failure:
            how = f"killed by {_signal_name(code)}" if code < 0 else f"exit code {code}"
            return f"rank {i} died ({how}) {where(r)}"
        if code == 0 and r.phase != "done":
            return f"rank {i} exited early {where(r)}"
    stale = [
        (i, r) for i, r in enumerate(ranks) if r.proc.exitcode is None and now - r.beat > stale_s
    ]
    if stale:
        i, r = max(stale, key=lambda ir: now - ir[1].beat)
        state = _proc_state(r.proc.pid)
        return (
            f"rank {i} stopped responding (no heartbeat for {now - r.beat:.0f} s"
            f"{', process ' + state if state else ''}) {where(r)}"
        )
    for i, r in enumerate(ranks):
        if r.failure:
            return f"rank {i}: the process group broke {where(r)}: {r.failure[0]}"
    waiting = [r for r in ranks if r.phase != "done"] or ranks
    behind = min(waiting, key=lambda r: (r.phase == "cell", r.cell))
    late = [i for i, r in enumerate(ranks) if r.phase == behind.phase and r.cell == behind.cell]
    return (
        f"rank(s) {', '.join(map(str, late))} made no progress for {timeout:g} s "
        f"(hardware.timeout_s) {where(behind)}"
    )


def _kill(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.proc.exitcode is None:
            r.proc.kill()  # SIGKILL: also ends a stopped process
    for r in ranks:
        r.proc.join(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress_bar(cfg: Any, total: int):
    if not (cfg.progress and total):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=cfg.experiment.name, file=sys.stderr, unit="cell")


def run_ranks(cfg: Any, plan: Plan) -> tuple[str | None, set[int]]:
    """Spawn one process per rank and supervise them: the reason the run stopped (None when it
    did not) and the indexes of the cells whose rows rank 0 wrote."""
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    ctx = mp.get_context("spawn")
    rendezvous = ("127.0.0.1", _free_port())
    ranks = []
    for rank in range(plan.world):
        recv, send = ctx.Pipe(duplex=False)
        args = (rank, plan.world, cfg_dict, plan.todo, rendezvous, send)
        proc = ctx.Process(target=_spawn_entry, args=args, name=f"harness-rank{rank}")
        proc.start()
        send.close()
        ranks.append(_Rank(proc, recv))
    bar = _progress_bar(cfg, len(plan.todo))
    try:
        reason = supervise(ranks, plan.todo, cfg, bar)
    finally:
        if bar is not None:
            bar.close()
        _kill(ranks)
    return reason, ranks[0].written


# ------------------------------------------------------------------------------ the end


def summary(rows: list[dict], path: Path) -> list[str]:
    """At most about 20 lines: counts, up to SUMMARY_ROWS rows (errors and fails first), the
    first reasons, and where the table is."""
    if not rows:
        return [f"[harness] nothing new; table at {path}"]
    import pandas as pd

    df = pd.DataFrame(rows)
    order = {"error": 0, "fail": 1, "skipped": 2, "ok": 3}
    df = df.sort_values("status", key=lambda s: s.map(order), kind="stable")
    cols = [
        "system",
        "routing",
        "experts_per_rank",
        "world_size",
        "status",
        "latency_ms",
        "overlap_ratio",
        "max_rel_err",
    ]
    cols = [c for c in cols if c in df and df[c].notna().any()]
    out = df.head(SUMMARY_ROWS)[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}")
    lines = out.splitlines()
    if len(df) > SUMMARY_ROWS:
        lines.append(f"... {len(df) - SUMMARY_ROWS} more row(s) in the table")
    for _, r in df[df["status"].isin(["fail", "error"])].head(3).iterrows():
        lines.append(
            f"[harness] {r['status']}: {r['system']} {r['cell_hash']}: {r['reason']}"[:160]
        )
    counts = ", ".join(f"{n} {s}" for s, n in df["status"].value_counts().sort_index().items())
    lines.append(f"[harness] wrote {len(df)} row(s) ({counts}) to {path}")
    return lines


def finish(cfg: Any, plan: Plan, stopped: str | None, written: set[int]) -> int:
    """Print what this run wrote and why it stopped; the exit code."""
    hashes = {plan.todo[i]["cell_hash"] for i in written}
    try:
        df = plan.table.load()
    except HarnessUserError:  # damaged during the run: the reason it stopped says so
        if stopped is None:
            raise
        rows: list[dict] = []
    else:
        rows = df[df["cell_hash"].isin(hashes)].to_dict("records")
        for line in summary(rows, plan.table.path):
            print(line, flush=True)
    if stopped is not None:
        print(
            f"error: {stopped}; run stopped after {len(written)} of {len(plan.todo)} cell(s) "
            f"(the cell in flight is not recorded); run the same command again to resume",
            file=sys.stderr,
            flush=True,
        )
        return 1
    errors = [r for r in rows if r["status"] == "error"]
    if errors:
        print(
            f"error: {len(errors)} cell(s) of {cfg.experiment.name} ended in `error` (first: "
            f"{errors[0]['system']} {errors[0]['cell_hash']}: {errors[0]['reason']})"[:300]
            + f"; all rows are in {plan.table.path}; a re-run measures those cells again",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


def launch(cfg: DictConfig, workload: str | None = None) -> int:
    """Validate, spawn, supervise; the exit code (bad input raises HarnessUserError)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun / Slurm
        return _launch_torchrun(cfg, workload)
    if cfg.dry_run:
        dry_run(cfg, workload)
        return 0
    plan = preflight(cfg, resolve_world(cfg), workload)
    print(start_message(cfg, plan), flush=True)
    if not plan.todo:
        return finish(cfg, plan, None, set())
    stopped, written = run_ranks(cfg, plan)
    return finish(cfg, plan, stopped, written)


def _launch_torchrun(cfg: DictConfig, workload: str | None) -> int:
    """Every rank validates the config (so all fail alike); rank 0 reads the table, walks with
    the others, then prints the summary."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    plan = preflight(cfg, world, workload, table=rank == 0)
    if rank == 0:
        print(start_message(cfg, plan), flush=True)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    bar = _progress_bar(cfg, len(plan.todo)) if rank == 0 else None
    report = Reporter(rank, None, 0.0, bar)
    local = int(os.environ.get("LOCAL_RANK", 0))
    try:
        worker(rank, world, local, cfg_dict, plan.todo if rank == 0 else plan.cells, report, None)
    except BaseException as exc:
        why = "the process group broke" if is_comm_failure(exc) else "failed"
        print(f"error: rank {rank} {why}: {exc}".splitlines()[0][:400], file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    return finish(cfg, plan, None, report.written_cells) if rank == 0 else 0


_TASK_STARTED = False


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _TASK_STARTED
    _TASK_STARTED = True
    workload = HydraConfig.get().runtime.choices.get("workload")
    try:
        code = launch(cfg, workload if workload not in (None, "null") else None)
    except HarnessUserError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(code)


def _main() -> None:
    """Hydra's own composition errors (an unknown key, a missing group) exit 1 before our task
    starts; they are bad input too, so they exit 2."""
    try:
        main()
    except SystemExit as exc:
        if exc.code == 1 and not _TASK_STARTED:
            sys.exit(2)
        raise


if __name__ == "__main__":
    _main()
