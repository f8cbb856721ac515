"""The models experiment under measure.graph: the forward captured whole and the system's step
alone, both checked on a replay before and after timing; a capture that fails runs eager with
the reason. On the CPU a stand-in for harness.graphs.capture replays by rerunning the step into
the static output, as a CUDA graph's replay rewrites it."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from experiments import models as exp
from harness.models import ModelSpec
from harness.system import RunContext

CTX = RunContext(0, 1, torch.device("cpu"))
TINY = ModelSpec("tiny", 2, (0, 1), 2, 8, 32, 4, True, experts=4, top_k=2, dtype="float32")
CELL = {
    "experiment": "t",
    "system": "serial",
    "cell_hash": "h",
    "world_size": 1,
    "params": {},
    "seed": 0,
}


def _cfg(graph: str = "auto"):
    measure = {"tol": 8e-3, "warmup": 1, "iters": 3, "graph": graph}
    return OmegaConf.create({"measure": measure, "experiment": {"options": {}}})


class _Replayed:
    """A captured step: replay() reruns it and writes its result into the static output
    (scaled by `scale`: 0 plays a graph whose replays compute nothing)."""

    def __init__(self, step, scale: float = 1.0) -> None:
        self.step, self.scale = step, scale
        self.out = step().clone()

    def replay(self):
        self.out.copy_(self.step() * self.scale)
        return self.out


def _measure(monkeypatch, capture, graph: str = "auto"):
    if capture is not None:
        monkeypatch.setattr(exp, "graph_choice", lambda mode, device, blocker: None)
        monkeypatch.setattr(exp, "capture", capture)
    row = exp._row(CELL, TINY)
    exp._measure(CTX, _cfg(graph), CELL, TINY, row)
    return row


def test_graph_timing_replays_the_checked_forward_and_the_step(monkeypatch):
    steps = []

    def capture(step, device):
        steps.append(step)
        return _Replayed(step)

    row = _measure(monkeypatch, capture)
    assert row.status == "ok", row.reason
    assert row.graph and row.graph_reason == ""
    assert len(steps) == 2  # the whole forward, then the system's step alone
    assert row.latency_ms > 0 and row.metrics["moe_ms"] > 0
    assert json.loads(row.extra)["timing"].startswith("graph")
    assert row.max_rel_err < 1e-4 and row.metrics["moe_max_rel_err"] < 1e-4


@pytest.mark.parametrize("wrong", [0, 1])
def test_a_graph_whose_replays_are_wrong_fails_the_cell(monkeypatch, wrong):
    """Either graph (0: the forward, 1: the step) replaying zeros fails the row, unlike the
    eager checked forward that came before it."""
    made = []

    def capture(step, device):
        made.append(step)
        return _Replayed(step, 0.0 if len(made) - 1 == wrong else 1.0)

    row = _measure(monkeypatch, capture)
    assert row.status == "fail" and row.reason.startswith("graph replay"), row.reason
    assert ("model output" if wrong == 0 else "a MoE call") in row.reason
    assert row.latency_ms != row.latency_ms  # no latency for a failed cell


def test_a_capture_that_fails_runs_eager_with_the_reason(monkeypatch):
    def capture(step, device):
        raise RuntimeError("capture failed: RuntimeError: a host sync")

    row = _measure(monkeypatch, capture)
    assert row.status == "ok", row.reason
    assert not row.graph and row.graph_reason == "capture failed: RuntimeError: a host sync"
    assert json.loads(row.extra)["timing"].startswith("eager")


def test_off_cuda_and_with_graph_false_the_row_says_why_it_is_eager(monkeypatch):
    assert _measure(monkeypatch, None).graph_reason == "no CUDA device: eager host timing"
    assert _measure(monkeypatch, None, "false").graph_reason == "measure.graph=false"
