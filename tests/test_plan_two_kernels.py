"""Stage A's device plan in two kernels (systems/overlap/plan_device.py, kernels/plan.py).

The row kernel's LAST program computes the groups and the fill kernel's LAST program the
producer's swizzle groups, each chosen by an acq_rel ticket on a word the plan's fill resets. On
the CPU (Triton's interpreter): a call launches exactly the two kernels; one builder called again
and again (the tickets reset by the fill) gives build_plan's plan every time, with and without
rows, at W=1 and with several row blocks; and with the programs run in REVERSE order (program 0
the last to draw its ticket) the plan is still right, so the ticket, not the program id, picks
the program. The gpu-marked test runs the compiled kernels: many row blocks finishing in any
order, the launches remembered.

TRITON_INTERPRET is set before triton is imported (as in test_plan_device.py); where triton was
imported earlier in the process, test_interpreter_in_subprocess runs this file in a fresh one.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from triton.runtime import interpreter  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETED = isinstance(triton.language.standard.cdiv, InterpretedFunction)
needs_interpreter = pytest.mark.skipif(
    CUDA or not INTERPRETED, reason="interpreter tests: a CPU-only process that set it first"
)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter

import systems.overlap.kernels.plan as kplan_mod  # noqa: E402

if INTERPRETED and not isinstance(kplan_mod._rows_kernel, InterpretedFunction):
    for name in ("primitives", "plan", "producer", "consumer"):
        importlib.reload(sys.modules[f"systems.overlap.kernels.{name}"])
    importlib.reload(sys.modules["systems.overlap.kernels"])
    for name in ("systems.overlap.plan_device", "systems.overlap.runner"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])

import systems.overlap.plan_device as plan_device  # noqa: E402
from harness.layout import rank_layout  # noqa: E402
from harness.workload import WorkloadSpec  # noqa: E402
from systems.overlap.plan import CombinePlan, build_plan  # noqa: E402

KERNELS = ("_rows_kernel", "_fill_kernel", "_gather_rows_kernel")


def _rows(W: int, E: int, routing: str, tokens: int, rank: int = 0):
    """(recv_src, recv_expert, recv_dst_index, send_counts) of one rank of a seeded workload
    (tokens=0: no rows)."""
    if tokens == 0:
        e = torch.empty(0, dtype=torch.int64)
        return e, e, e, torch.zeros(W, dtype=torch.int64)
    spec = WorkloadSpec(
        tokens_per_rank=tokens,
        hidden=8,
        out=8,
        experts_per_rank=E,
        top_k=2,
        world_size=W,
        routing=routing,
        seed=W * 10 + E,
    )
    lay = rank_layout(spec, rank)
    return lay.recv_src, lay.recv_expert, lay.recv_dst_index, lay.send_counts


def _shape(W: int, E: int, rank: int, layout: str, order: str, cap: int) -> dict:
    shape = dict(world_size=W, rank=rank, experts_per_rank=E, tile_m=16, mgb=2, out_cols=8)
    return shape | dict(elem_bytes=2, layout=layout, order=order, group_cap=cap)


def _assert_plan(dev: CombinePlan, ref: CombinePlan) -> None:
    """dev (worst-case sized, on any device) cut to its counts == ref, field by field."""
    cut = dev.trimmed()
    for f in fields(CombinePlan):
        a, b = getattr(ref, f.name), getattr(cut, f.name)
        if isinstance(a, torch.Tensor):
            assert b is not None and torch.equal(a, b.cpu()), f.name
        else:
            assert a == b, f.name


def _permuted(src, expert, dst, seed: int):
    """The same rows in another order (build_plan takes any row order): another plan."""
    perm = torch.randperm(src.numel(), generator=torch.Generator().manual_seed(seed))
    return src[perm], expert[perm], dst[perm]


class _Counted:
    """A Triton kernel whose launches are logged by name, then run."""

    def __init__(self, fn, name: str, log: list) -> None:
        self.fn, self.name, self.log = fn, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.fn[grid]


@needs_interpreter
@pytest.mark.parametrize("layout,cap", [("aligned", 0), ("compact", 3)])
def test_a_call_launches_two_kernels_and_one_fill(monkeypatch, layout, cap):
    """Rows (two row blocks) or none (one row program): the row and the fill kernel. Every call
    after the first: one fill of the plan's buffer (the tickets' reset) and nothing else but
    those two launches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    log: list[str] = []
    for name in KERNELS:
        monkeypatch.setattr(plan_device.kplan, name, _Counted(getattr(kplan_mod, name), name, log))

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += str(func.overloadpacket) in ("aten.fill_", "aten.full")
            return func(*args, **(kwargs or {}))

    src, expert, dst, send = _rows(2, 3, "balanced", 800)
    assert plan_device.cdiv(src.numel(), plan_device.ROW_BLOCK) >= 2
    e = src[:0]
    for rows in (src, expert, dst), (e, e, e):
        build = plan_device.DevicePlanBuilder(**_shape(2, 3, 0, layout, "expert", cap))
        for call in range(2):
            log.clear()
            with Fills() as fills:
                plan = build(*rows, send_counts=send)
            assert log == ["_rows_kernel", "_fill_kernel"], (rows[0].numel(), call)
            if call:
                assert fills.n == 1, "one fill of the plan's buffer"
        _assert_plan(
            plan, build_plan(*rows, send_counts=send, **_shape(2, 3, 0, layout, "expert", cap))
        )


CASES = [  # W, E, routing, tokens per rank, rank; rows 0 and W=1 included
    (1, 4, "balanced", 900, 0),  # 1800 rows: two row blocks, every row local
    (4, 3, "stress_skew", 500, 0),  # the hot rank: three row blocks
    (8, 2, "balanced", 160, 3),  # one block
    (3, 2, "balanced", 0, 1),  # no rows
]


@needs_interpreter
@pytest.mark.parametrize("layout", ["aligned", "compact"])
@pytest.mark.parametrize("W,E,routing,tokens,rank", CASES)
def test_one_builder_called_again_equals_build_plan_every_time(W, E, routing, tokens, rank, layout):
    """The same builder three times on rows of the same count (the tickets must be back at -1
    for each call's last program to be found): build_plan's plan every time."""
    src, expert, dst, send = _rows(W, E, routing, tokens, rank)
    order, cap = ("expert", 4) if W % 2 else ("remote_first", 2)
    shape = _shape(W, E, rank, layout, order, cap)
    build = plan_device.DevicePlanBuilder(**shape)
    first = None
    for call in range(3):
        rows = (src, expert, dst) if call == 0 else _permuted(src, expert, dst, call)
        plan = build(*rows, send_counts=send)
        assert first is None or plan is first, "one plan rewritten"
        first = plan
        _assert_plan(plan, build_plan(*rows, send_counts=send, **shape))


@needs_interpreter
@pytest.mark.parametrize("layout", ["aligned", "compact"])
def test_the_last_ticket_not_the_program_id_runs_the_body(monkeypatch, layout):
    """The interpreter runs programs in id order; here in REVERSE order, so program 0 draws the
    last ticket of each kernel. A body run by the highest program id would run first, before the
    other programs' counts (row kernel) and bands (fill kernel) exist, and give a wrong plan."""
    builder = interpreter.interpreter_builder
    forward = builder.set_grid_idx

    def reversed_idx(x, y, z):
        forward(builder.grid_dim[0] - 1 - x, y, z)

    src, expert, dst, send = _rows(4, 3, "stress_skew", 500)
    shape = _shape(4, 3, 0, layout, "expert", 3)
    assert plan_device.cdiv(src.numel(), plan_device.ROW_BLOCK) >= 2
    ref = build_plan(src, expert, dst, send_counts=send, **shape)
    monkeypatch.setattr(builder, "set_grid_idx", reversed_idx)
    build = plan_device.DevicePlanBuilder(**shape)
    for _ in range(2):
        _assert_plan(build(src, expert, dst, send_counts=send), ref)


@pytest.mark.skipif(CUDA or INTERPRETED, reason="this process runs the interpreter tests itself")
def test_interpreter_in_subprocess():
    """Fallback when triton was imported before this module: the same tests, fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["aligned", "compact"])
@pytest.mark.parametrize("W,routing", [(1, "balanced"), (8, "stress_skew")])
def test_compiled_two_kernels_rebuild_one_plan_right(monkeypatch, W, routing, layout):
    """On the GPU: tens of row blocks and fill programs finishing in any order, one builder
    called five times (remembered launches from the second call), rows permuted between calls:
    build_plan's plan every time, from the two launches 'rows' and 'fill' per call."""
    names: list[str] = []
    launch = plan_device.DevicePlanBuilder._launch

    def logged(self, name, *a, **k):
        names.append(name)
        return launch(self, name, *a, **k)

    monkeypatch.setattr(plan_device.DevicePlanBuilder, "_launch", logged)
    src, expert, dst, send = _rows(W, 16, routing, 8192)
    assert src.numel() > 8 * plan_device.ROW_BLOCK
    shape = _shape(W, 16, 0, layout, "expert", 16)
    build = plan_device.DevicePlanBuilder(**shape)
    for call in range(5):
        rows = (src, expert, dst) if call % 2 == 0 else _permuted(src, expert, dst, call)
        names.clear()
        plan = build(*(t.cuda() for t in rows), send_counts=send.cuda())
        assert names == ["rows", "fill"]
        _assert_plan(plan, build_plan(*rows, send_counts=send, **shape))
    assert all(build.memos[k].compiled is not None for k in ("rows", "fill"))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["aligned", "compact"])
def test_compiled_row_kernel_runs_the_groups_alone_where_there_are_no_rows(layout):
    """On the GPU, no rows: one row-kernel program (every row masked) computes the groups;
    build_plan's plan, twice (the second call from the remembered launches)."""
    src, expert, dst, send = _rows(3, 2, "balanced", 0)
    shape = _shape(3, 2, 1, layout, "expert", 4)
    build = plan_device.DevicePlanBuilder(**shape)
    for _ in range(2):
        plan = build(*(t.cuda() for t in (src, expert, dst)), send_counts=send.cuda())
        _assert_plan(plan, build_plan(src, expert, dst, send_counts=send, **shape))
