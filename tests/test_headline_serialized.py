"""Issue 58: a step's `serialized` (its own kernels one after the other) is checked like the
step and timed into serialized_ms; a wrong one fails the cell; rows carry the run's id."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from harness import system as hs
from harness.measure import measure_cell
from harness.records import RUN_ID
from harness.system import RunContext, Step
from systems.serial import SerialSystem


class _Serialized(SerialSystem):
    """Serial whose step declares serialized (here: its own timed region)."""

    name = "serialized_ok"

    def build(self, ranks) -> Step:
        step = super().build(ranks)
        step.serialized = step.timed
        return step


class _WrongSerialized(SerialSystem):
    name = "serialized_zero"

    def build(self, ranks) -> Step:
        step = super().build(ranks)
        step.serialized = lambda: torch.zeros_like(step.timed())
        return step


@pytest.fixture()
def ctx(tmp_path):
    hs.registry()  # the catalogue first, so it does not register over ours
    for cls in (_Serialized, _WrongSerialized):
        hs.REGISTRY[cls.name] = hs.SystemInfo(cls.name, cls.name, f"{__name__}:{cls.__name__}")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield RunContext(0, 1, torch.device("cpu"))
    dist.destroy_process_group()
    for cls in (_Serialized, _WrongSerialized):
        hs.REGISTRY.pop(cls.name, None)


def _cell(system: str) -> dict:
    return dict(experiment="t", system=system, seed=1, world_size=1, tokens_per_rank=16,
                hidden=8, out=8, experts_per_rank=2, top_k=2, routing="balanced",
                dtype="float32", params={}, cell_hash=system)  # fmt: skip


def test_serialized_is_checked_then_timed_and_rows_carry_the_run_id(ctx, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter skips the stage
    cfg = SimpleNamespace(measure=SimpleNamespace(tol=8e-3, warmup=1, iters=2))
    row = measure_cell(ctx, cfg, _cell("serialized_ok"))
    assert row.status == "ok" and row.serialized_ms > 0 and row.run_id == RUN_ID != ""
    row = measure_cell(ctx, cfg, _cell("serial"))  # no serialized step: nothing timed
    assert row.status == "ok" and row.serialized_ms != row.serialized_ms
    row = measure_cell(ctx, cfg, _cell("serialized_zero"))
    assert row.status == "fail" and row.reason.startswith("serialized: output is all zeros")
    assert row.latency_ms != row.latency_ms  # a failed check: no latency
