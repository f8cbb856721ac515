"""CUDA-graph timing: a system's step captured once, then timed as the graph's replays.

measure.graph chooses per cell (graph_choice). The step's output at capture time is the graph's
static output: every replay rewrites it, so the harness checks that tensor after a replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MODES = ("auto", "true", "false")
#: steps run on the side stream before the capture (torch's recipe: warms lazy state)
SIDE_WARMUP = 3


def graph_mode(value: object) -> str:
    """measure.graph as one of MODES (Hydra may hand a bool); else a one-line ValueError."""
    mode = str(value).lower()
    if mode not in MODES:
        raise ValueError(f"measure.graph must be one of {', '.join(MODES)}, got {value!r}")
    return mode


def graph_choice(mode: str, device: torch.device, blocker: str | None) -> str | None:
    """None where the step should be captured ("auto": where the system's capture_blocker() is
    None; "true": always; never off CUDA), else why it runs eager (one line)."""
    if mode == "false":
        return "measure.graph=false"
    if device.type != "cuda":
        return "no CUDA device: eager host timing"
    return blocker if mode == "auto" else None


@dataclass
class Captured:
    """A step captured once: replay() reruns it, `out` is its static output tensor."""

    graph: torch.cuda.CUDAGraph
    out: object

    def replay(self) -> object:
        self.graph.replay()
        return self.out


def capture(step: Callable[[], object], device: torch.device) -> Captured:
    """Capture one call of step() into a CUDA graph (torch's recipe): the caller ran the step
    eagerly (allocations, Triton compiles, rendezvous), SIDE_WARMUP more run on a side stream,
    then one is captured; where it cannot, a RuntimeError naming the cause (device usable)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(SIDE_WARMUP):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = step()
    except Exception as exc:  # noqa: BLE001 - any failure of the capture means: run eager
        torch.cuda.synchronize(device)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RuntimeError(f"capture failed: {type(exc).__name__}: {first}"[:300]) from exc
    torch.cuda.synchronize(device)
    return Captured(graph, out)
