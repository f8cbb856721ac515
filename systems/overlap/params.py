"""The overlap system's parameters (OverlapParams): choices, validation and the reasons a valid
cell cannot run. Importable without Triton or a GPU. The knobs (what each choice means:
docs/method.md, Stage A and Stage B): ccta (consumer SMs with consumer=own, consumer CTAs with
shared) and mgb (bands per segment), integers or "auto"; tile_m; transport; layout; order;
consumer; dispatch (the layer scope's; auto: harness.dispatch_device.dispatch_used).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from harness.dispatch_device import DISPATCHES, dispatch_used

AUTO = "auto"
TILE_MS = (64, 128)
TRANSPORTS = ("", "loopback", "p2p", "nvshmem", "shm")
LAYOUTS = ("aligned", "compact")
ORDERS = ("remote_first", "expert")
CONSUMER_SMS = ("own", "shared")
KERNEL_DTYPES = ("float16", "bfloat16")
#: the most consumer programs on the CPU (Triton's interpreter runs programs in turn)
CPU_MAX_CCTA = 16


def _int_or_auto(name: str, value: Any) -> int | str:
    """An integer knob or "auto"; anything else is a one-line ValueError."""
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"overlap: {name} must be an integer or 'auto', got {value!r}")
    return value


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"overlap: {name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class OverlapParams:
    """One cell's knobs (the defaults are the paper's setting, order picked per cell)."""

    ccta: int | str = 16
    mgb: int | str = 1
    tile_m: int = 128
    transport: str = ""
    layout: str = "aligned"
    order: str = AUTO
    consumer: str = "own"
    dispatch: str = AUTO

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OverlapParams:
        """The params of a mapping (missing keys at their defaults; an unknown one: ValueError)."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(
                f"overlap has no parameter {', '.join(map(repr, unknown))}; "
                f"it accepts: {', '.join(sorted(names))}"
            )
        return cls(**d)

    def transport_for(self, world_size: int, device_type: str = "cuda") -> str:
        """The transport on `world_size` processes ("": loopback on one, else p2p or shm)."""
        if self.transport or world_size == 1:
            return self.transport or "loopback"
        return "p2p" if device_type == "cuda" else "shm"

    def validate(self, spec: Any, sm_count: int, dtypes: tuple[str, ...] = KERNEL_DTYPES) -> None:
        """A one-line ValueError for a bad knob or a workload the kernels cannot take (spec: a
        WorkloadSpec; sm_count 0 = unknown, no upper bound on ccta; dtypes: those allowed)."""
        ccta, mgb = _int_or_auto("ccta", self.ccta), _int_or_auto("mgb", self.mgb)
        _choice("consumer", self.consumer, CONSUMER_SMS)
        if self.consumer == "shared":  # the producer keeps every SM: ccta may take them all
            if ccta != AUTO and (ccta < 1 or (sm_count and ccta > sm_count)):
                raise ValueError(
                    f"overlap: ccta={ccta} must be in [1, {sm_count or 'SMs'}] with consumer=shared"
                )
        elif ccta != AUTO and (ccta < 1 or (sm_count and ccta >= sm_count)):
            raise ValueError(f"overlap: ccta={ccta} must be in [1, {sm_count or 'SMs'}) or 'auto'")
        if type(self.tile_m) is not int or self.tile_m not in TILE_MS:  # 64.0 would hash apart
            raise ValueError(f"overlap: tile_m must be one of {TILE_MS}, got {self.tile_m}")
        if mgb != AUTO and mgb < 1:
            raise ValueError(f"overlap: mgb must be >= 1, got {mgb}")
        _choice("layout", self.layout, LAYOUTS)
        _choice("dispatch", self.dispatch, DISPATCHES)
        _choice("order", self.order, (*ORDERS, AUTO))
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"overlap: unknown transport {self.transport!r}; "
                "choices: loopback, p2p, nvshmem, shm (empty = loopback on one process, else "
                "p2p on GPUs, shm on the CPU)"
            )
        if spec.dtype not in dtypes:
            raise ValueError(f"overlap: dtype must be {' or '.join(dtypes)}, got {spec.dtype}")
        if spec.hidden % 8 or spec.out % 8:
            raise ValueError("overlap: K and N must be multiples of 8 (16-byte rows)")

    def refuse(self, spec: Any, processes: int, device: str) -> None:
        """A one-line ValueError where the cell (spec: a WorkloadSpec of W ranks) cannot run on
        `processes` processes of `device` ("cpu" or "cuda"), found before any process starts."""
        W, plays = spec.world_size, processes == 1
        name = self.transport_for(processes, device)
        where = f"W={W} on {processes} {device} process(es)"
        if plays and name != "loopback":
            raise ValueError(f"overlap: transport={name} needs one process per rank ({where})")
        if not plays and name == "loopback":
            raise ValueError(
                f"overlap: transport=loopback plays every rank in one process ({where}): "
                "run it with hardware.world_size=1"
            )
        if not plays and (name == "shm") != (device == "cpu"):
            raise ValueError(f"overlap: transport={name} cannot run on {device} ({where})")
        if spec.ffn:
            try:
                dispatch_used(self.dispatch, W, plays)
            except ValueError as exc:
                raise ValueError(f"overlap: {exc} ({where})") from None
        if device == "cpu" and self.ccta != AUTO and self.ccta > CPU_MAX_CCTA:
            raise ValueError(f"overlap: ccta={self.ccta} on the CPU: at most {CPU_MAX_CCTA}")
