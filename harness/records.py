"""Result rows and the parquet table they go to (append per cell, resume by cell hash).

Writers serialise on `<table>.lock`: each append reads the table, adds its rows and replaces
the file atomically through a uniquely named temporary file, so two runs on one table lose no
row and a reader never sees half a file. A table the harness cannot read is never overwritten; a
table path that is a symbolic link acts on its target. Every table carries a SHA-256 of its
columns (CHECKSUM_KEY) and CRC32s of its data pages: a bit flip is a damaged table, never a quiet
change of a number.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock, Timeout

from harness.errors import HarnessUserError

STATUSES = ("ok", "fail", "skipped", "error")
#: this run's id, shared by the rank processes it spawns (they inherit the variable)
RUN_ID = os.environ.setdefault(
    "HARNESS_RUN_ID", time.strftime("%Y%m%dT%H%M%SZ-", time.gmtime()) + str(os.getpid())
)


@dataclass
class Row:
    """One measured (or not measured) cell. Core columns are fixed; `extra` is a JSON string;
    `params` (the system's own knobs) are written as columns p_<key>, `metrics` as m_<key>."""

    experiment: str
    system: str
    impl: str = ""
    scope: str = ""  # timed region: "gemm+combine" (operator level), "layer" or "train"
    cell_hash: str = ""
    world_size: int = 1
    transport: str = ""
    tokens_per_rank: int = 0
    hidden: int = 0
    out: int = 0
    #: expert width F of FFN experts (scope layer); 0 = the single-GEMM operator
    ffn: int = 0
    experts_per_rank: int = 0
    top_k: int = 0
    routing: str = ""
    imbalance_rank: float = float("nan")
    imbalance_expert: float = float("nan")
    dtype: str = ""
    latency_ms: float = float("nan")
    latency_p10_ms: float = float("nan")
    latency_p90_ms: float = float("nan")
    #: 95% bootstrap interval of the median latency (harness/timing.py)
    latency_ci_lo_ms: float = float("nan")
    latency_ci_hi_ms: float = float("nan")
    compute_ms: float = float("nan")
    comm_ms: float = float("nan")
    #: the method's own kernels one after the other (Step.serialized), timed as the step is
    serialized_ms: float = float("nan")
    overlap_ratio: float = float("nan")
    max_rel_err: float = float("nan")
    #: worst token row's relative error (harness/check.py: must stay <= 10 x tol)
    max_row_rel_err: float = float("nan")
    status: str = "ok"
    reason: str = ""
    #: what a reader of the row must know that no other column says; "" for a row measured now
    caveat: str = ""
    #: timed as a CUDA graph's replays (harness/graphs.py); where not, graph_reason says why
    graph: bool = False
    graph_reason: str = ""
    extra: str = "{}"
    # how the cell was run (stamped by the runner; part of the cell hash)
    hardware: str = ""  # the hardware preset
    backend: str = ""
    warmup: int = 0
    iters: int = 0
    tol: float = float("nan")
    #: the system's parameters as it ran (cell params + what it resolved); columns p_<key>
    params: dict = field(default_factory=dict)
    #: experiment-specific numeric results; written as extra columns named m_<key>
    metrics: dict = field(default_factory=dict)
    # provenance
    git_rev: str = ""
    gpu_name: str = ""
    gpu_count: int = 0
    #: the host as results/reference/ names its folders (machine_name: h200, h100x8, cpu)
    machine: str = ""
    torch_version: str = ""
    triton_version: str = ""
    nccl_version: str = ""
    command: str = ""
    timestamp: float = 0.0
    #: the `harness.run` invocation that measured the row (RUN_ID)
    run_id: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} not in {STATUSES}")


CORE_COLUMNS = [f.name for f in fields(Row) if f.name not in ("params", "metrics")]


def param_value(v: Any) -> Any:
    """A parameter as a parquet cell: scalars as they are, lists and mappings as JSON text."""
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v, sort_keys=True, default=str)
    return v


def _as_text(v: Any) -> Any:
    if v is None or (isinstance(v, float) and v != v):
        return None
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def mixed_params_as_text(df: pd.DataFrame) -> pd.DataFrame:
    """Text and numbers mixed in a p_<key> column (16, "auto"): all as text (parquet: one type)."""
    for c in df.columns:
        if not c.startswith("p_") or not pd.api.types.is_object_dtype(df[c]):
            continue
        kinds = {isinstance(v, str) for v in df[c].dropna()}
        if kinds == {True, False}:
            df[c] = df[c].map(_as_text).astype(object)
    return df


def row_dict(row: Row) -> dict:
    """A Row as a flat dict: core columns, p_<key> per parameter, m_<key> per metric."""
    d = asdict(row)
    params, metrics = d.pop("params"), d.pop("metrics")
    d.update({f"p_{k}": param_value(v) for k, v in sorted(params.items())})
    d.update({f"m_{k}": v for k, v in sorted(metrics.items())})
    return d


def cell_hash(cell: dict) -> str:
    """Stable hash of a cell's defining values (nested dicts included), never provenance."""
    blob = json.dumps(cell, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def overlap_ratio(compute_ms: float, comm_ms: float, overlapped_ms: float) -> float:
    """Share of the standalone combine hidden: (Tc + Tm - To) / Tm, unclipped (noise shows)."""
    return (compute_ms + comm_ms - overlapped_ms) / comm_ms if comm_ms > 0 else float("nan")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], capture_output=True, text=True, check=False
    ).stdout.strip()


def gpu_model(gpu_name: str) -> str:
    """A GPU's short model tag, lowercase: the first word of its name that holds a digit
    ("NVIDIA H100 80GB HBM3" -> h100, "NVIDIA GH200 480GB" -> gh200); "gpu" for none."""
    words = re.sub(r"[^0-9A-Za-z]+", " ", gpu_name).split()
    return next((w.lower() for w in words if any(c.isdigit() for c in w)), "gpu")


def machine_name(gpu_name: str, gpu_count: int) -> str:
    """The machine as results/reference/ names its folders: "cpu" without a GPU, the GPU's
    model for one ("h200"), model x count for several ("h200x2", "h100x8")."""
    if gpu_count < 1:
        return "cpu"
    model = gpu_model(gpu_name)
    return model if gpu_count == 1 else f"{model}x{gpu_count}"


@lru_cache(maxsize=1)
def this_machine() -> str:
    """This host's machine_name (once per process); "cpu" where torch sees no CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return machine_name(torch.cuda.get_device_name(0), torch.cuda.device_count())


@lru_cache(maxsize=1)
def provenance() -> dict:
    """Git revision, GPU, machine and library versions of this process (cached)."""
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
        "machine": this_machine(),
        "torch_version": torch.__version__,
        "triton_version": triton_v,
        "nccl_version": nccl,
        "run_id": RUN_ID,
    }


def cell_row(cell: dict, row_type: type[Row] = Row, **fields: Any) -> Row:
    """A row of `cell` (experiment, system, hash, W, params), command, time, provenance, fields."""
    return row_type(
        **{"world_size": cell.get("world_size", 1), **fields},
        experiment=cell["experiment"],
        system=cell["system"],
        cell_hash=cell["cell_hash"],
        params=dict(cell["params"]),
        command=" ".join([Path(sys.executable).name, "-m", "harness.run", *sys.argv[1:]]),
        timestamp=time.time(),
        **provenance(),
    )


#: columns a table needs for the runner to resume from it
KEY_COLUMNS = ("experiment", "system", "cell_hash", "status")
#: a plain re-run keeps these rows (and measures `error` cells again); redo_failed keeps fewer
KEEP_STATUSES = ("ok", "fail", "skipped")
KEEP_STATUSES_REDO_FAILED = ("ok", "skipped")
LOCK_TIMEOUT_S = 300.0


def _fix_hint(path: Path) -> str:
    return f"move it away or choose another table with table=<path> (it is left as it is: {path})"


#: the parquet key-value metadata entry that holds a table's checksum (table_checksum)
CHECKSUM_KEY = b"harness.sha256"


def table_checksum(table: pa.Table) -> str:
    """SHA-256 of what a reader gets: the pandas metadata and every column's name and values (not
    their encoding, chunks or statistics), so it survives a parquet round trip."""
    h = hashlib.sha256((table.schema.metadata or {}).get(b"pandas", b""))
    for name, column in zip(table.column_names, table.columns):
        h.update(json.dumps([name, column.to_pylist()], default=repr).encode())
    return h.hexdigest()


def read_table(path: str | Path, shown: str | Path | None = None) -> pd.DataFrame:
    """The table at `path` (empty with the core columns if there is none); one that cannot be
    read, fails its checksums or lacks the key columns is a one-line HarnessUserError naming it
    as `shown` (default: `path`). A table without CHECKSUM_KEY (another tool's) is read as is."""
    path = Path(path)
    name = Path(shown) if shown is not None else path
    if path.is_dir():
        raise HarnessUserError(f"table {name} is a directory; choose a file with table=<path>")
    if not path.exists():
        return pd.DataFrame(columns=CORE_COLUMNS)
    try:
        # One read of the bytes: pyarrow by path stats the size and opens the file apart, so a
        # writer's atomic replace in between hands it one file's size and another's bytes.
        data = pa.BufferReader(path.read_bytes())
        table = pq.read_table(data, page_checksum_verification=True)
        stored = (table.schema.metadata or {}).get(CHECKSUM_KEY)
        if stored is not None and stored.decode(errors="replace") != table_checksum(table):
            raise HarnessUserError(
                f"table {name} is damaged: its values do not match the checksum stored in it "
                f"(a changed bit); {_fix_hint(name)}"
            )
        df = table.to_pandas()
    except HarnessUserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader error means "damaged"
        why = (str(exc).strip().splitlines() or [""])[0][:200]
        raise HarnessUserError(
            f"table {name} cannot be read ({type(exc).__name__}: {why}); {_fix_hint(name)}"
        ) from exc
    missing = [c for c in KEY_COLUMNS if c not in df.columns]
    if missing:
        raise HarnessUserError(
            f"table {name} has no column(s) {', '.join(missing)}, so it is not a results table "
            f"of this harness; {_fix_hint(name)}"
        )
    return df


def write_table(df: pd.DataFrame, path: str | Path) -> None:
    """Write df as a table at `path` (no index) with its checksum and the data pages' CRC32."""
    table = pa.Table.from_pandas(df, preserve_index=False)
    meta = {**(table.schema.metadata or {}), CHECKSUM_KEY: table_checksum(table).encode()}
    pq.write_table(table.replace_schema_metadata(meta), path, write_page_checksum=True)


def resolve_table_path(path: str | Path) -> Path:
    """The file a table path names, symbolic links followed (also of its folders); a dangling
    link or a link loop on the way is a HarnessUserError."""
    path = Path(path)
    for p in (path, *path.parents):
        if not p.is_symlink():
            continue
        what = f"table {path}" if p == path else f"table {path}: its folder {p}"
        fix = "fix the link or choose another table with table=<path>"
        try:
            p.resolve(strict=True)
        except (RuntimeError, OSError) as exc:  # a loop: RuntimeError before Python 3.13
            if isinstance(exc, RuntimeError) or exc.errno == errno.ELOOP:
                raise HarnessUserError(f"{what} is a symbolic link loop; {fix}") from exc
            raise HarnessUserError(
                f"{what} is a symbolic link to {os.readlink(p)}, which does not exist; {fix}"
            ) from exc
    return path.resolve()


#: Row field type -> the arrow type written, and the arrow types its core column may hold (an int
#: column may read back as float; any column may be all null)
_KINDS = {
    "str": ("string", (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)),
    "int": ("int64", (pa.types.is_integer, pa.types.is_floating)),
    "float": ("double", (pa.types.is_integer, pa.types.is_floating)),
    "bool": ("bool", (pa.types.is_boolean,)),
}


class ResultsTable:
    """A parquet table of Rows, appended one cell at a time under a lock (see the module doc)."""

    def __init__(self, path: str | Path) -> None:
        #: the path as given (what messages name)
        self.path = Path(path)
        #: the file it names, links followed once (resolve_table_path): what is locked and written
        self.target = resolve_table_path(self.path)

    @property
    def lock(self) -> FileLock:
        return FileLock(str(self.target) + ".lock", timeout=LOCK_TIMEOUT_S)

    def check_schema(self) -> None:
        """A HarnessUserError where a core column has another type (the write would fail after
        the cell was measured). Nothing where there is no table, or one read_table refuses."""
        if not self.target.is_file():
            return
        try:
            schema = pq.read_schema(self.target)
        except Exception:  # noqa: BLE001 - a damaged table: read_table says so
            return
        types = {f.name: str(f.type) for f in fields(Row)}
        for name in CORE_COLUMNS:
            if name not in schema.names or types[name] not in _KINDS:
                continue
            writes, oks = _KINDS[types[name]]
            have = schema.field(name).type
            if pa.types.is_dictionary(have):
                have = have.value_type
            if pa.types.is_null(have) or any(ok(have) for ok in oks):
                continue
            raise HarnessUserError(
                f"table {self.path}: column {name} holds {have} where this harness writes "
                f"{writes}, so no row could be added to it; {_fix_hint(self.path)}"
            )

    def check_writable(self) -> None:
        """A HarnessUserError naming the fix if rows could not be written to the table's path."""
        parent = self.target.parent
        for p in (parent, *parent.parents):
            if p.exists() and not p.is_dir():
                raise HarnessUserError(
                    f"cannot write the table {self.path}: {p} is a file, not a directory; "
                    "choose a writable path with table=<path>"
                )
        self.refuse_read_only()
        try:
            parent.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(
                dir=parent, prefix=f".{self.target.name}.", suffix=".probe"
            )
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise HarnessUserError(
                f"cannot write the table {self.path} ({exc.strerror or exc}); "
                "choose a writable path with table=<path>"
            ) from exc

    def refuse_read_only(self) -> None:
        """A HarnessUserError if the table, or the folder it is (or would be) written in, is
        read-only: by os.access and by the mode bits (os.access is always true for root)."""
        folder = next((p for p in self.target.parents if p.exists()), Path("."))
        for p, what in ((self.target, "it"), (folder, f"its folder {folder}")):
            if not p.exists():
                continue
            mode = p.stat().st_mode
            if not os.access(p, os.W_OK) or not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
                raise HarnessUserError(
                    f"cannot write the table {self.path}: {what} is read-only (mode "
                    f"{stat.filemode(mode)}); make it writable or choose another with table=<path>"
                )

    def load(self) -> pd.DataFrame:
        return read_table(self.target, shown=self.path)

    def statuses(self) -> dict[str, str]:
        """cell_hash -> status of the cells in the table."""
        df = self.load()
        return dict(zip(df["cell_hash"].astype(str), df["status"].astype(str)))

    def append(self, rows: list[Row]) -> None:
        """Append rows; a row replaces any earlier row with the same (cell_hash, system)."""
        if not rows:
            return
        new = pd.DataFrame([row_dict(r) for r in rows])
        self.refuse_read_only()  # also a table made read-only while the run went on
        self.target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self.lock:
                old = self.load()  # raises, and writes nothing, if the table is damaged
                if not old.empty:
                    keys = set(zip(new["cell_hash"], new["system"]))
                    keep = [(h, s) not in keys for h, s in zip(old["cell_hash"], old["system"])]
                    new = pd.concat([old[keep], new], ignore_index=True)
                    new["caveat"] = new["caveat"].fillna("")  # a table from before the column
                self._replace(mixed_params_as_text(new))
        except Timeout as exc:
            raise HarnessUserError(
                f"another writer held {self.lock.lock_file} for {LOCK_TIMEOUT_S:.0f} s"
            ) from exc

    def _replace(self, df: pd.DataFrame) -> None:
        """Write df to a unique temporary file next to the target, renamed over it (atomic). With
        the lock held: an older temporary file is a killed writer's."""
        folder, name = self.target.parent, self.target.name
        for stale in folder.glob(f".{name}.*.tmp"):
            stale.unlink(missing_ok=True)
        tmp = folder / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            write_table(df, tmp)
            if self.target.exists():  # the table keeps its permissions
                shutil.copymode(self.target, tmp)
            os.replace(tmp, self.target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
