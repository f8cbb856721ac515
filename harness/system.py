"""The system protocol, the Step a system builds per cell, and the registry.

`System.setup(ranks)` stores the Step its `build` returns and every later call goes to that step,
so no system branches on scope after setup. The catalogue (systems/__init__.py) names classes by
import path ("module:Class"), so reading the registry imports no GPU code.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from harness.layout import RankLayout
from harness.workload import WorkloadSpec


def int_param(system: str, name: str, value: Any, least: int | None = None) -> int:
    """`value` as an integer (not a bool) of at least `least`, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{system}: {name} must be an integer, got {value!r}")
    if least is not None and value < least:
        raise ValueError(f"{system}: {name} must be >= {least}, got {value}")
    return value


def list_param(owner: str, name: str, value: Any, nonempty: bool = False) -> list:
    """`value` as a list (not a scalar or a string), non-empty if asked, else a ValueError."""
    scalar = isinstance(value, (str, bytes)) or not hasattr(value, "__iter__")
    if scalar or (nonempty and not len(value)):
        kind = "non-empty list" if nonempty else "list"
        raise ValueError(f"{owner}: {name} must be a {kind}, got {value!r}")
    return list(value)


@dataclass
class RunContext:
    """What a system may know about where it runs. world_size is the number of PROCESSES."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    backend: str = "gloo"

    @property
    def sm_count(self) -> int:
        if self.device.type != "cuda":
            return 0
        return torch.cuda.get_device_properties(self.device).multi_processor_count


@dataclass
class CellInputs:
    """This rank's share of one cell, prepared by the harness (untimed).

    x          [T, K]  this rank's tokens
    weights    [E, K, N]  this rank's experts (FFN cells: fc2's W2 [E, F, H])
    x_recv     [R, K]  rows received by the dispatch (grouped by source rank, harness/layout.py)
    w1         [E, H, F]  fc1 of the FFN experts (FFN cells only, else None)
    expert_ids [T, k]  this rank's routing on the device: global expert of (token, slot)
    gate       [T, k]  its gate weights, float32 on the device
    dy         [T, N]  a train cell's upstream gradient dL/dout (else None)
    A layer-scope system starts its timed region from x, expert_ids and gate only.
    """

    spec: WorkloadSpec
    layout: RankLayout
    x: torch.Tensor
    weights: torch.Tensor
    x_recv: torch.Tensor
    w1: torch.Tensor | None = None
    expert_ids: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    dy: torch.Tensor | None = None


class Step:
    """One set-up cell's step: what the harness checks, times and bounds. Subclasses override
    timed() and what else they have; the defaults declare "not there"."""

    #: whose output timed() returns: an index into setup's `ranks` (None: all, stacked)
    timed_rank: int | None = 0
    #: the method's own kernels one after the other, one call returning what timed() returns
    #: (overlap: producer to the end, then consumer, then the scale), or None; checked and timed
    #: as timed() is (serial / serialized: the kernel gain; serialized / timed: the overlap gain)
    serialized = None

    def timed(self) -> torch.Tensor:
        """The timed region: out [T, N] of the played rank `timed_rank` (None: all, stacked)."""
        raise NotImplementedError(f"{type(self).__name__} must implement timed")

    def outputs(self) -> torch.Tensor:
        """out [T, N] of every played rank, stacked in setup's `ranks` order (default: timed())."""
        return self.timed()

    def capture_blocker(self) -> str | None:
        """Why timed() cannot be captured in a CUDA graph, or None where it can."""
        return f"{type(self).__name__}: not declared capturable"

    def buffers(self) -> list[torch.Tensor]:
        """The tensors a call writes that live from call to call (outputs, receive buffers)."""
        return []

    def poison(self) -> None:
        """NaN into the floating buffers() before every checked call: only that call's work
        can pass its check."""
        for t in self.buffers():
            if t.is_floating_point():
                t.fill_(float("nan"))

    def check(self) -> None:
        """Raise where a device-side wait of the steps run so far timed out (after every loop)."""

    def has_bounds(self) -> bool:
        """Are compute_only and comm_only defined for this step?"""
        return type(self).compute_only is not Step.compute_only

    def compute_only(self) -> object:
        """Everything timed() does but the communication (for the overlap ratio), or None."""
        return None

    def comm_only(self) -> object:
        """The combine communication alone, or None if not defined."""
        return None

    def extra_bounds(self) -> dict[str, Any]:
        """Further parts timed alone after the bounds, name -> callable (column m_<name>_ms)."""
        return {}


class System:
    """Base class: subclasses set `name` and PARAMS and implement build(ranks) -> Step."""

    name: str = ""
    #: scope of the timed region: "gemm+combine" (operator level) or "layer"
    scope: str = "gemm+combine"
    #: capabilities (a cell that needs one the system lacks is skipped with the reason): FFN
    #: cells (spec.ffn > 0) timed from the tokens and routing (scope layer)
    layer_scope: ClassVar[bool] = False
    #: a layer cell as one training step (spec.train: forward + backward, scope train)
    train_scope: ClassVar[bool] = False
    #: ONE process plays every rank of a cell (loopback), where W differs from the processes
    simulates_ranks: ClassVar[bool] = False
    #: the system's own knobs and their defaults; an experiment may set only these keys
    PARAMS: ClassVar[dict[str, Any]] = {}
    #: does the step hide communication behind compute? If not (serial, Megatron's dispatcher)
    #: it has no overlap ratio (NaN, with the reason)
    overlaps: ClassVar[bool] = True

    def __init__(self, ctx: RunContext, params: dict[str, Any]) -> None:
        self.ctx = ctx
        self.params = {**self.PARAMS, **params}
        #: JSON-able facts of the set-up cell (written to the row's `extra` column)
        self.extra: dict[str, Any] = {}
        #: numbers the system measured itself while setting up, written as m_<name> columns
        self.metrics: dict[str, float] = {}
        self.step: Step | None = None

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """Unknown keys are an error naming the system and the keys it accepts."""
        unknown = sorted(set(params) - set(cls.PARAMS))
        if unknown:
            accepted = ", ".join(sorted(cls.PARAMS)) or "none"
            raise ValueError(
                f"system {cls.name!r} has no parameter {', '.join(map(repr, unknown))}; "
                f"it accepts: {accepted}"
            )

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        """Raise ValueError for bad input (params hold the defaults). Called before any work."""

    @classmethod
    def refuse(
        cls, spec: WorkloadSpec, params: dict[str, Any], processes: int, device: str
    ) -> None:
        """Raise ValueError where the cell cannot run on `processes` processes of `device`
        ("cpu" or "cuda"), before any process starts (a W neither 1 nor `processes` is skipped
        later, not refused)."""

    @classmethod
    def unsupported(cls, spec: WorkloadSpec, params: dict[str, Any]) -> str | None:
        """Why this system cannot take a valid cell (a shape its package does not support; the
        cell is recorded as `skipped`), or None."""
        return None

    def setup(self, ranks: list[CellInputs]) -> None:
        """Untimed: build the cell's step; `ranks`: one entry per rank this process plays."""
        self.step = self.build(ranks)

    def build(self, ranks: list[CellInputs]) -> Step:
        """The cell's step (untimed; may fill extra and metrics)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build")

    # -- the step's calls, as the harness makes them --------------------------------------
    @property
    def timed_rank(self) -> int | None:
        return self.step.timed_rank

    def forward(self) -> torch.Tensor:
        return self.step.outputs()

    def timed(self) -> torch.Tensor:
        return self.step.timed()

    def capture_blocker(self) -> str | None:
        return self.step.capture_blocker()

    def check_errors(self) -> None:
        self.step.check()

    def has_bounds(self) -> bool:
        return self.step.has_bounds()

    def compute_only(self) -> object:
        return self.step.compute_only()

    def comm_only(self) -> object:
        return self.step.comm_only()

    def extra_bounds(self) -> dict[str, Any]:
        return self.step.extra_bounds()

    @property
    def impl(self) -> str:
        return "native"

    @property
    def transport(self) -> str:
        return self.ctx.backend

    def resolved_params(self) -> dict[str, Any]:
        """Parameters the system chose itself while setting up (p_<name> columns)."""
        return {}


@dataclass(frozen=True)
class SystemInfo:
    name: str
    label: str
    target: str  # "module:Class"
    needs_gpu: bool = False
    min_ranks: int = 1
    optional_imports: tuple[str, ...] = ()

    def load(self) -> type[System]:
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)

    def unavailable_reason(self, ctx: RunContext, logical_world: int) -> str | None:
        """Why this system cannot run here, or None."""
        if self.needs_gpu and ctx.device.type != "cuda":
            return f"{self.name} needs a CUDA GPU; this run is on {ctx.device.type}"
        if logical_world < self.min_ranks:
            return f"{self.name} needs at least {self.min_ranks} ranks, cell has {logical_world}"
        for mod in self.optional_imports:
            if importlib.util.find_spec(mod) is None:
                return f"optional package {mod!r} is not installed"
        return None


REGISTRY: dict[str, SystemInfo] = {}


def register(info: SystemInfo) -> SystemInfo:
    if info.name in REGISTRY:
        raise ValueError(f"system {info.name!r} registered twice")
    REGISTRY[info.name] = info
    return info


def registry() -> dict[str, SystemInfo]:
    """Every registered system by name (imports the catalogue, systems/__init__.py, whose
    import registers every system and imports no GPU code)."""
    importlib.import_module("systems")
    return REGISTRY


def get_system(name: str) -> SystemInfo:
    reg = registry()
    if name not in reg:
        raise ValueError(f"unknown system {name!r}; choices: {sorted(reg)}")
    return reg[name]
