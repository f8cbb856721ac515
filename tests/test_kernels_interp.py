"""The overlap kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Behaviour only: the producer's output, its local rows in the own receive buffer (row_dst) and
its ready counters vs torch, in both layouts and visiting orders and with expert swizzle groups;
the consumer's copies and receive counters with the flags pre-set; the runner end to end on
loopback; and the bounded waits: a withheld flag (or a missing source) must raise
OverlapTimeoutError naming it. Shapes are tiny and the values small integers (exact in fp16);
fp16 and fp32 only (bf16 tl.dot gives garbage in the interpreter).

TRITON_INTERPRET must be set before triton and the kernels are imported: this module sets it
first. If triton was imported earlier in the same process (another test module), the
interpreter cannot be switched on any more; then the tests here are skipped and
test_interpreter_in_subprocess runs this file in a fresh interpreter process instead.
On a machine with CUDA the module is skipped: test_kernels_gpu.py covers the kernels there, and
switching the process to the interpreter would turn the GPU tests into interpreter runs.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETED = isinstance(triton.language.standard.cdiv, InterpretedFunction)
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED,
    reason="triton was imported before TRITON_INTERPRET=1 (see the subprocess test)",
)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter

import systems.overlap.kernels.consumer as consumer_mod  # noqa: E402
import systems.overlap.kernels.primitives as primitives_mod  # noqa: E402
import systems.overlap.kernels.producer as producer_mod  # noqa: E402

if INTERPRETED and not isinstance(producer_mod._producer_kernel, InterpretedFunction):
    importlib.reload(primitives_mod)
    producer_mod = importlib.reload(producer_mod)
    consumer_mod = importlib.reload(consumer_mod)
    importlib.reload(sys.modules["systems.overlap.kernels"])
    if "systems.overlap.runner" in sys.modules:
        importlib.reload(sys.modules["systems.overlap.runner"])

from systems.overlap.errors import (  # noqa: E402
    CODE_BAND_TIMEOUT,
    CODE_SIGNAL_TIMEOUT,
    OverlapTimeoutError,
    new_clock,
    new_error_buffer,
    raise_if_error,
    read_error,
)
from systems.overlap.kernels import launch_producer, launch_wait_signals  # noqa: E402
from systems.overlap.plan import padded_input  # noqa: E402
from systems.overlap.runner import OverlapRunner, run_consumer  # noqa: E402
from systems.overlap.transport import LoopbackFabric  # noqa: E402
from systems.overlap.tuning import (  # noqa: E402
    ConsumerConfig,
    interpreter_config,
    interpreter_consumer_config,
    shared_consumer_config,
)
from tests.overlap_testing import (  # noqa: E402
    expected_sends,
    local_rows,
    reference_y,
    rows_sent,
    synthetic_plan,
)

TILE_M = 16
# rows[e][s]: valid rows of local expert e from owner s; this rank is 2 (the local group).
# Expert 0: remote groups of 20 (pads to 32) and 16 rows, a local group of 5 (partial band);
# expert 1: one remote group of 33 rows (3 bands, last one 1 valid row), 18 local rows.
ROWS = [[20, 16, 5], [0, 33, 18]]
# rows[e][s] with mixed bands in the compact layout: expert 0's remote rows 20 + 7 fill 2 bands,
# the second holding both owners and the first local rows; expert 1's 3 + 33 fill 3.
MIXED_ROWS = [[20, 7, 5], [3, 33, 18]]


def _problem(dtype, K=40, N=80, mgb=2, seed=0, rows=ROWS, **knobs):
    """A plan of `rows` (this rank 2; knobs: layout, order, group_cap), its padded input X and
    weights. Small integers, so every product and sum is exact in fp16 and fp32."""
    g = torch.Generator().manual_seed(seed)
    plan = synthetic_plan(rows, rank=2, tile_m=TILE_M, mgb=mgb, **knobs)
    x_recv = torch.randint(-2, 3, (plan.n_rows, K), generator=g).to(dtype)
    w = torch.randint(-2, 3, (len(rows), K, N), generator=g).to(dtype)
    return plan, padded_input(x_recv, plan.gather_index), w


def _grouped(cap: int):
    """The interpreter's tile config with expert swizzle groups of at most cap (0: none)."""
    cfg = interpreter_config(TILE_M)
    return replace(cfg, expert_groups=True, group_m=cap) if cap else cfg


def _run_producer(plan, x, w, cfg, signal=True, recv=None, act=False):
    y = torch.full((plan.n_padded, w.shape[2]), float("nan"), dtype=x.dtype)
    ready = torch.zeros(plan.n_bands, dtype=torch.int32)
    launch_producer(
        x, w, y, plan, ready, num_programs=3, config=cfg, signal=signal, recv=recv, act=act
    )
    return y, ready


def _check_counters(plan, ready, inc):
    """One run's increment on every remote band's counter, local bands' untouched."""
    assert torch.all(ready[plan.schedule[: plan.n_remote_bands]] == inc)
    assert torch.all(ready[plan.schedule[plan.n_remote_bands :]] == 0)


@needs_interpreter
@pytest.mark.parametrize(
    "dtype,flag,split",
    [
        (torch.float16, "thread", 1),
        (torch.float32, "cta", 2),
        (torch.float16, "cta", 4),
        (torch.float16, "deferred", 4),
        (torch.float16, "deferred", 1),
        (torch.float16, "thread", 2),
    ],
)
def test_producer_matches_torch_and_counts_tiles(dtype, flag, split):
    plan, x, w = _problem(dtype)
    cfg = replace(interpreter_config(TILE_M), flag=flag, epi_split=split)
    y, ready = _run_producer(plan, x, w, cfg)
    assert not torch.isnan(y).any(), "every padded row must be written"
    assert torch.equal(y.float(), reference_y(plan, x, w))
    assert torch.count_nonzero(y[plan.gather_index < 0]) == 0  # zero rows of X give zeros
    _check_counters(plan, ready, cfg.band_increment(w.shape[2]))


@needs_interpreter
@pytest.mark.parametrize("cap", [1, 2, 8])
@pytest.mark.parametrize("order", ["remote_first", "expert"])
def test_producer_expert_groups_match_torch(cap, order):
    """Swizzle groups = runs of one expert (plan.groups, built for group_cap): every tile
    once, in either visiting order (plan.visit), flags too."""
    plan, x, w = _problem(torch.float16, order=order, group_cap=cap)
    assert plan.groups is not None and (plan.visit is None) == (order == "remote_first")
    cfg = replace(_grouped(cap), flag="deferred")
    y, ready = _run_producer(plan, x, w, cfg)
    assert not torch.isnan(y).any(), "every padded row must be written"
    assert torch.equal(y.float(), reference_y(plan, x, w))
    _check_counters(plan, ready, cfg.band_increment(w.shape[2]))


@needs_interpreter
@pytest.mark.parametrize("split", [1, 4])
def test_producer_with_gelu_is_the_layers_fc1(split):
    """act=True (the layer's fc1 on a GPU): gelu of the rounded product, every padded row."""
    plan, x, w = _problem(torch.float32)
    cfg = replace(interpreter_config(TILE_M), epi_split=split)
    y, ready = _run_producer(plan, x, w, cfg, signal=False, act=True)
    want = torch.nn.functional.gelu(reference_y(plan, x, w))
    assert torch.allclose(y.float(), want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(ready) == 0


@needs_interpreter
def test_producer_refuses_a_config_its_plan_cannot_run():
    plan, x, w = _problem(torch.float16)
    cfg = interpreter_config(TILE_M)
    for bad in (3, 8):
        with pytest.raises(ValueError, match="epi_split must be 1, 2 or 4"):
            _run_producer(plan, x, w, replace(cfg, epi_split=bad))
    with pytest.raises(ValueError, match="need a plan built with group_cap=2, got group_cap=0"):
        _run_producer(plan, x, w, _grouped(2))


@needs_interpreter
def test_producer_without_flags_leaves_counters():
    plan, x, w = _problem(torch.float16)
    y, ready = _run_producer(plan, x, w, interpreter_config(TILE_M), signal=False)
    assert torch.count_nonzero(ready) == 0
    assert torch.equal(y.float(), reference_y(plan, x, w))


@needs_interpreter
@pytest.mark.parametrize("layout", ["aligned", "compact"])
def test_producer_stores_local_rows_in_the_receive_buffer(layout):
    """recv: every local row (row_dst >= 0; in a compact plan also those of a mixed band) lands
    at its place in the own receive buffer and never in Y; every other row in Y."""
    plan, x, w = _problem(torch.float16, rows=MIXED_ROWS, layout=layout)
    recv = torch.full((60, w.shape[2]), float("nan"), dtype=x.dtype)
    y, _ = _run_producer(plan, x, w, interpreter_config(TILE_M), recv=recv)
    ref = reference_y(plan, x, w).to(x.dtype)
    loc = plan.row_dst >= 0
    assert int(loc.sum()) == plan.n_local == 23
    assert torch.equal(recv[plan.row_dst[loc]], ref[loc])
    assert torch.isnan(y[loc]).all() and torch.equal(y[~loc], ref[~loc])
    assert int((~recv.isnan().any(1)).sum()) == plan.n_local  # nothing else written there


#: the interpreter's consumer with a short time bound (the time-out tests)
SHORT = replace(interpreter_consumer_config(), timeout_s=0.3)


def _consume(plan, y, fabric, ready, target, cfg, ccta=2, wait=True):
    tr = fabric.transport(plan.rank)
    err = new_error_buffer("cpu")
    run_consumer(
        y,
        plan,
        ready,
        tr,
        err,
        new_clock(ccta, "cpu"),
        ready_target=target,
        rank=plan.rank,
        ccta=ccta,
        config=cfg,
        wait=wait,
    )
    return err


@needs_interpreter
@pytest.mark.parametrize(
    "mgb,ccta,layout", [(1, 1, "aligned"), (2, 3, "aligned"), (2, 2, "compact")]
)
def test_consumer_copies_valid_rows_with_flags_set(mgb, ccta, layout):
    rows = ROWS if layout == "aligned" else MIXED_ROWS
    plan = synthetic_plan(rows, rank=2, tile_m=TILE_M, mgb=mgb, dst_base=[3, 7, 0], layout=layout)
    N = 24
    y = torch.randn(plan.n_padded, N)
    fabric = LoopbackFabric(plan.dst_rows, N, y.dtype, "cpu")
    fabric.buffer.fill_(-7.0)  # poison: rows nobody sends must stay untouched
    before = [fabric.recv(d).clone() for d in range(3)]
    ready = torch.full((plan.n_bands,), 5, dtype=torch.int32)
    err = _consume(plan, y, fabric, ready, 5, interpreter_consumer_config(), ccta=ccta)
    raise_if_error(err)
    want = expected_sends(plan, y, before)
    for d in range(3):
        assert torch.equal(fabric.recv(d), want[d]), f"destination {d}"
    assert fabric.counters[:, plan.rank].tolist() == rows_sent(plan)
    assert fabric.counters[:, :2].abs().sum() == 0


@needs_interpreter
def test_consumer_timeout_names_the_segment_and_band():
    plan = synthetic_plan(ROWS, rank=2, tile_m=TILE_M, mgb=1)
    N = 16
    y = torch.randn(plan.n_padded, N)
    fabric = LoopbackFabric(plan.dst_rows, N, y.dtype, "cpu")
    ready = torch.full((plan.n_bands,), 4, dtype=torch.int32)
    seg = 2
    band = int(plan.schedule[int(plan.seg_start[seg])])
    ready[band] = 3  # withheld: one tile short
    t0 = time.monotonic()
    err = _consume(plan, y, fabric, ready, 4, SHORT, ccta=1)
    assert SHORT.timeout_s <= time.monotonic() - t0 < 30  # bounded by time, not a count
    rec = read_error(err)
    assert rec is not None and rec.code == CODE_BAND_TIMEOUT
    assert (rec.segment, rec.band, rec.rank, rec.seen, rec.want) == (seg, band, 2, 3, 4)
    with pytest.raises(OverlapTimeoutError, match=f"rank 2: segment {seg}, band {band}"):
        raise_if_error(err)
    # the segments before the withheld one were delivered
    first = int(plan.schedule[0])
    d, off, nv = (int(t[first]) for t in (plan.band_dst, plan.band_offset, plan.band_valid))
    r0 = int(plan.band_row[first])
    assert torch.equal(fabric.recv(d)[off : off + nv], y[r0 : r0 + nv])


@needs_interpreter
def test_compact_consumer_timeout_names_the_band_of_the_piece():
    """A compact plan's consumer waits on each piece's band: withholding a mixed band (two
    owners' pieces) times out at the first segment that holds one of its pieces."""
    plan = synthetic_plan(MIXED_ROWS, rank=2, tile_m=TILE_M, mgb=1, layout="compact")
    y = torch.randn(plan.n_padded, 16)
    fabric = LoopbackFabric(plan.dst_rows, 16, y.dtype, "cpu")
    ready = torch.full((plan.n_bands,), 4, dtype=torch.int32)
    seg_band = plan.piece_band[plan.seg_start].tolist()  # mgb=1: one piece a segment
    band = 1  # expert 0's second band: owners 0 and 1 (and local rows)
    assert seg_band.count(band) == 2 and seg_band.index(band) == 5
    ready[band] = 3
    err = _consume(plan, y, fabric, ready, 4, SHORT, ccta=1)
    rec = read_error(err)
    assert rec is not None and rec.code == CODE_BAND_TIMEOUT
    assert (rec.segment, rec.band, rec.seen, rec.want) == (5, band, 3, 4)


@needs_interpreter
def test_receiver_wait_times_out_naming_the_source():
    signal = torch.tensor([6, 0, 9], dtype=torch.int64)
    err = new_error_buffer("cpu")
    cfg = SHORT
    clock = new_clock(1, "cpu")
    launch_wait_signals(signal, torch.tensor([6, 4, 9]), err, clock, rank=5, config=cfg)
    rec = read_error(err)
    assert rec is not None and rec.code == CODE_SIGNAL_TIMEOUT and rec.source == 1
    assert rec.rank == 5 and (rec.seen, rec.want) == (0, 4)
    with pytest.raises(OverlapTimeoutError):
        raise_if_error(err)
    err.zero_()
    launch_wait_signals(signal, torch.tensor([6, 0, 9]), err, clock, rank=5, config=cfg)
    assert read_error(err) is None


def _runner(plan, w, fabric, ccta=2, tile=None, **kw):
    """An interpreter runner of `plan` on rank 2 of the loopback fabric (3 producer programs)."""
    return OverlapRunner(
        plan,
        w,
        fabric.transport(plan.rank),
        ccta=ccta,
        tile=tile or interpreter_config(TILE_M),
        consumer=interpreter_consumer_config(),
        num_programs=3,
        order=plan.order,
        **kw,
    )


def _delivered(plan, y, ref, fill=0.0):
    """What every destination buffer holds after one run: the remote rows y sent (pieces or
    bands), and this rank's local rows of ref [P, N] stored by the producer's epilogue."""
    base = [torch.full((n, y.shape[1]), fill, dtype=y.dtype) for n in plan.dst_rows]
    want = expected_sends(plan, y, base)
    local_src, local_dst = local_rows(plan)
    want[plan.rank][local_dst] = ref[local_src].to(y.dtype)
    return want


@needs_interpreter
def test_runner_loopback_end_to_end_and_epochs():
    plan, x, w = _problem(torch.float16, mgb=2)
    fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
    runner = _runner(plan, w, fabric)
    y = torch.zeros(plan.n_padded, w.shape[2], dtype=x.dtype)
    ref = reference_y(plan, x, w)
    for run in (1, 2):  # the second run must not need any reset (epoch values)
        fabric.buffer.zero_()
        runner.overlapped(x, y)  # no CUDA: runs the two kernels in sequence
        runner.check()
        want = _delivered(plan, y, ref)
        for d in range(3):
            assert torch.equal(fabric.recv(d), want[d])
        sent = torch.tensor(rows_sent(plan))
        assert torch.equal(fabric.counters[:, plan.rank], sent * run)
    loc = plan.row_dst >= 0
    assert plan.n_local > 0 and not y[loc].any(), "local rows never pass through Y"
    assert torch.equal(y[~loc].float(), ref[~loc])


@needs_interpreter
@pytest.mark.parametrize("mgb,ccta", [(1, 2), (2, 3)])
def test_runner_compact_delivers_what_aligned_delivers(mgb, ccta):
    """Producer + consumer on loopback, compact vs aligned plans of the same rows (mixed bands,
    whose local rows the epilogue stores): every destination buffer and the receive counters
    end up the same, over two runs."""
    bufs, counters = {}, {}
    for layout in ("aligned", "compact"):
        plan, x, w = _problem(torch.float16, N=48, mgb=mgb, seed=1, rows=MIXED_ROWS, layout=layout)
        fabric = LoopbackFabric(plan.dst_rows, 48, torch.float16, "cpu")
        runner = _runner(plan, w, fabric, ccta=ccta)
        y = torch.zeros(plan.n_padded, 48, dtype=torch.float16)
        for _ in range(2):
            fabric.buffer.fill_(float("nan"))  # poison: every row must be written again
            runner.overlapped(x, y)
            runner.check()
        want = _delivered(plan, y, reference_y(plan, x, w), fill=float("nan"))
        for d in range(3):
            assert not fabric.recv(d).isnan().any(), (layout, d)  # every row delivered
            assert torch.equal(fabric.recv(d), want[d]), (layout, d)
        bufs[layout], counters[layout] = fabric.buffer.clone(), fabric.counters.clone()
    aligned = synthetic_plan(MIXED_ROWS, rank=2, tile_m=TILE_M)
    compact = synthetic_plan(MIXED_ROWS, rank=2, tile_m=TILE_M, layout="compact")
    assert compact.n_padded == compact.n_rows < aligned.n_padded
    assert compact.n_bands < aligned.n_bands
    assert compact.piece_band.unique().numel() < compact.piece_band.numel()  # mixed bands
    assert torch.equal(bufs["compact"], bufs["aligned"])
    assert torch.equal(counters["compact"], counters["aligned"])
    assert counters["aligned"][:, 2].tolist() == [2 * 23, 2 * 40, 0]  # per run: 20 + 3, 7 + 33


@needs_interpreter
def test_expert_order_delivers_what_the_remote_first_order_delivers():
    """order="expert" (plan.visit) and its swizzle groups (plan.groups, group_cap 2) only change
    the order the producer visits the bands: every destination buffer, Y and the band counters
    end up the same."""
    out = {}
    for order, cap in (("remote_first", 0), ("expert", 0), ("expert", 2)):
        plan, x, w = _problem(torch.float16, mgb=2, order=order, group_cap=cap)
        if plan.visit is not None:  # this plan's visiting order differs from the schedule's
            assert not torch.equal(plan.visit, torch.arange(plan.n_bands))
        fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
        runner = _runner(plan, w, fabric, tile=_grouped(cap))
        y = torch.zeros(plan.n_padded, w.shape[2], dtype=x.dtype)
        runner.overlapped(x, y)
        runner.check()
        out[order, cap] = (fabric.buffer.clone(), y, runner.band_ready.clone())
    for key in (("expert", 0), ("expert", 2)):
        for a, b in zip(out["remote_first", 0], out[key]):
            assert torch.equal(a, b), key
    assert out["expert", 0][0].abs().sum() > 0
    with pytest.raises(ValueError, match="order 'remote_first': the plan was built for order="):
        OverlapRunner(plan, w, fabric.transport(2), ccta=2, num_programs=3, tile=_grouped(cap))
    with pytest.raises(ValueError, match="the tile's group_cap 0 != the plan's 2"):
        _runner(plan, w, fabric)


@needs_interpreter
def test_receive_counts_follow_a_routing_that_changes_between_runs():
    # a model calls one layer with a new routing in every MoE block: the rows a receiver waits
    # for are the sum of every run's recv_rows, not this run's times the number of runs
    plan, x, w = _problem(torch.float16, mgb=1)
    a = replace(plan, recv_rows=torch.tensor([3, 5, 7]))
    b = replace(plan, recv_rows=torch.tensor([1, 0, 9]))
    fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
    runner = _runner(a, w, fabric)
    y = torch.zeros(plan.n_padded, w.shape[2], dtype=x.dtype)
    runner.comm_only(y)
    runner.use_plan(b)
    runner.comm_only(y)
    remote = torch.tensor([1, 1, 0])  # rank 2's own rows come through the producer's epilogue
    assert torch.equal(runner.expected_signal(), (a.recv_rows + b.recv_rows) * remote)
    runner.use_plan(plan)  # a synthetic plan has no recv_rows: no expected counts
    with pytest.raises(ValueError, match="a plan without recv_rows"):
        runner.expected_signal()
    other = synthetic_plan(ROWS, rank=2, tile_m=TILE_M, order="expert")
    with pytest.raises(ValueError, match="use_plan: another rank, tile_m, order or group_cap"):
        runner.use_plan(other)


@needs_interpreter
def test_runner_consumer_sms_picks_the_small_consumer_and_checks_its_name():
    plan, x, w = _problem(torch.float16)
    fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
    t = fabric.transport(plan.rank)
    own = OverlapRunner(plan, w, t, ccta=2, num_programs=3)
    shared = OverlapRunner(plan, w, t, ccta=2, num_programs=3, consumer_sms="shared")
    assert own.consumer_sms == "own" and own.consumer == ConsumerConfig()
    assert shared.consumer == shared_consumer_config()
    # a consumer CTA that can sit next to a producer CTA: few warps, no shared memory
    assert shared.consumer.num_warps <= 4
    with pytest.raises(ValueError, match="^consumer_sms must be one of own, shared, got 'all'$"):
        OverlapRunner(plan, w, t, ccta=2, num_programs=3, consumer_sms="all")


@needs_interpreter
def test_shared_consumer_delivers_what_the_own_consumer_delivers():
    # consumer_sms="shared" changes where the consumer runs (and, on a GPU, its carve-out
    # request), not what it sends: every destination buffer ends up the same
    plan, x, w = _problem(torch.float16, mgb=2)
    bufs = {}
    for where in ("own", "shared"):
        fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
        runner = _runner(plan, w, fabric, consumer_sms=where)
        y = torch.zeros(plan.n_padded, w.shape[2], dtype=x.dtype)
        runner.overlapped(x, y)
        runner.check()
        bufs[where] = fabric.buffer.clone()
    assert torch.equal(bufs["own"], bufs["shared"]) and bufs["own"].abs().sum() > 0


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
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
