"""The timed step is what gets checked (eager and graph), and graph/queue_ahead enter the hash."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from harness import system as hs
from harness.graphs import graph_choice, graph_mode
from harness.measure import hash_cell, measure_cell
from harness.system import RunContext, Step
from systems.serial import SerialSystem

CPU = torch.device("cpu")


class _WrongTimed(Step):
    """Serial's step whose outputs() are right but whose timed region is the subclass's."""

    def __init__(self, step: Step) -> None:
        self.step = step

    def outputs(self) -> torch.Tensor:
        return self.step.outputs()

    def capture_blocker(self) -> str | None:
        return self.step.capture_blocker()


class _ZeroStep(_WrongTimed):
    def timed(self) -> torch.Tensor:
        return torch.zeros_like(self.step.timed())


class _NoOutputStep(_WrongTimed):
    def timed(self) -> None:
        return None


class _ZeroTimed(SerialSystem):
    """Serial whose forward() is right but whose timed region returns nothing useful."""

    name = "zero_timed"

    def build(self, ranks) -> Step:
        return _ZeroStep(super().build(ranks))


class _NoOutputTimed(SerialSystem):
    name = "no_output_timed"

    def build(self, ranks) -> Step:
        return _NoOutputStep(super().build(ranks))


@pytest.fixture()
def registered():
    names = []

    def add(cls):
        hs.REGISTRY[cls.name] = hs.SystemInfo(cls.name, cls.name, f"{__name__}:{cls.__name__}")
        names.append(cls.name)

    hs.registry()  # the catalogue first, so it does not register over ours
    yield add
    for n in names:
        hs.REGISTRY.pop(n, None)


def _cell(system: str) -> dict:
    return {
        "experiment": "t",
        "system": system,
        "seed": 1,
        "world_size": 1,
        "tokens_per_rank": 16,
        "hidden": 8,
        "out": 8,
        "experts_per_rank": 2,
        "top_k": 2,
        "routing": "balanced",
        "dtype": "float32",
        "params": {},
        "cell_hash": system,
    }


def _cfg(**measure):
    return SimpleNamespace(measure=SimpleNamespace(tol=8e-3, warmup=1, iters=2, **measure))


@pytest.fixture()
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield RunContext(0, 1, CPU)
    dist.destroy_process_group()


def test_a_timed_region_that_returns_a_wrong_output_fails_the_cell(registered, one_rank):
    registered(_ZeroTimed)
    registered(_NoOutputTimed)
    ctx = one_rank
    row = measure_cell(ctx, _cfg(), _cell("zero_timed"))
    assert row.status == "fail" and row.reason.startswith("timed step: output is all zeros")
    assert row.latency_ms != row.latency_ms  # never timed
    row = measure_cell(ctx, _cfg(), _cell("no_output_timed"))
    assert row.status == "fail" and "returned no output tensor" in row.reason
    row = measure_cell(ctx, _cfg(graph="auto"), _cell("serial"))
    assert row.status == "ok" and not row.graph and row.graph_reason.startswith("no CUDA")


def test_graph_modes_and_choice():
    assert graph_mode(True) == "true" and graph_mode("AUTO") == "auto"
    with pytest.raises(ValueError, match="measure.graph must be one of"):
        graph_mode("sometimes")
    gpu = torch.device("cuda")
    assert graph_choice("auto", gpu, None) is None
    assert graph_choice("auto", gpu, "host sync") == "host sync"
    assert graph_choice("true", gpu, "host sync") is None  # true tries every system
    assert graph_choice("false", gpu, None) == "measure.graph=false"
    assert graph_choice("true", CPU, None).startswith("no CUDA")


def _hw(device: str):
    return SimpleNamespace(name="h", device=device, backend="nccl")


def test_queue_ahead_and_graph_enter_the_cell_hash_where_they_change_the_timing():
    cell = _cell("serial")

    def h(device="cuda", **m):
        base = {"warmup": 1, "iters": 2, "tol": 8e-3, "rounds": 1, **m}
        return hash_cell(
            SimpleNamespace(measure=SimpleNamespace(**base), hardware=_hw(device)), 1, cell
        )

    eager = h(graph="false")
    assert eager == h(graph="false", queue_ahead=False)  # the hashes eager rows always had
    assert h(graph="false", queue_ahead=True) != eager
    assert h(graph="auto") != eager and h(graph="true") not in (eager, h(graph="auto"))
    assert h("cpu", graph="auto") == h("cpu", graph="false")  # no graph off CUDA
