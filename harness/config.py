"""Typed Hydra schemas behind conf/*.yaml: a typo in an override is an error, not a default."""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class HardwareConf:
    name: str = "cpu"
    device: str = "cpu"  # cpu | cuda
    backend: str = "gloo"  # gloo | nccl
    world_size: int = 4  # processes to spawn on this node (ignored under torchrun)
    #: bound (s) on every cell and every collective: a rank that makes no progress for this long
    #: ends the run (long enough for a first Triton compile on a GPU)
    timeout_s: float = 60.0
    #: after a rank dies or stalls in a cell, record that cell as `error` and start fresh ranks
    #: for the rest, at most this many times per run (0: the run stops, the cell unrecorded)
    restarts: int = 0


@dataclass
class MeasureConf:
    warmup: int = 2
    iters: int = 5
    tol: float = 8e-3
    #: > 1: the systems of one workload are timed in this many interleaved rounds of
    #: iters / rounds iterations each (harness.measure.measure_workload)
    rounds: int = 1
    #: GPU: enqueue every timed iteration behind a sleep kernel, so the events measure device
    #: time back to back, not the host's launch time (harness/timing.py)
    queue_ahead: bool = False
    #: GPU: time a CUDA graph of the step (harness/graphs.py): auto = every system whose step
    #: declares itself capturable, true = every system, false = none
    graph: str = "auto"


@dataclass
class GridConf:
    """The WORKLOAD axes: each combination is a workload, run by each system per `sweep` point."""

    tokens_per_rank: list[int] = field(default_factory=lambda: [64])
    hidden: list[int] = field(default_factory=lambda: [64])
    out: list[int] = field(default_factory=lambda: [64])
    experts_per_rank: list[int] = field(default_factory=lambda: [2])
    top_k: list[int] = field(default_factory=lambda: [2])
    routing: list[str] = field(default_factory=lambda: ["balanced"])
    dtype: list[str] = field(default_factory=lambda: ["float32"])
    #: expert width F of FFN experts (a whole layer, scope `layer`); 0 = the single-GEMM
    #: operator (scope gemm+combine). FFN cells take out = hidden.
    ffn: list[int] = field(default_factory=lambda: [0])
    #: true: a layer cell timed as one training step, forward + backward (scope train)
    train: list[bool] = field(default_factory=lambda: [False])
    #: logical ranks of the layer; empty = the number of processes
    world_size: list[int] = field(default_factory=list)


@dataclass
class ExperimentConf:
    name: str = MISSING
    module: str = "experiments.systems_sweep"
    #: the grid's shape comes from the `workload` group (conf/workload/); false: the experiment
    #: sets its own shape, and `workload=<name>` is an error
    takes_workload: bool = False
    #: system name -> {params: {...}, sweep: {lists whose product it runs per workload}}; `{}`
    #: runs it once with its defaults (untyped so `+experiment.systems.<name>={}` composes)
    systems: dict[str, Any] = field(default_factory=dict)
    #: run only these systems of `systems` (empty = all of them)
    select: list[str] = field(default_factory=list)
    grid: GridConf = field(default_factory=GridConf)
    #: an experiment module's settings that are not workload axes (each module checks its keys)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Config:
    experiment: ExperimentConf = field(default_factory=ExperimentConf)
    hardware: HardwareConf = field(default_factory=HardwareConf)
    measure: MeasureConf = field(default_factory=MeasureConf)
    seed: int = 0
    results_dir: str = "results"
    #: table path; empty = <results_dir>/<experiment.name>.parquet
    table: str = ""
    redo_failed: bool = False
    dry_run: bool = False
    progress: bool = True


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="hardware", name="base_hardware", node=HardwareConf)
    cs.store(group="experiment", name="base_experiment", node=ExperimentConf)


def typed_nodes(schema: Any = Config, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, schema) of every typed config node (fixed keys, but Hydra's `+` adds one)."""
    yield path, schema
    for name, kind in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(kind):
            yield from typed_nodes(kind, f"{path}.{name}".lstrip("."))


def nearest_key(key: str) -> str | None:
    """The schema's key nearest a misspelt dotted `key` (difflib on each part below a typed
    node); None when no part is near a key or `key` is in the schema already."""
    node: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            break
        names = [f.name for f in dataclasses.fields(node)]
        if part not in names:
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            if not close:
                return None
            parts[i] = close[0]
        node = typing.get_type_hints(node).get(parts[i])
    fixed = ".".join(parts)
    return fixed if fixed != key else None


def bad_experiment_name(name: Any) -> str | None:
    """Why `name` cannot name an experiment (<name>.parquet needs a plain file name), or None."""
    text = "" if name is None else str(name)
    if not text.strip():
        return "experiment.name is empty; give the experiment a name (its table's file name)"
    seps = {"/", "\\", "\0", *filter(None, (os.sep, os.altsep))}
    if text in (".", "..") or any(c in text for c in seps) or os.path.isabs(text):
        return (
            f"experiment.name={text!r} is not a plain file name (no path separators, no . or "
            "..): its table must stay inside the results folder; to write elsewhere, set "
            "table=<path>"
        )
    return None


def free_form(key: str) -> bool:
    """Whether dotted `key` is below a node the schema leaves open (`+key=value` adds keys)."""
    node: Any = Config
    parts = key.lstrip("+").split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return i > 0
        names = [f.name for f in dataclasses.fields(node)]
        if part not in names:
            return False
        node = typing.get_type_hints(node).get(part)
    return False
