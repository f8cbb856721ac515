"""Result rows and the parquet table they go to (append per cell, resume by cell hash)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import pandas as pd

STATUSES = ("ok", "fail", "skipped", "error")


@dataclass
class Row:
    """One measured (or not measured) cell. Core columns are fixed; `extra` is a JSON string.

    `params` (the system's own knobs, e.g. ccta) are written as columns p_<key>, `metrics`
    (experiment-specific numbers) as m_<key>.
    """

    experiment: str
    system: str
    impl: str = ""
    scope: str = ""  # timed region: "gemm+combine" (operator level) or "layer"
    cell_hash: str = ""
    world_size: int = 1
    transport: str = ""
    tokens_per_rank: int = 0
    hidden: int = 0
    out: int = 0
    experts_per_rank: int = 0
    top_k: int = 0
    routing: str = ""
    imbalance_rank: float = float("nan")
    imbalance_expert: float = float("nan")
    dtype: str = ""
    latency_ms: float = float("nan")
    latency_p10_ms: float = float("nan")
    latency_p90_ms: float = float("nan")
    compute_ms: float = float("nan")
    comm_ms: float = float("nan")
    overlap_ratio: float = float("nan")
    max_rel_err: float = float("nan")
    status: str = "ok"
    reason: str = ""
    extra: str = "{}"
    #: the system's parameters as it ran (cell params + what it resolved); columns p_<key>
    params: dict = field(default_factory=dict)
    #: experiment-specific numeric results; written as extra columns named m_<key>
    metrics: dict = field(default_factory=dict)
    # provenance
    git_rev: str = ""
    gpu_name: str = ""
    gpu_count: int = 0
    torch_version: str = ""
    triton_version: str = ""
    nccl_version: str = ""
    command: str = ""
    timestamp: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} not in {STATUSES}")


CORE_COLUMNS = [f.name for f in fields(Row) if f.name not in ("params", "metrics")]


def param_value(v: Any) -> Any:
    """A parameter as a parquet cell: scalars as they are, lists and mappings as JSON text."""
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v, sort_keys=True, default=str)
    return v


def row_dict(row: Row) -> dict:
    """A Row as a flat dict: core columns, p_<key> per parameter, m_<key> per metric."""
    d = asdict(row)
    params, metrics = d.pop("params"), d.pop("metrics")
    d.update({f"p_{k}": param_value(v) for k, v in sorted(params.items())})
    d.update({f"m_{k}": v for k, v in sorted(metrics.items())})
    return d


def cell_hash(cell: dict) -> str:
    """Stable hash of a cell's defining values: the workload, the system and all its params
    (nested dicts included), never provenance."""
    blob = json.dumps(cell, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def overlap_ratio(compute_ms: float, comm_ms: float, overlapped_ms: float) -> float:
    """Share of the standalone combine hidden: (Tc + Tm - To) / Tm clipped to [0, 1]."""
    if not (comm_ms > 0):
        return float("nan")
    r = (compute_ms + comm_ms - overlapped_ms) / comm_ms
    return min(1.0, max(0.0, r))


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], capture_output=True, text=True, check=False
    ).stdout.strip()


@lru_cache(maxsize=1)
def provenance() -> dict:
    """Git revision, GPU and library versions of this process (cached)."""
    import torch

    rev = os.environ.get("HARNESS_GIT_REV", "")  # set where the tree travels without .git
    if not rev:
        try:
            rev = _git("rev-parse", "--short", "HEAD")
            if rev and _git("status", "--porcelain", "--untracked-files=no"):
                rev += "-dirty"
        except OSError:
            rev = ""
    rev = rev or "unknown"
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = ""
    nccl = ""
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - provenance must never break a run
            nccl = ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor()
    return {
        "git_rev": rev,
        "gpu_name": gpu or "cpu",
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch_version": torch.__version__,
        "triton_version": triton_v,
        "nccl_version": nccl,
    }


def command_line() -> str:
    return " ".join([Path(sys.executable).name, "-m", "harness.run", *sys.argv[1:]])


@dataclass
class ResultsTable:
    """A parquet table of Rows. Writes are atomic (tmp file + rename), one cell at a time."""

    path: Path
    _rows: list[dict] = field(default_factory=list, repr=False)

    def load(self) -> pd.DataFrame:
        if self.path.exists():
            return pd.read_parquet(self.path)
        return pd.DataFrame(columns=CORE_COLUMNS)

    def done_hashes(self, redo_failed: bool = False) -> set[str]:
        df = self.load()
        if df.empty:
            return set()
        if redo_failed:
            df = df[df["status"].isin(["ok", "skipped"])]
        return set(df["cell_hash"])

    def append(self, rows: list[Row]) -> None:
        """Append rows; a row replaces any earlier row with the same (cell_hash, system)."""
        if not rows:
            return
        new = pd.DataFrame([row_dict(r) for r in rows])
        old = self.load()
        if not old.empty:
            keys = set(zip(new["cell_hash"], new["system"]))
            keep = [(h, s) not in keys for h, s in zip(old["cell_hash"], old["system"])]
            new = pd.concat([old[keep], new], ignore_index=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".parquet.tmp")
        new.to_parquet(tmp, index=False)
        os.replace(tmp, self.path)
