"""The system protocol and the registry every runner and plot reads.

A system is set up once per cell on this rank's share of the workload, then called:
  forward()       the timed region, returns out [T, N] for this rank (checked vs the reference)
  compute_only()  the expert computation alone (for the overlap ratio), or None if not defined
  comm_only()     the combine communication alone, or None if not defined
Registry entries name their class by import path, so reading the registry imports no GPU code.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from harness.layout import RankLayout
from harness.workload import WorkloadSpec


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

    x       [T, K]  this rank's tokens
    weights [E, K, N]  this rank's experts
    x_recv  [R, K]  rows received by the dispatch (grouped by source rank, harness/layout.py)
    """

    spec: WorkloadSpec
    layout: RankLayout
    x: torch.Tensor
    weights: torch.Tensor
    x_recv: torch.Tensor


class System:
    """Base class. Subclasses set `name`, implement setup and forward, and may add the bounds."""

    name: str = ""
    #: scope of the timed region: "gemm+combine" (operator level) or "layer"
    scope: str = "gemm+combine"

    def __init__(self, ctx: RunContext, params: dict[str, Any]) -> None:
        self.ctx = ctx
        self.params = dict(params)

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        """Raise ValueError for a cell this system cannot take. Called before any GPU work."""

    def setup(self, inputs: CellInputs) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement setup")

    def forward(self) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    # Optional: `timed()` replaces forward() as the timed region (after forward() was checked),
    # and `simulated_ranks` (list of ranks) says forward() returns those ranks' outputs stacked.

    def compute_only(self) -> object:
        return None

    def comm_only(self) -> object:
        return None

    def has_bounds(self) -> bool:
        return type(self).compute_only is not System.compute_only

    @property
    def impl(self) -> str:
        return "native"

    @property
    def transport(self) -> str:
        return self.ctx.backend

    def row_fields(self) -> dict[str, Any]:
        """Extra core-column values (tile sizes, ccta...) this system reports."""
        return {}


@dataclass(frozen=True)
class SystemInfo:
    name: str
    label: str
    target: str  # "module:Class"
    baseline: bool = True
    needs_gpu: bool = False
    min_ranks: int = 1
    optional_imports: tuple[str, ...] = ()
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

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


def get_system(name: str) -> SystemInfo:
    if name not in REGISTRY:
        raise ValueError(f"unknown system {name!r}; choices: {sorted(REGISTRY)}")
    return REGISTRY[name]


register(
    SystemInfo(
        name="serial",
        label="Serial (GEMM, then all-to-all)",
        target="systems.serial:SerialSystem",
        description="Expert GEMMs with torch, then the combine all-to-all, then scale.",
    )
)

register(
    SystemInfo(
        name="overlap",
        label="Overlap (tile-level signalling, this paper)",
        target="systems.overlap.system:OverlapSystem",
        baseline=False,
        needs_gpu=True,
        optional_imports=("triton",),
        description="Stage A plan, persistent Triton producer with per-band ready counters, "
        "flag-polling consumer on cCTA SMs (loopback / p2p / nvshmem), scale.",
    )
)
register(
    SystemInfo(
        name="tutel",
        label="Tutel (capacity-chunk pipeline)",
        target="systems.tutel:TutelSystem",
        description="Capacity-padded all-to-all split along capacity into d chunks; expert and "
        "combine of chunk i overlap later chunks; d tuned per cell (native if tutel imports).",
    )
)
register(
    SystemInfo(
        name="fastermoe",
        label="FasterMoE (smart schedule)",
        target="systems.fastermoe:FasterMoESystem",
        description="Group-step point-to-point exchange; per-step expert GEMMs overlap the "
        "return steps (native if fmoe imports; shadowing and topology-aware gate off).",
    )
)
register(
    SystemInfo(
        name="megatron_cutlass",
        label="Megatron-core + CUTLASS GroupedGEMM",
        target="systems.megatron_cutlass:MegatronCutlassSystem",
        needs_gpu=True,
        optional_imports=("megatron",),
        description="megatron-core MoELayer, all-to-all dispatcher, GroupedMLP fc1 as the expert "
        "(grouped_gemm.gmm, else torch._grouped_mm).",
    )
)
register(
    SystemInfo(
        name="megatron_te",
        label="Megatron-core + Transformer Engine",
        target="systems.megatron_te:MegatronTESystem",
        needs_gpu=True,
        optional_imports=("megatron", "transformer_engine"),
        description="megatron-core MoELayer, all-to-all dispatcher, TE GroupedLinear as the "
        "expert.",
    )
)
