"""The overlap kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Behaviour only: the producer's output and ready counters vs torch, the consumer's copies and
receive counters with the flags pre-set, the runner end to end on loopback, and the bounded
waits: a withheld flag (or a missing source) must raise OverlapTimeoutError naming it.
Shapes are tiny; fp16 and fp32 only (bf16 tl.dot gives garbage in the interpreter).

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
    new_error_buffer,
    raise_if_error,
    read_error,
)
from systems.overlap.kernels import (  # noqa: E402
    interpreter_config,
    interpreter_consumer_config,
    launch_consumer,
    launch_producer,
    launch_wait_signals,
)
from systems.overlap.plan import (  # noqa: E402
    padded_input,
    producer_order,
    split_groups,
    split_tail_bands,
)
from systems.overlap.runner import OverlapRunner  # noqa: E402
from tests.overlap_testing import (  # noqa: E402
    expected_sends,
    reference_y,
    rows_sent,
    synthetic_plan,
)
from systems.overlap.transport import LoopbackFabric  # noqa: E402

TILE_M = 16
# rows[e][s]: valid rows of local expert e from owner s; this rank is 2 (the local group).
# Expert 0: remote groups of 20 (pads to 32) and 16 rows, a local group of 5 (partial band);
# expert 1: one remote group of 33 rows (3 bands, last one 1 valid row), 18 local rows.
ROWS = [[20, 16, 5], [0, 33, 18]]


def _problem(dtype, K=40, N=80, mgb=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    plan = synthetic_plan(ROWS, rank=2, tile_m=TILE_M, mgb=mgb)
    x_recv = torch.randn(plan.n_rows, K, generator=g).to(dtype)
    w = (torch.randn(len(ROWS), K, N, generator=g) / K**0.5).to(dtype)
    return plan, padded_input(x_recv, plan.gather_index), w


def _run_producer(plan, x, w, cfg, signal=True):
    y = torch.full((plan.n_padded, w.shape[2]), float("nan"), dtype=x.dtype)
    ready = torch.zeros(plan.n_bands, dtype=torch.int32)
    launch_producer(
        x,
        w,
        y,
        plan,
        ready,
        num_programs=3,
        config=cfg,
        signal=signal,
    )
    return y, ready


@needs_interpreter
@pytest.mark.parametrize(
    "dtype,flag",
    [
        (torch.float16, "thread"),
        (torch.float32, "cta"),
        (torch.float16, "cta"),
        (torch.float16, "deferred"),
        (torch.float16, "mid"),
    ],
)
@pytest.mark.parametrize("split", [1, 2, 4])
def test_producer_matches_torch_and_counts_tiles(dtype, flag, split):
    plan, x, w = _problem(dtype)
    cfg = interpreter_config(TILE_M)
    cfg = type(cfg)(**{**cfg.__dict__, "flag": flag, "epi_split": split})
    y, ready = _run_producer(plan, x, w, cfg)
    ref = reference_y(plan, x, w)
    assert not torch.isnan(y).any(), "every padded row must be written"
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)
    # padding rows of X are zero, so their outputs are zero
    pad = plan.gather_index < 0
    assert torch.count_nonzero(y[pad]) == 0
    remote = plan.schedule[: plan.n_remote_bands]
    local = plan.schedule[plan.n_remote_bands :]
    assert torch.all(ready[remote] == cfg.band_increment(w.shape[2]))
    assert torch.all(ready[local] == 0)


@needs_interpreter
@pytest.mark.parametrize("cap", [1, 2, 8])
@pytest.mark.parametrize("ordered", [False, True])
def test_producer_expert_groups_match_torch(cap, ordered):
    """Swizzle groups = runs of one expert (plan.producer_groups): every tile once, flags too."""
    plan, x, w = _problem(torch.float16)
    cfg = interpreter_config(TILE_M)
    cfg = type(cfg)(**{**cfg.__dict__, "flag": "deferred", "expert_groups": True, "group_m": cap})
    y = torch.full((plan.n_padded, w.shape[2]), float("nan"), dtype=x.dtype)
    ready = torch.zeros(plan.n_bands, dtype=torch.int32)
    order = producer_order(plan) if ordered else None
    launch_producer(x, w, y, plan, ready, num_programs=3, config=cfg, order=order)
    assert not torch.isnan(y).any(), "every padded row must be written"
    torch.testing.assert_close(y.float(), reference_y(plan, x, w), rtol=2e-2, atol=2e-2)
    remote = plan.schedule[: plan.n_remote_bands]
    assert torch.all(ready[remote] == cfg.band_increment(w.shape[2]))
    assert torch.all(ready[plan.schedule[plan.n_remote_bands :]] == 0)


@needs_interpreter
@pytest.mark.parametrize("layout", ["aligned", "compact"])
def test_producer_split_in_two_launches_matches_torch(layout):
    """plan.split_tail_bands: the bands of > 8 rows with 16-row tiles, then the bands of <= 8
    rows with 8-row tiles (experiments/producer.py TAIL_CONFIGS): every valid row right, every
    signalled band's counter at one run's increment, the unsignalled ones untouched."""
    plan = synthetic_plan(MIXED_ROWS, rank=2, tile_m=TILE_M, mgb=2, layout=layout)
    g = torch.Generator().manual_seed(2)
    x = padded_input(torch.randn(plan.n_rows, 40, generator=g).half(), plan.gather_index)
    w = (torch.randn(2, 40, 48, generator=g) / 40**0.5).half()
    y = torch.full((plan.n_padded, 48), float("nan"), dtype=x.dtype)
    ready = torch.zeros(plan.n_bands, dtype=torch.int32)
    main, tail = split_tail_bands(plan, producer_order(plan), TILE_M // 2)
    assert main is not None and tail is not None
    cfgs = [interpreter_config(TILE_M), interpreter_config(TILE_M // 2)]
    for (sub, vis), cfg in zip((main, tail), cfgs):
        cfg = replace(cfg, flag="deferred", expert_groups=True, group_m=2)
        groups = split_groups(sub, vis, 2)
        launch_producer(x, w, y, sub, ready, num_programs=3, config=cfg, order=vis, groups=groups)
    valid = plan.gather_index >= 0
    ref = reference_y(plan, x, w)
    torch.testing.assert_close(y[valid].float(), ref[valid], rtol=2e-2, atol=2e-2)
    inc = cfgs[0].band_increment(48)
    assert inc == cfgs[1].band_increment(48)  # same warps: one increment for every band
    assert torch.all(ready[plan.schedule[: plan.n_remote_bands]] == inc)
    assert torch.all(ready[plan.schedule[plan.n_remote_bands :]] == 0)


@needs_interpreter
def test_producer_refuses_an_epilogue_split_it_cannot_run():
    plan, x, w = _problem(torch.float16)
    cfg = interpreter_config(TILE_M)
    for bad in (3, 8):
        with pytest.raises(ValueError, match="epi_split must be 1, 2 or 4"):
            _run_producer(plan, x, w, type(cfg)(**{**cfg.__dict__, "epi_split": bad}))


@needs_interpreter
def test_producer_without_flags_leaves_counters():
    plan, x, w = _problem(torch.float16)
    y, ready = _run_producer(plan, x, w, interpreter_config(TILE_M), signal=False)
    assert torch.count_nonzero(ready) == 0
    torch.testing.assert_close(y.float(), reference_y(plan, x, w), rtol=2e-2, atol=2e-2)


def _consume(plan, y, fabric, ready, target, cfg, ccta=2, wait=True):
    tr = fabric.transport(plan.rank)
    err = new_error_buffer("cpu")
    launch_consumer(
        y,
        plan,
        ready,
        tr.recv_ptrs,
        tr.signal_ptrs,
        err,
        torch.zeros(ccta, dtype=torch.int64),
        ready_target=target,
        rank=plan.rank,
        ccta=ccta,
        config=cfg,
        wait=wait,
        scope=tr.scope,
    )
    return err


@needs_interpreter
@pytest.mark.parametrize("mgb,ccta", [(1, 1), (2, 3)])
def test_consumer_copies_valid_rows_with_flags_set(mgb, ccta):
    plan = synthetic_plan(ROWS, rank=2, tile_m=TILE_M, mgb=mgb, dst_base=[3, 7, 0])
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
    cfg = interpreter_consumer_config()
    err = _consume(plan, y, fabric, ready, 4, cfg, ccta=1)
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
def test_receiver_wait_times_out_naming_the_source():
    signal = torch.tensor([6, 0, 9], dtype=torch.int64)
    err = new_error_buffer("cpu")
    cfg = interpreter_consumer_config()
    launch_wait_signals(
        signal, torch.tensor([6, 4, 9]), err, torch.zeros(1, dtype=torch.int64), rank=5, config=cfg
    )
    rec = read_error(err)
    assert rec is not None and rec.code == CODE_SIGNAL_TIMEOUT and rec.source == 1
    assert rec.rank == 5 and (rec.seen, rec.want) == (0, 4)
    err.zero_()
    launch_wait_signals(
        signal, torch.tensor([6, 0, 9]), err, torch.zeros(1, dtype=torch.int64), rank=5, config=cfg
    )
    assert read_error(err) is None


@needs_interpreter
def test_runner_loopback_end_to_end_and_epochs():
    plan, x, w = _problem(torch.float16, mgb=2)
    fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
    runner = OverlapRunner(
        plan,
        w,
        fabric.transport(plan.rank),
        ccta=2,
        tile=interpreter_config(TILE_M),
        consumer=interpreter_consumer_config(),
        num_programs=3,
    )
    y = torch.empty(plan.n_padded, w.shape[2], dtype=x.dtype)
    for run in (1, 2):  # the second run must not need any reset (epoch values)
        fabric.buffer.zero_()
        runner.overlapped(x, y)  # no CUDA: runs the two kernels in sequence
        runner.check()
        runner.local_copy(y)
        want = expected_sends(plan, y, [torch.zeros_like(fabric.recv(d)) for d in range(3)])
        loc_src, loc_dst = plan.local_src_row, plan.local_dst_index
        want[plan.rank][loc_dst] = y[loc_src]
        for d in range(3):
            assert torch.equal(fabric.recv(d), want[d])
        sent = torch.tensor(rows_sent(plan))
        assert torch.equal(fabric.counters[:, plan.rank], sent * run)
        assert torch.equal(runner.expected_signal(sent), sent * run)
    torch.testing.assert_close(y.float(), reference_y(plan, x, w), rtol=2e-2, atol=2e-2)


@needs_interpreter
@pytest.mark.parametrize("mgb", [1, 2])
def test_local_rows_stored_by_the_epilogue_equal_the_local_copy(mgb):
    # local=direct: the producer stores local rows in the own receive buffer itself; every
    # destination buffer must end up as with the producer + local copy, and Y's local rows
    # are never written (the copy left the critical path)
    plan, x, w = _problem(torch.float16, mgb=mgb)
    assert plan.n_local > 0
    bufs, ys = {}, {}
    for direct in (False, True):
        fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
        runner = OverlapRunner(
            plan,
            w,
            fabric.transport(plan.rank),
            ccta=2,
            tile=interpreter_config(TILE_M),
            consumer=interpreter_consumer_config(),
            num_programs=3,
            local_direct=direct,
        )
        y = torch.zeros(plan.n_padded, w.shape[2], dtype=x.dtype)
        runner.overlapped(x, y)
        runner.check()
        runner.local_copy(y)
        bufs[direct], ys[direct] = fabric.buffer.clone(), y
    assert torch.equal(bufs[True], bufs[False])
    assert bufs[False].abs().sum() > 0
    assert not ys[True][plan.local_src_row].any()  # never stored in Y
    assert ys[False][plan.local_src_row].any()


@needs_interpreter
@pytest.mark.parametrize("direct", [False, True])
def test_expert_order_delivers_what_the_remote_first_order_delivers(direct):
    # order="expert" only changes the order the producer visits the bands: every destination
    # buffer, Y and the band counters must end up the same
    # (and "expert+groups": that order with the swizzle groups of one expert, at most 2 long)
    plan, x, w = _problem(torch.float16, mgb=2)
    out = {}
    grouped = replace(interpreter_config(TILE_M), expert_groups=True, group_m=2)
    for name in ("remote_first", "expert", "expert+groups"):
        order = name.split("+")[0]
        fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
        runner = OverlapRunner(
            plan,
            w,
            fabric.transport(plan.rank),
            ccta=2,
            tile=grouped if name.endswith("groups") else interpreter_config(TILE_M),
            consumer=interpreter_consumer_config(),
            num_programs=3,
            local_direct=direct,
            order=order,
        )
        assert (runner.groups is None) == (name != "expert+groups")
        assert (runner.visit is None) == (order == "remote_first")
        if runner.visit is not None:  # this plan's order differs from the schedule's
            assert not torch.equal(runner.visit.long(), torch.arange(plan.n_bands))
        y = torch.zeros(plan.n_padded, w.shape[2], dtype=x.dtype)
        runner.overlapped(x, y)
        runner.check()
        runner.local_copy(y)
        out[name] = (fabric.buffer.clone(), y, runner.band_ready.clone())
    for name in ("expert", "expert+groups"):
        for a, b in zip(out["remote_first"], out[name]):
            assert torch.equal(a, b), name
    assert out["expert"][0].abs().sum() > 0
    with pytest.raises(ValueError, match="order must be one of"):
        OverlapRunner(plan, w, fabric.transport(plan.rank), ccta=2, num_programs=3, order="x")


@needs_interpreter
def test_receive_counts_follow_a_routing_that_changes_between_runs():
    # a model calls one layer with a new routing in every MoE block: the rows a receiver waits
    # for are the sum of every run's recv_rows, not this run's times the number of runs
    import dataclasses

    plan, x, w = _problem(torch.float16, mgb=1)
    a = dataclasses.replace(plan, recv_rows=torch.tensor([3, 5, 7]))
    b = dataclasses.replace(plan, recv_rows=torch.tensor([1, 0, 9]))
    fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
    runner = OverlapRunner(
        a,
        w,
        fabric.transport(plan.rank),
        ccta=2,
        tile=interpreter_config(TILE_M),
        consumer=interpreter_consumer_config(),
        num_programs=3,
    )
    y = torch.zeros(plan.n_padded, w.shape[2], dtype=x.dtype)
    runner.comm_only(y)
    runner.use_plan(b)
    runner.comm_only(y)
    remote = torch.tensor([1, 1, 0])  # rank 2's own rows come by the local copy
    assert torch.equal(runner.expected_signal(), (a.recv_rows + b.recv_rows) * remote)
    runner.reset()
    assert torch.equal(runner.expected_signal(), torch.zeros(3, dtype=torch.int64))
    runner.use_plan(plan)  # a synthetic plan has no recv_rows: the caller must say the rows
    with pytest.raises(ValueError, match="needs rows_from"):
        runner.expected_signal()


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


def test_nvshmem_module_init_follows_the_put_mode(monkeypatch):
    """The consumer's NVSHMEM launch and its PUT_STORE launch compile the same function: torch's
    registry (by kernel name) must hold it only while an NVSHMEM put mode launches."""

    class Registry:
        names: set = set()

        @classmethod
        def register(cls, name):
            cls.names.add(name)

        @classmethod
        def deregister(cls, name):
            cls.names.discard(name)

    name = consumer_mod._consumer_kernel.fn.__name__
    monkeypatch.setattr(consumer_mod, "_nvshmem_registry", None)
    consumer_mod._nvshmem_module_init(False)  # before any NVSHMEM launch: nothing to do
    monkeypatch.setattr(consumer_mod, "_nvshmem_registry", Registry)
    consumer_mod._nvshmem_module_init(True)
    assert Registry.names == {name}
    consumer_mod._nvshmem_module_init(False)
    assert Registry.names == set()


# rows[e][s] with mixed bands in the packed layout (tile_m 16, this rank 2): expert 0's remote
# rows 20 + 7 pack into 2 bands, the second holding both owners; expert 1's 3 + 33 into 3.
MIXED_ROWS = [[20, 7, 5], [3, 33, 18]]


@needs_interpreter
@pytest.mark.parametrize("mgb,ccta,local", [(1, 2, "copy"), (2, 3, "copy"), (1, 2, "direct")])
def test_runner_packed_delivers_what_aligned_delivers(mgb, ccta, local):
    # producer + consumer on loopback, packed and compact vs aligned plans of the same rows:
    # every destination buffer and the receive counters must end up the same, over two runs
    # (compact: mixed bands, whose local rows the producer's epilogue stores at local=direct)
    g = torch.Generator().manual_seed(1)
    K, N = 40, 48
    rows = sum(map(sum, MIXED_ROWS))
    x_recv = torch.randint(-2, 3, (rows, K), generator=g).half()
    w = torch.randint(-2, 3, (2, K, N), generator=g).half()
    bufs, counters = {}, {}
    for layout in ("aligned", "packed", "compact"):
        plan = synthetic_plan(MIXED_ROWS, rank=2, tile_m=TILE_M, mgb=mgb, layout=layout)
        fabric = LoopbackFabric(plan.dst_rows, N, torch.float16, "cpu")
        runner = OverlapRunner(
            plan,
            w,
            fabric.transport(plan.rank),
            ccta=ccta,
            tile=interpreter_config(TILE_M),
            consumer=interpreter_consumer_config(),
            num_programs=3,
            local_direct=local == "direct",
        )
        x = padded_input(x_recv, plan.gather_index)
        y = torch.zeros(plan.n_padded, N, dtype=torch.float16)
        for _ in range(2):
            fabric.buffer.fill_(float("nan"))  # poison: every row must be written again
            runner.overlapped(x, y)
            runner.check()
            runner.local_copy(y)
        bufs[layout], counters[layout] = fabric.buffer.clone(), fabric.counters.clone()
        want = expected_sends(
            plan, y, [torch.full_like(fabric.recv(d), float("nan")) for d in range(3)]
        )
        ref = reference_y(plan, x, w).half()  # exact: small integers
        want[2][plan.local_dst_index] = ref[plan.local_src_row]  # local=direct leaves Y's
        for d in range(3):
            assert not fabric.recv(d).isnan().any(), (layout, d)  # every row delivered
            assert torch.equal(fabric.recv(d), want[d]), (layout, d)
    packed = synthetic_plan(MIXED_ROWS, rank=2, tile_m=TILE_M, layout="packed")
    assert packed.n_padding < synthetic_plan(MIXED_ROWS, rank=2, tile_m=TILE_M).n_padding
    assert packed.piece_band.unique().numel() < packed.piece_band.numel()  # mixed bands
    compact = synthetic_plan(MIXED_ROWS, rank=2, tile_m=TILE_M, layout="compact")
    assert compact.n_padding == 0 and compact.n_bands < packed.n_bands
    for layout in ("packed", "compact"):
        assert torch.equal(bufs[layout], bufs["aligned"]), layout
        assert torch.equal(counters[layout], counters["aligned"]), layout
    assert counters["aligned"][:, 2].tolist() == [2 * 23, 2 * 40, 0]  # per run: 20 + 3, 7 + 33


@needs_interpreter
def test_packed_consumer_timeout_names_the_band_of_the_piece():
    plan = synthetic_plan(MIXED_ROWS, rank=2, tile_m=TILE_M, mgb=1, layout="packed")
    y = torch.randn(plan.n_padded, 16)
    fabric = LoopbackFabric(plan.dst_rows, 16, y.dtype, "cpu")
    ready = torch.full((plan.n_bands,), 4, dtype=torch.int32)
    seg = 6  # the mixed band's second piece (owner 1): band 1
    band = int(plan.piece_band[int(plan.seg_start[seg])])
    assert band == 1 and int(plan.piece_band[int(plan.seg_start[seg - 1])]) == 1
    ready[band] = 3
    err = _consume(plan, y, fabric, ready, 4, interpreter_consumer_config(), ccta=1)
    rec = read_error(err)
    assert rec is not None and rec.code == CODE_BAND_TIMEOUT
    assert (rec.segment, rec.band, rec.seen, rec.want) == (5, band, 3, 4)  # the first to wait


@needs_interpreter
def test_runner_consumer_sms_picks_the_small_consumer_and_checks_its_name():
    from systems.overlap.kernels import ConsumerConfig, shared_consumer_config

    plan, x, w = _problem(torch.float16)
    fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
    t = fabric.transport(plan.rank)
    own = OverlapRunner(plan, w, t, ccta=2, num_programs=3)
    shared = OverlapRunner(plan, w, t, ccta=2, num_programs=3, consumer_sms="shared")
    assert own.consumer_sms == "own" and own.consumer == ConsumerConfig()
    assert shared.consumer == shared_consumer_config()
    # a consumer CTA that can sit next to a producer CTA: few warps, no shared memory
    assert shared.consumer.num_warps <= 4 and shared.consumer.shared_bytes(2) == 0
    with pytest.raises(ValueError, match="^consumer_sms must be one of own, shared, got 'all'$"):
        OverlapRunner(plan, w, t, ccta=2, num_programs=3, consumer_sms="all")


@needs_interpreter
def test_runner_backoff_reaches_the_consumer_config():
    plan, x, w = _problem(torch.float16)
    fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
    t = fabric.transport(plan.rank)
    runner = OverlapRunner(plan, w, t, ccta=2, num_programs=3, backoff_ns=200)
    assert runner.consumer.backoff_ns == 200
    assert OverlapRunner(plan, w, t, ccta=2, num_programs=3).consumer.backoff_ns == 0


@needs_interpreter
def test_shared_consumer_delivers_what_the_own_consumer_delivers():
    # consumer_sms="shared" changes where the consumer runs (and, on a GPU, its carve-out
    # request), not what it sends: every destination buffer ends up the same
    plan, x, w = _problem(torch.float16, mgb=2)
    bufs = {}
    for where in ("own", "shared"):
        fabric = LoopbackFabric(plan.dst_rows, w.shape[2], x.dtype, "cpu")
        runner = OverlapRunner(
            plan,
            w,
            fabric.transport(plan.rank),
            ccta=2,
            tile=interpreter_config(TILE_M),
            consumer=interpreter_consumer_config(),
            num_programs=3,
            local_direct=True,
            consumer_sms=where,
        )
        y = torch.zeros(plan.n_padded, w.shape[2], dtype=x.dtype)
        runner.overlapped(x, y)
        runner.check()
        bufs[where] = fabric.buffer.clone()
    assert torch.equal(bufs["own"], bufs["shared"]) and bufs["own"].abs().sum() > 0
