"""What is timed is what is checked: every checked call starts from poisoned buffers (NaN in
what the step keeps between calls and in what earlier checked calls returned), so a step that
returns a cached output, skips the GEMM or skips the combine fails its check; without the
poison the same steps would pass (the control)."""

from __future__ import annotations

from tests.interpreted import run_interpreted

SCRIPT = """
from types import SimpleNamespace
import torch
from harness.measure import _Prepared, base_row, cell_inputs, check_step, poison
from harness.system import RunContext
from harness.workload import WorkloadSpec
from systems.overlap.system import OverlapSystem

spec = WorkloadSpec(tokens_per_rank=32, hidden=32, out=32, ffn=64, experts_per_rank=2, top_k=2,
                    world_size=2, routing="balanced", dtype="float16")
ctx = RunContext(0, 1, torch.device("cpu"), None, "gloo")
cfg = SimpleNamespace(measure=SimpleNamespace(tol=8e-3))
inputs, ref = cell_inputs(ctx, spec, [0, 1])


def prepared():
    system = OverlapSystem(ctx, {"tile_m": 64, "ccta": 2, "transport": "loopback"})
    system.setup(inputs)
    cell = {"experiment": "t", "system": "overlap", "params": {}, "cell_hash": "h"}
    p = _Prepared(base_row(cell | spec.__dict__, spec), system, ref, spec)
    assert check_step(ctx, cfg, p, "real"), p.row.reason  # the real step passes
    return p, system.step


def cached(p, step):
    out = p.returned[0]
    return lambda: out


def no_gemm(p, step):  # the consumer alone on fc2's (stale) output, then the scale
    def run():
        ds = step.played(step.xs, step.ids, gather=False)
        for rk in step.ranks:
            rk.runner.comm_only(rk.y)
        return torch.cat([rk.scale(d, g) for rk, d, g in zip(step.ranks, ds, step.gates)])
    return run


def no_combine(p, step):  # every rank's experts with the producer alone: no puts to peers
    def run():
        ds = step.played(step.xs, step.ids, gather=False)
        for rk, d in zip(step.ranks, ds):
            plan, x_pad = rk.stage_a(d)
            rk.fc2_combine(plan, rk.fc1(plan, x_pad), overlapped=False)
        return torch.cat([rk.scale(d, g) for rk, d, g in zip(step.ranks, ds, step.gates)])
    return run


for name, fault in (("cached", cached), ("no_gemm", no_gemm), ("no_combine", no_combine)):
    p, step = prepared()
    p.step = fault(p, step)
    caught = not check_step(ctx, cfg, p, name)
    p, step = prepared()  # the control: the same fault, checked without the poison
    p.step = fault(p, step)
    p.returned = []
    step.poison = lambda: None
    passed_unpoisoned = check_step(ctx, cfg, p, name)
    print(name, caught, passed_unpoisoned)
"""


def test_a_cached_output_a_skipped_gemm_and_a_skipped_combine_each_fail_their_check():
    lines = [ln.split() for ln in run_interpreted(SCRIPT, timeout=240).splitlines() if ln]
    got = {name: (caught, control) for name, caught, control in lines}
    assert got == {
        "cached": ("True", "True"),
        "no_gemm": ("True", "True"),
        "no_combine": ("True", "True"),
    }, got
