"""Entry point: `python -m harness.run experiment=<name> [overrides]`.

harness/preflight.py validates everything and picks the cells to run (not in the table yet, or
ended in `error`) before any process starts. On one node the parent spawns W ranks
(harness/rank.py) and supervises them (harness/supervisor.py): a rank that dies, fails or stalls
for `hardware.timeout_s` ends the run naming the rank and the cell (hardware.restarts: records
the cell as `error`, fresh ranks run the rest). Rank 0 writes each cell's rows once every rank
finished it. Under torchrun (RANK / WORLD_SIZE set) the ranks run without the supervisor.

Exit codes: 0 done; 1 the run stopped or a cell ended in `error`; 2 bad input; 143 / 130 stopped
by SIGTERM / SIGINT.
"""

from __future__ import annotations

import builtins
import io
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from harness.config import free_form, nearest_key, register_configs
from harness.slurm import export_torch_env

if TYPE_CHECKING:
    from harness.preflight import Plan

# torch is imported once the task starts (inside the functions): a command line Hydra cannot
# compose is answered without the 2-3 s import of torch
register_configs()

SUMMARY_ROWS = 15


def run_ranks(cfg: Any, plan: Plan) -> tuple[str | None, set[int], int | None]:
    """Spawn and supervise the ranks (harness.supervisor.run_ranks)."""
    from harness.supervisor import run_ranks as run

    return run(cfg, plan)


def summary(rows: list[dict], path: Path) -> list[str]:
    """At most ~20 lines: SUMMARY_ROWS rows (errors, fails first), reasons, counts, the table."""
    if not rows:
        return [f"[harness] nothing new; table at {path}"]
    import pandas as pd

    df = pd.DataFrame(rows)
    order = {"error": 0, "fail": 1, "skipped": 2, "ok": 3}
    df = df.sort_values("status", key=lambda s: s.map(order), kind="stable")
    cols = ["system", "routing", "experts_per_rank", "world_size", "status", "latency_ms"]
    cols = [c for c in [*cols, "overlap_ratio", "max_rel_err"] if c in df and df[c].notna().any()]
    out = df.head(SUMMARY_ROWS)[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}")
    lines = out.splitlines()
    if len(df) > SUMMARY_ROWS:
        lines.append(f"... {len(df) - SUMMARY_ROWS} more row(s) in the table")
    reasons = [
        f"[harness] {r['status']}: {r['system']} {r['cell_hash']}: {r['reason']}"[:160]
        for _, r in df[df["status"].isin(["fail", "error"])].iterrows()
    ]
    # skipped cells of one system mostly share a reason: one line per (system, reason)
    skipped = df[df["status"] == "skipped"].groupby(["system", "reason"], dropna=False).size()
    reasons += [
        f"[harness] skipped: {s} ({n} cell{'s' * (n > 1)}): {why}"[:200]
        for (s, why), n in skipped.items()
    ]
    most = 4  # reason lines
    lines += reasons[:most]
    if len(reasons) > most:
        more = len(reasons) - most
        lines.append(f"[harness] ... {more} more reason(s) in the table's `reason` column")
    counts = ", ".join(f"{n} {s}" for s, n in df["status"].value_counts().sort_index().items())
    lines.append(f"[harness] wrote {len(df)} row(s) ({counts}) to {path}")
    return lines


def finish(cfg: Any, plan: Plan, stopped: str | None, hashes: set[str]) -> int:
    """Print what this run wrote (the cells of `hashes`) and why it stopped; the exit code.
    `plan`: the run's first plan (every cell it set out to run)."""
    from harness.errors import HarnessUserError

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
            f"error: {stopped}; run stopped after {len(hashes)} of {len(plan.todo)} cell(s) "
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
    from harness.preflight import Plan, dry_run, preflight, resolve_world, start_message

    export_torch_env()  # one task of a Slurm / submitit job of several: ranks from the job
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun / Slurm
        return _launch_torchrun(cfg, workload)
    if cfg.dry_run:
        dry_run(cfg, workload)
        return 0
    world = resolve_world(cfg)
    plan = preflight(cfg, world, workload)
    print(start_message(cfg, plan), flush=True)
    if not plan.todo:
        return finish(cfg, plan, None, set())
    first, since = plan, time.time()
    written: set[str] = set()  # hashes of the cells whose rows this run wrote
    try:
        for restart in range(cfg.hardware.restarts + 1):
            stopped, done, cell = run_ranks(cfg, plan)
            written |= {plan.todo[i]["cell_hash"] for i in done}
            if stopped is None or restart == cfg.hardware.restarts:
                break
            if cell is not None:
                record_crash(cfg, plan.todo[cell], stopped)
                written.add(plan.todo[cell]["cell_hash"])
            rest = [c for c in plan.todo if c["cell_hash"] not in written]
            print(
                f"[harness] {stopped}; fresh ranks run the remaining {len(rest)} of "
                f"{len(first.todo)} cell(s)",
                flush=True,
            )
            if not rest:
                stopped = None
                break
            plan = Plan(plan.cells, rest, plan.found, plan.others, plan.table, plan.world)
        return finish(cfg, first, stopped, written)
    except Interrupted as exc:
        print(f"error: {interrupted_line(exc.signum, first, written, since)}", file=sys.stderr)
        return 128 + exc.signum


def interrupted_line(signum: int, plan: Plan, written: set[str], since: float) -> str:
    """The line of a run stopped by a signal: the rows it wrote (its cells' rows from `since`
    on, and those of `written`), where, and that a re-run resumes."""
    from harness.errors import HarnessUserError

    name = signal.Signals(signum).name
    todo = {c["cell_hash"] for c in plan.todo}
    try:
        df = plan.table.load()
    except HarnessUserError as exc:
        return f"stopped by {name}; {exc}"
    stamp = df["timestamp"] if "timestamp" in df else df["cell_hash"].map(lambda _: 0.0)
    new = df["cell_hash"].isin(todo) & (df["cell_hash"].isin(written) | (stamp >= since))
    cells = df.loc[new, "cell_hash"].nunique()
    return (
        f"stopped by {name}: this run wrote {int(new.sum())} row(s) ({cells} of {len(todo)} "
        f"cell(s)) to {plan.table.path}; the cell in flight is not recorded; run the same "
        "command again to resume"
    )


def record_crash(cfg: Any, cell: dict, reason: str) -> None:
    """An `error` row for a cell in which a rank died or stalled (a re-run measures it again)."""
    from dataclasses import fields

    from harness.preflight import table_path
    from harness.records import ResultsTable, Row, provenance

    names = {f.name for f in fields(Row)} - {"experiment", "status", "reason"}
    row = Row(
        experiment=cfg.experiment.name,
        status="error",
        reason=f"crashed: {reason}"[:500],
        **{k: v for k, v in cell.items() if k in names},
        **provenance(),
    )
    row.hardware, row.backend = cfg.hardware.name, cfg.hardware.backend
    row.warmup, row.iters, row.tol = cfg.measure.warmup, cfg.measure.iters, cfg.measure.tol
    ResultsTable(table_path(cfg)).append([row])


def _launch_torchrun(cfg: DictConfig, workload: str | None) -> int:
    """Ranks all validate (fail alike); rank 0 reads the table, walks with the others, sums up."""
    from harness.errors import is_comm_failure
    from harness.preflight import preflight, start_message
    from harness.rank import Reporter, worker
    from harness.supervisor import progress_bar

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    plan = preflight(cfg, world, workload, table=rank == 0)
    if rank == 0:
        print(start_message(cfg, plan), flush=True)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    bar = progress_bar(cfg, len(plan.todo)) if rank == 0 else None
    report = Reporter(None, 0.0, bar)
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
    hashes = {plan.todo[i]["cell_hash"] for i in report.written_cells}
    return finish(cfg, plan, None, hashes) if rank == 0 else 0


_TASK_STARTED = False


class Interrupted(BaseException):
    """The parent's SIGTERM or SIGINT: unwinds the run (ranks killed) to a line of what it wrote."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    """A signal that ends the run: unwind once (a second signal does not break the unwinding)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _TASK_STARTED
    _TASK_STARTED = True
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    from harness.errors import HarnessUserError

    hc = HydraConfig.get()
    workload = hc.runtime.choices.get("workload")
    try:
        check_overrides(list(hc.overrides.task))
        code = launch(cfg, workload if workload not in (None, "null") else None)
    except HarnessUserError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or hc.mode == RunMode.MULTIRUN:
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Interrupted as exc:  # before any rank started (launch says more after)
        print(f"error: stopped by {exc}; nothing was written", file=sys.stderr, flush=True)
        sys.exit(128 + exc.signum)
    if hc.mode == RunMode.MULTIRUN:  # a launcher's job (e.g. submitit) reports by exception
        if code:
            raise RuntimeError(f"harness run ended with exit code {code}")
        return
    sys.exit(code)


class _HeldStderr(io.TextIOBase):
    """stderr holding Hydra's composition errors until the task starts (_main: them in one line)."""

    def __init__(self, real: Any) -> None:
        self.real, self.held = real, []

    def write(self, text: str) -> int:
        if _TASK_STARTED:
            self.release()
            return self.real.write(text)
        self.held.append(text)
        return len(text)

    def release(self) -> None:
        if self.held:
            self.real.write("".join(self.held))
            self.held = []

    def flush(self) -> None:
        if _TASK_STARTED:
            self.release()
        self.real.flush()


def check_overrides(overrides: list[str]) -> None:
    """Overrides Hydra takes that do not do what they say: `experiment.systems={}` is merged
    into the experiment's own, leaving every system instead of emptying the set."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from harness.errors import HarnessUserError

    for o in OverridesParser.create().parse_overrides(overrides):
        if o.key_or_group == "experiment.systems" and not o.is_delete() and o.value() == {}:
            raise HarnessUserError(
                f"{o.input_line} would run no system (an empty system set); name the systems "
                "to run with experiment.select=[<name>, ...] or add one with "
                "'+experiment.systems.<name>={}'"
            )


#: Hydra's hints, dropped from its messages (the one line says what to do instead)
HYDRA_HINTS = ("To append to your config", "Set the environment variable", "Available options")


def hydra_error_line(text: str) -> str:
    """One line of Hydra's error: its statements, a missing group's choices, the key nearest a
    misspelt one (hints, search path, indented details dropped); of a trace, _trace_line."""
    lines = [x.rstrip() for x in text.splitlines() if x.strip()]
    if any(x.startswith("Traceback") for x in lines):
        return _trace_line([x for x in lines if not x.startswith(HYDRA_HINTS)])
    choices = [
        x.strip()
        for x in lines
        if x.startswith("\t") and "provider=" not in x and not x.strip().startswith("base_")
    ]
    keep = [
        x.strip().rstrip(".")
        for x in lines
        if not x[0].isspace() and not x.startswith((*HYDRA_HINTS, "Config search path:"))
    ]
    out = "; ".join(keep) or "the configuration did not compose"
    typo = re.search(r"Could not override '([^']+)'", text)
    near = nearest_key(typo.group(1)) if typo else None
    plus = re.search(r"To append to your config use (\+\S+)", text)
    if near:
        out += f"; did you mean {near}?"
    elif typo and plus and free_form(typo.group(1)):  # a system's params, an option
        out += f"; to add a key the experiment does not set, write {plus.group(1)}"
    return out + (f"; choices: {', '.join(choices)}" if choices else "")


def _trace_line(lines: list[str]) -> str:
    """A trace's exception line (its last unindented line); for an OSError (Hydra's run folder
    cannot be made or written), what Hydra was doing and the way out."""
    line = next((x.strip() for x in reversed(lines) if not x[0].isspace()), "")
    name = line.split(":", 1)[0]
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, OSError):
        line += (
            "; Hydra could not create or write its run folder (hydra.run.dir, with -m "
            "hydra.sweep.dir; results/hydra/ by default): make it writable or choose another "
            "with hydra.run.dir=<folder>"
        )
    return line or "Hydra failed before the run started"


def _main() -> None:
    """Hydra's composition errors (an unknown key, a missing group) exit 1 before the task starts;
    as bad input they become one line `error: ...`, exit 2."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        held = None
    else:
        held = sys.stderr = _HeldStderr(sys.stderr)
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before the task started (main handles it after)
        if held is not None:
            sys.stderr = held.real
            held.held = []
        print(
            "error: stopped by SIGINT before the run started; nothing was written", file=sys.stderr
        )
        sys.exit(128 + signal.SIGINT)
    except SystemExit as exc:
        if exc.code == 1 and not _TASK_STARTED:
            if held is not None:
                sys.stderr = held.real
                print(f"error: {hydra_error_line(''.join(held.held))}", file=sys.stderr)
                held.held = []
            sys.exit(2)
        raise
    finally:
        if held is not None:
            sys.stderr = held.real
            held.release()


if __name__ == "__main__":
    _main()
