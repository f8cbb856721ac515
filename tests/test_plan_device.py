"""Stage A on the device (systems/overlap/plan_device.py) on the CPU through Triton's interpreter.

The device plan cut to its counts equals build_plan's field by field (aligned and compact, both
visiting orders, expert swizzle groups), entries past the counts are the -1 sentinel, building it
reads nothing back to the host, and the producer + consumer run from it (worst-case grids,
device counts, local rows into the receive buffer) equal the reference, with the plan changing
between runs.

TRITON_INTERPRET must be set before triton is imported: as in test_kernels_interp.py, this
module sets it, skips its interpreter tests when triton was imported earlier in the process, and
test_interpreter_in_subprocess then runs the file in a fresh process. Skipped on CUDA machines
(tests/test_kernels_gpu.py runs the device plan there).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import fields, replace

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip(
        "interpreter tests run on CPU-only machines; on a GPU the device-plan tests of "
        "test_kernels_gpu.py run the same kernels compiled",
        allow_module_level=True,
    )
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETED = isinstance(triton.language.standard.cdiv, InterpretedFunction)
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED,
    reason="triton was imported before TRITON_INTERPRET=1 (see the subprocess test)",
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
from harness.workload import WorkloadSpec  # noqa: E402
from systems.overlap.plan import (  # noqa: E402
    GROUP_CODE,
    CombinePlan,
    build_plan,
    producer_groups,
)
from systems.overlap.plan_device import (  # noqa: E402
    DevicePlanBuilder,
    build_plan_device,
    padded_input_device,
    plan_bounds,
)
from systems.overlap.runner import OverlapRunner  # noqa: E402
from systems.overlap.transport import LoopbackFabric  # noqa: E402
from systems.overlap.tuning import interpreter_config, interpreter_consumer_config  # noqa: E402
from tests.overlap_testing import (  # noqa: E402
    expected_sends,
    local_rows,
    plans_for_spec,
    reference_y,
    synthetic_rows,
)

# the arrays of each count (the -1 sentinel past it in a device plan)
BOUNDED = {
    "n_rows": ["row_pos"],
    "n_padded": ["gather_index", "row_dst"],
    "n_bands": ["band_expert", "band_row", "band_rows", "band_dst", "band_valid"]
    + ["band_offset", "schedule", "visit"],
    "n_segments": ["seg_start", "seg_count", "seg_dst"],
    "n_pieces": ["piece_band", "piece_row", "piece_rows", "piece_offset"],
}


def assert_same_plan(dev: CombinePlan, ref: CombinePlan) -> None:
    """dev (worst-case sized) cut to its counts == ref field by field, -1 past the counts, the
    swizzle groups past n_bands groups of one, every count within dev's bounds."""
    n = dev.sizes()
    assert n == ref.sizes()
    cut = dev.trimmed()
    for f in fields(CombinePlan):
        a, b = getattr(ref, f.name), getattr(cut, f.name)
        if isinstance(a, torch.Tensor):
            assert b is not None and b.dtype == a.dtype, f.name
            assert torch.equal(a, b), f.name
        else:
            assert a == b, f.name
    for count, names in BOUNDED.items():
        for name in names:
            t = getattr(dev, name)
            assert t is None or bool((t[n[count] :] == -1).all()), f"{name} past {count}"
    assert (dev.piece_band is None) == (dev.layout == "aligned")
    if dev.groups is not None:
        tail = dev.groups[n["n_bands"] :].long()
        assert torch.equal(tail // GROUP_CODE, torch.arange(n["n_bands"], dev.max_bands))
        assert bool((tail % GROUP_CODE == 1).all())
    bd = plan_bounds(
        dev.max_rows,
        world_size=dev.world_size,
        experts_per_rank=dev.experts_per_rank,
        tile_m=dev.tile_m,
        layout=dev.layout,
    )
    assert (dev.max_padded, dev.max_bands, dev.max_segments) == (
        bd["max_padded"], bd["max_bands"], bd["max_segments"]
    )  # fmt: skip
    for name, key in (("n_padded", "max_padded"), ("n_bands", "max_bands")):
        assert n[name] <= bd[key], name
    assert n["n_local"] <= n["n_rows"]
    for name in ("n_remote_bands", "n_segments", "n_pieces"):
        assert n[name] <= bd["max_" + name[2:]], name


def _kw(W, rank, E, tm, mgb, **knobs):
    shape = dict(world_size=W, rank=rank, experts_per_rank=E, tile_m=tm, mgb=mgb)
    return shape | dict(out_cols=24, elem_bytes=2) | knobs


def _knobs(seed: int, layout: str) -> dict:
    """A plan's layout with an order and group_cap taken from the case's seed (every pair
    occurs across the cases without multiplying them)."""
    return dict(layout=layout, order=ORDERS[seed % 2], group_cap=(0, 2, 5)[seed % 3])


ORDERS = ("remote_first", "expert")


@needs_interpreter
@pytest.mark.parametrize("layout", ["aligned", "compact"])
@pytest.mark.parametrize(
    "tm,mgb,routing", [(64, 1, "balanced"), (128, 2, "stress_skew"), (64, 2, "stress_skew")]
)
@pytest.mark.parametrize("W,E", [(1, 4), (2, 1), (2, 16), (4, 4), (8, 1), (8, 16)])
def test_device_plan_equals_build_plan(W, E, tm, mgb, routing, layout):
    seed = W * 1000 + E * 10 + tm + mgb
    spec = WorkloadSpec(
        tokens_per_rank=160 if E < 16 else 320,
        hidden=8,
        out=24,
        experts_per_rank=E,
        top_k=2,
        world_size=W,
        routing=routing,
        seed=seed,
        dtype="float16",
    )
    knobs = _knobs(seed, layout)
    plans, lays = plans_for_spec(spec, tile_m=tm, mgb=mgb, **knobs)
    rank = seed % W  # one rank per case (the stress routing's hot rank 0 is among them)
    lay, ref = lays[rank], plans[rank]
    dev = build_plan_device(
        lay.recv_src,
        lay.recv_expert,
        lay.recv_dst_index,
        send_counts=lay.send_counts,
        **_kw(W, rank, E, tm, mgb, **knobs),
    )
    assert_same_plan(dev, ref)


def _shuffled(W, E, max_rows, seed):
    """Expert-side rows in a random order with gaps in the owners' buffers (any-order input)."""
    g = torch.Generator().manual_seed(seed)
    cnt = torch.randint(0, max_rows + 1, (W, E), generator=g)
    cnt[torch.rand(W, E, generator=g) < 0.3] = 0
    per_src = cnt.sum(1)
    before = torch.randint(0, 50, (W,), generator=g)
    src = torch.repeat_interleave(torch.arange(W).repeat_interleave(E), cnt.reshape(-1))
    expert = torch.repeat_interleave(torch.arange(E).repeat(W), cnt.reshape(-1))
    first = torch.cumsum(per_src, 0) - per_src
    dst = before[src] + torch.arange(src.numel()) - first[src]
    perm = torch.randperm(src.numel(), generator=g)
    return src[perm], expert[perm], dst[perm]


@needs_interpreter
@pytest.mark.parametrize("layout", ["aligned", "compact"])
@pytest.mark.parametrize(
    "W,E,tm,mgb,seed",
    [(3, 5, 16, 2, 1), (4, 3, 8, 3, 2), (2, 7, 16, 1, 3), (8, 2, 4, 2, 4), (1, 3, 16, 2, 5)]
    + [(2, 70, 4, 2, 6)],
)
def test_device_plan_any_row_order_and_worst_case_inputs(W, E, tm, mgb, seed, layout):
    """Shuffled rows (runs of one group are short), int32 inputs, and the same rows at the
    front of a longer receive buffer whose first n_rows rows are real: all give build_plan's
    plan. E=70 takes the group kernels' pairwise sums over three chunks of experts (JB=32),
    with many experts tied on their remote bands."""
    src, expert, dst = _shuffled(W, E, 3 * tm, seed)
    kw = _kw(W, seed % W, E, tm, mgb, **_knobs(seed, layout))
    ref = build_plan(src, expert, dst, **kw)
    assert_same_plan(build_plan_device(src.int(), expert.int(), dst.int(), **kw), ref)
    R, extra = src.numel(), 37
    junk = torch.randint(0, W, (extra,))
    pad = [torch.cat([t, junk % m]) for t, m in ((src, W), (expert, E), (dst, 1000))]
    dev = build_plan_device(*pad, n_rows=torch.tensor(R), **kw)
    assert dev.max_rows == R + extra and dev.row_pos.numel() == R + extra
    assert_same_plan(dev, ref)


@needs_interpreter
@pytest.mark.parametrize("layout", ["aligned", "compact"])
def test_device_plan_of_empty_and_all_local_ranks(layout):
    e = torch.empty(0, dtype=torch.int64)
    kw = _kw(3, 1, 4, 64, 2, layout=layout, order="expert", group_cap=2)
    dev = build_plan_device(e, e, e, **kw)
    assert dev.counts.tolist() == [0] * 7
    assert_same_plan(dev, build_plan(e, e, e, **kw))
    src = torch.full((70,), 2)
    expert = torch.arange(70) % 3
    dst = torch.argsort(torch.argsort(expert, stable=True))  # consecutive within an expert
    kw = _kw(4, 2, 3, 16, 2, layout=layout, order="expert", group_cap=2)
    ref = build_plan(src, expert, dst, **kw)
    assert ref.n_remote_bands == 0 and ref.n_local == 70
    assert_same_plan(build_plan_device(src, expert, dst, **kw), ref)
    with pytest.raises(ValueError, match="layout must be one of aligned, compact, got 'packed'"):
        build_plan_device(src, expert, dst, **{**kw, "layout": "packed"})


def test_plan_bounds_cover_the_worst_case():
    """The bounds are reached: every row its own remote group pads a whole band."""
    W, E, tm = 4, 3, 16
    bd = plan_bounds(5, world_size=W, experts_per_rank=E, tile_m=tm)
    assert bd["max_padded"] == 5 * tm and bd["max_bands"] == 5 == bd["max_segments"]
    bd = plan_bounds(1000, world_size=W, experts_per_rank=E, tile_m=tm)
    assert bd["max_padded"] == 1000 + E * (W - 1) * (tm - 1)
    assert bd["max_bands"] == (1000 + E * W * (tm - 1)) // tm


def test_compact_plan_bounds_are_reached():
    """Compact: no padding; one row per owner of one expert gives one band of W-1 pieces."""
    from tests.overlap_testing import synthetic_plan

    W, tm = 4, 16
    plan = synthetic_plan([[1, 1, 1, 0]], rank=3, tile_m=tm, layout="compact")
    bd = plan_bounds(3, world_size=W, experts_per_rank=1, tile_m=tm, layout="compact")
    assert (plan.n_padded, plan.n_bands, plan.piece_band.numel()) == (3, 1, 3)
    assert bd["max_padded"] == 3 and bd["max_bands"] == 1 and bd["max_pieces"] == 3
    assert bd["max_segments"] == 3 == plan.n_segments
    bd = plan_bounds(1000, world_size=W, experts_per_rank=5, tile_m=tm, layout="compact")
    assert bd["max_bands"] == (1000 + 5 * (tm - 1)) // tm == bd["max_remote_bands"]
    assert bd["max_pieces"] == bd["max_bands"] + 5 * (W - 1)


class _FakeKernel:
    """Stands in for a Triton kernel: records launches (grid, args)."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append((self.name, grid, args, kw))

        return launch


@pytest.mark.parametrize("layout,cap", [("aligned", 0), ("compact", 2)])
def test_build_plan_device_reads_nothing_back(monkeypatch, layout, cap):
    """No host synchronisation and few launches: with the kernels stubbed, the host glue runs no
    aten op that reads a tensor's value on the host (_local_scalar_dense is behind item(),
    int(), bool(), tolist() of device tensors), no copy, and only the fill, the work
    allocation (and the swizzle groups' buffer); tolist / item / numpy / int / bool / index of
    a tensor raise."""
    from torch.utils._python_dispatch import TorchDispatchMode

    log = []
    kernels = ["_rows_kernel", "_fill_kernel"]  # the groups in their last programs
    for name in kernels:
        monkeypatch.setattr(plan_device.kplan, name, _FakeKernel(log, name))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    W, E, tm = 4, 5, 16
    src, expert, dst = _shuffled(W, E, 40, 7)
    n_rows = torch.tensor(src.numel())
    send_counts = torch.ones(W, dtype=torch.int64)

    def boom(*a, **k):
        raise AssertionError("host read of a tensor value")

    kw = _kw(W, 1, E, tm, 2, layout=layout, order="expert", group_cap=cap)
    with monkeypatch.context() as m:
        for meth in ("tolist", "item", "numpy", "__int__", "__bool__", "__index__", "__float__"):
            m.setattr(torch.Tensor, meth, boom)
        with Ops() as mode:
            plan = build_plan_device(src, expert, dst, send_counts=send_counts, n_rows=n_rows, **kw)
    assert [x[0] for x in log] == kernels
    views = {"aten.slice", "aten.view", "aten.reshape", "aten.alias", "aten.select"}
    compute = [op for op in mode.ops if op not in views]
    assert sorted(compute) == ["aten.empty"] + ["aten.full"] * (2 if cap else 1), mode.ops
    assert plan.counts.shape == (7,) and plan.n_bands.dim() == 0
    # the launch grids are host ints from the bounds
    grids = {x[0]: x[1] for x in log}
    n_blocks = triton.cdiv(src.numel(), plan_device.ROW_BLOCK)
    fill_programs = E * W + n_blocks + (E if layout == "compact" else 0)
    want = [(n_blocks,), (fill_programs,)]
    assert grids == dict(zip(kernels, want))


# -- stage B from a device plan (interpreter) ----------------------------------------------
TILE_M = 16


def _tile(cap: int):
    cfg = interpreter_config(TILE_M)
    return replace(cfg, expert_groups=True, group_m=cap) if cap else cfg


def _check_run(runner, fabric, ref, x, w, y):
    """One overlapped run of `plan` (device-built, its host twin ref) against the reference:
    Y's non-local rows, every destination buffer (the local rows from the producer's
    epilogue), Y untouched at local rows and past n_padded, and the band counters re-armed:
    this plan's remote bands at one run's increment, nothing else."""
    P, N = ref.n_padded, w.shape[2]
    y.fill_(float("nan"))
    fabric.buffer.zero_()
    runner.overlapped(x, y)
    runner.check()
    ref_y = reference_y(ref, x[:P], w)
    in_y = ref.row_dst < 0
    torch.testing.assert_close(y[:P][in_y], ref_y[in_y], rtol=1e-4, atol=1e-4)
    assert bool(torch.isnan(y[:P][~in_y]).all()), "local rows skip Y"
    assert bool(torch.isnan(y[P:]).all()), "rows past n_padded must stay untouched"
    want = expected_sends(ref, y, [torch.zeros_like(fabric.recv(d)) for d in range(3)])
    local_src, local_dst = local_rows(ref)
    want[2][local_dst] = ref_y[local_src]
    for d in range(3):
        torch.testing.assert_close(fabric.recv(d), want[d], rtol=1e-4, atol=1e-4)
    # a stale count from an earlier plan would let the consumer copy a band too early
    ready = torch.zeros_like(runner.band_ready)
    ready[ref.schedule[: ref.n_remote_bands]] = runner.tile.band_increment(N)
    assert torch.equal(runner.band_ready, ready)


def _runner(plan, w, fabric, cap):
    return OverlapRunner(
        plan,
        w,
        fabric.transport(2),
        ccta=2,
        tile=_tile(cap),
        consumer=interpreter_consumer_config(),
        num_programs=3,
        order=plan.order,
    )


@needs_interpreter
@pytest.mark.parametrize(
    "order,layout,cap", [("remote_first", "aligned", 0), ("expert", "aligned", 2)]
    + [("expert", "compact", 0), ("remote_first", "compact", 2)],
)  # fmt: skip
def test_runner_from_device_plans_on_loopback(order, layout, cap):
    """Producer (worst-case grid, device band counts, the plan's visit and groups) + consumer
    (device segment count) from device-built plans; the plan changes between runs
    (use_plan), so the band counters must be re-armed every run. (On the CPU the kernels run
    one after the other, so a stale counter cannot change the copies here: the counters are
    checked directly.) compact: mixed bands, pieces walked with device counts."""
    K, N = 24, 40
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, K, N, generator=g) / K**0.5
    cases = [[[20, 16, 5], [0, 33, 18]], [[3, 40, 17], [18, 0, 0]]]
    kw = _kw(3, 2, 2, TILE_M, 2, layout=layout, order=order, group_cap=cap) | {"elem_bytes": 4}
    fabric = LoopbackFabric([200] * 3, N, torch.float32, "cpu")
    runner = None
    for rows in cases:
        src, expert, dst, _ = synthetic_rows(rows, rank=2)
        ref = build_plan(src, expert, dst, **kw | {"out_cols": N})
        dev = build_plan_device(src, expert, dst, **kw | {"out_cols": N})
        x_recv = torch.randn(ref.n_rows, K, generator=g)
        x = padded_input_device(x_recv, dev)
        want_x = x_recv.new_zeros(ref.n_padded, K)
        want_x[ref.row_pos] = x_recv
        assert torch.equal(x[: ref.n_padded], want_x)
        if runner is None:
            runner = _runner(dev, w, fabric, cap)
        else:
            runner.use_plan(dev)
        _check_run(runner, fabric, ref, x, w, torch.empty(dev.max_padded, N))


@needs_interpreter
@pytest.mark.parametrize(
    "order,layout,cap", [("expert", "aligned", 2), ("remote_first", "compact", 0)]
)
def test_builder_rewrites_one_plan_and_the_runner_follows_it(order, layout, cap):
    """DevicePlanBuilder (a layer's stage A on every step): routings with the same row count
    give the SAME plan object, each call's contents build_plan's (the -1 sentinels restored),
    padded_input padded_input_device's rows in one buffer; a runner given that object again
    keeps its plan_version and runs each step's plan right; another row count gives a new
    plan object (plan_version moves)."""
    K, N = 24, 40
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, K, N, generator=g) / K**0.5
    cases = [  # [expert][owner] rows; 92 rows each but the last (78)
        [[20, 16, 5], [0, 33, 18]],
        [[3, 40, 17], [18, 0, 14]],
        [[3, 40, 17], [18, 0, 0]],
    ]
    kw = _kw(3, 2, 2, TILE_M, 2, layout=layout, order=order, group_cap=cap)
    kw |= dict(out_cols=N, elem_bytes=4)
    fabric = LoopbackFabric([200] * 3, N, torch.float32, "cpu")
    build = DevicePlanBuilder(**kw)
    runner = first = prev_x = None
    for i, rows in enumerate(cases):
        src, expert, dst, _ = synthetic_rows(rows, rank=2)
        send = torch.tensor([7 + i, 11, 5])
        ref = build_plan(src, expert, dst, send_counts=send, **kw)
        plan = build(src, expert, dst, send_counts=send)
        assert_same_plan(plan, ref)
        assert (plan is first) == (i == 1), f"step {i}: one plan object per row count"
        first = first or plan
        x_recv = torch.randn(ref.n_rows, K, generator=g)
        P = ref.n_padded
        tokens = torch.randn(ref.n_rows + 5, K, generator=g)  # rows gathered from the tokens
        where = torch.randperm(ref.n_rows + 5, generator=g)[: ref.n_rows]
        x = build.padded_input(tokens, rows=where)
        assert torch.equal(x[:P], padded_input_device(tokens[where], plan)[:P])
        x = build.padded_input(x_recv)
        assert torch.equal(x[:P], padded_input_device(x_recv, plan)[:P])
        assert (x is prev_x) == (i == 1), f"step {i}: one input buffer per row count"
        prev_x = x
        runner = runner or _runner(plan, w, fabric, cap)
        version = runner.plan_version
        runner.use_plan(plan)
        assert (runner.plan_version == version) == (i < 2), f"step {i}: a new plan object"
        assert torch.equal(runner.recv_step, send * torch.tensor([1, 1, 0]))
        _check_run(runner, fabric, ref, x, w, torch.empty(plan.max_padded, N))


@pytest.mark.skipif(INTERPRETED, reason="this process runs the interpreter tests itself")
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
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@triton.jit
def _producer_groups_kernel(
    visit, schedule, band_expert, counts, groups, B, cap,
    CODE: tl.constexpr, ORDERED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """kernels/plan.py's _producer_groups_body alone in ONE program (any BLOCK)."""
    kplan_mod._producer_groups_body(
        visit, schedule, band_expert, counts, groups, B, cap, CODE, ORDERED, BLOCK
    )


@needs_interpreter
@pytest.mark.parametrize("block", [2, 4, 64])
@pytest.mark.parametrize("cap", [1, 3, 8])
def test_producer_groups_kernel_carries_runs_across_its_blocks(block, cap):
    """The one-launch swizzle groups == plan.producer_groups over blocks of 2-64 positions
    (runs of 7, 1, 12, 2 bands in a shuffled schedule; the builder's block covers up to 1024
    positions, so the carries across blocks only show with small blocks)."""
    from types import SimpleNamespace

    experts = [3] * 7 + [0] + [2] * 12 + [1] * 2
    B = len(experts)
    g = torch.Generator().manual_seed(cap)
    sched = torch.randperm(B, generator=g)
    band_expert = torch.empty(B, dtype=torch.int64)
    band_expert[sched] = torch.tensor(experts)  # visiting position v reads expert experts[v]
    counts = torch.tensor([0, 0, B, 0, 0, 0, 0])
    plan = SimpleNamespace(schedule=sched, band_expert=band_expert, n_bands=counts[2])
    visit = torch.randperm(B, generator=g)
    for v in (None, visit):
        out = torch.full((B,), -1, dtype=torch.int32)
        _producer_groups_kernel[(1,)](
            sched if v is None else v, sched, band_expert, counts, out, B, cap,
            CODE=GROUP_CODE, ORDERED=v is not None, BLOCK=block,
        )  # fmt: skip
        assert torch.equal(out, producer_groups(plan, v, cap)), "visit" if v is not None else ""
