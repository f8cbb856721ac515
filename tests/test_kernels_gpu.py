"""The overlap kernels on a CUDA GPU (marked gpu; skipped without one). Behaviour, not timing.

producer vs torch (fp16, bf16; the three flag modes; fixed and expert swizzle groups, the expert
visiting order; TMA and pointer loads; local rows stored in the own receive buffer), consumer
with the flags pre-set (vectorised and not, aligned bands and compact pieces), producer +
consumer overlapped on loopback equal to the same kernels run one after the other (exactly) over
several runs without any reset, remembered launches, device-built plans (no host sync) equal to
the host builder's and run by the runner, the bounded waits (a withheld flag raises
OverlapTimeoutError naming the segment and band), the one-SM-per-consumer-CTA residency on Hopper,
the shared consumer next to the producer, and an NVSHMEM put to self (W = 1) in a child process.
The runner's producer stores every local row in the own receive buffer (plan.row_dst), never in
Y: Y is compared at the other rows, the local rows in that buffer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import systems.overlap.runner as runner_mod  # noqa: E402
from systems.overlap.errors import OverlapTimeoutError, new_error_buffer, read_error  # noqa: E402
from systems.overlap.kernels import launch_producer, launch_wait_signals  # noqa: E402
from systems.overlap.plan import padded_input  # noqa: E402
from systems.overlap.runner import OverlapRunner, residency_report, run_consumer  # noqa: E402
from systems.overlap.transport import LoopbackFabric  # noqa: E402
from systems.overlap.tuning import ConsumerConfig, TileConfig, pick_config  # noqa: E402
from tests.overlap_testing import (  # noqa: E402
    expected_sends,
    reference_y,
    rows_sent,
    synthetic_plan,
)

DEV = torch.device("cuda")
# rows[e][s] of 3 local experts, this rank = 2: padding in remote groups, partial local bands
ROWS = [[200, 130, 70], [0, 300, 90], [64, 0, 5]]


def _problem(dtype, K, N, tile_m=128, mgb=2, seed=0, group_cap=None, order="remote_first"):
    """(plan, padded x [P, K], weights [3, K, N]); group_cap None: the tile table's for K, N."""
    if group_cap is None:
        group_cap = pick_config(tile_m, K, N, dtype).group_cap
    g = torch.Generator().manual_seed(seed)
    plan = synthetic_plan(
        ROWS, rank=2, tile_m=tile_m, mgb=mgb, device=DEV, group_cap=group_cap, order=order
    )
    x_recv = torch.randn(plan.n_rows, K, generator=g).to(DEV, dtype)
    w = (torch.randn(len(ROWS), K, N, generator=g) / K**0.5).to(DEV, dtype)
    return plan, padded_input(x_recv, plan.gather_index), w


def _rel(a, ref):
    return float((a.float() - ref).norm() / ref.norm())


def _check_rows(plan, y, own_recv, ref):
    """Y [P, N] equals ref (float32 [P, N]) at every row but the local ones, and the own
    receive buffer [S, N] holds the local rows (row_dst >= 0) at their place."""
    local = plan.row_dst >= 0
    assert not torch.isnan(y[~local]).any()
    assert _rel(y[~local], ref[~local]) < 1e-2
    assert _rel(own_recv[plan.row_dst[local]], ref[local]) < 1e-2


#: the producer's configurations: the table's, each flag mode, the swizzle groups (fixed, of one
#: expert's bands), the expert visiting order, the epilogue slices, the loads
VARIANTS = ["table", "deferred_flags", "split4", "mid_table", "wide_table", "expert_groups"]
VARIANTS += ["expert_order"]
VARIANTS += ["cta_noflatten", "pointer_loads", "k_tail", "local_direct"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_producer_matches_torch(dtype, variant):
    K = 200 if variant == "k_tail" else 256
    cfg = pick_config(128, K, 384, dtype)
    order = "remote_first"
    if variant == "deferred_flags":  # fixed groups of 2 positions, flags one tile later
        cfg = replace(cfg, flag="deferred", group_m=2)
    elif variant == "split4":
        cfg = replace(cfg, epi_split=4)
    elif variant == "mid_table":  # the 2048 <= N < 4096 entry (256 wide, no groups) on a masked N
        cfg = pick_config(128, K, 2048, dtype)
    elif variant == "wide_table":  # the N >= 4096 entry (256 wide, 4 slices) on a masked N
        cfg = pick_config(128, K, 8192, dtype)
    elif variant == "expert_groups":  # groups of one expert's bands, at most 2 long
        cfg = replace(cfg, expert_groups=True, group_m=2)
    elif variant == "expert_order":  # each expert's local bands right after its remote ones
        cfg, order = replace(cfg, expert_groups=True, group_m=2), "expert"
    elif variant == "cta_noflatten":
        cfg = replace(cfg, flatten=False, flag="cta")
    elif variant == "pointer_loads":
        cfg = replace(cfg, use_tma=False)
    plan, x, w = _problem(dtype, K=K, N=384, group_cap=cfg.group_cap, order=order)
    assert (plan.visit is not None) == (order == "expert")
    y = torch.full((plan.n_padded, 384), float("nan"), dtype=dtype, device=DEV)
    recv = None
    if variant == "local_direct":
        recv = torch.full((plan.dst_rows[2], 384), float("nan"), dtype=dtype, device=DEV)
    ready = torch.zeros(plan.n_bands, dtype=torch.int32, device=DEV)
    for run in (1, 2):
        launch_producer(x, w, y, plan, ready, num_programs=7, config=cfg, recv=recv)
        torch.cuda.synchronize()
        remote = plan.schedule[: plan.n_remote_bands]
        assert torch.all(ready[remote] == run * cfg.band_increment(384))
        assert torch.all(ready[plan.schedule[plan.n_remote_bands :]] == 0)
    ref = reference_y(plan, x, w)
    if recv is None:
        assert not torch.isnan(y).any()
        assert _rel(y, ref) < 1e-2
    else:  # the local rows went to recv only
        _check_rows(plan, y, recv, ref)
        assert torch.isnan(y[plan.row_dst >= 0]).all()
    assert torch.count_nonzero(y[plan.gather_index < 0]) == 0


def _consume(plan, y, fabric, ready, target, cfg, ccta, wait=True):
    tr = fabric.transport(plan.rank)
    err = new_error_buffer(DEV)
    run_consumer(
        y,
        plan,
        ready,
        tr,
        err,
        torch.zeros(ccta, dtype=torch.int64, device=DEV),
        ready_target=target,
        rank=plan.rank,
        ccta=ccta,
        config=cfg,
        wait=wait,
    )
    return err


@pytest.mark.parametrize("layout", ["aligned", "compact"])
@pytest.mark.parametrize("N", [384, 100])
@pytest.mark.parametrize("block,warps,ccta", [(65536, 32, 3), (65536, 16, 2), (16384, 16, 4)])
def test_consumer_copies_with_flags_set(N, block, warps, ccta, layout):
    """Every segment's rows (aligned: remote bands; compact: pieces, several owners in a band)
    land at their destinations, and each receiver's counter holds the rows sent to it."""
    plan = synthetic_plan(
        ROWS, rank=2, tile_m=64, mgb=2, device=DEV, dst_base=[5, 3, 0], layout=layout
    )
    y = torch.randn(plan.n_padded, N, device=DEV).to(torch.bfloat16)
    fabric = LoopbackFabric(plan.dst_rows, N, y.dtype, DEV)
    fabric.buffer.fill_(-3.0)
    before = [fabric.recv(d).clone() for d in range(3)]
    ready = torch.full((plan.n_bands,), 9, dtype=torch.int32, device=DEV)
    cfg = ConsumerConfig(block=block, num_warps=warps)
    err = _consume(plan, y, fabric, ready, 9, cfg, ccta)
    torch.cuda.synchronize()
    assert read_error(err) is None
    want = expected_sends(plan, y, before)
    for d in range(3):
        assert torch.equal(fabric.recv(d), want[d])
    assert fabric.counters[:, 2].tolist() == rows_sent(plan)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ccta", [2, 8])
def test_overlapped_equals_sequential_on_loopback(dtype, ccta):
    plan, x, w = _problem(dtype, K=512, N=1024, mgb=2)
    fabric = LoopbackFabric(plan.dst_rows, 1024, dtype, DEV)
    runner = OverlapRunner(plan, w, fabric.transport(plan.rank), ccta=ccta)
    y_seq = torch.zeros(plan.n_padded, 1024, dtype=dtype, device=DEV)  # local rows stay 0
    runner.sequential(x, y_seq)
    torch.cuda.synchronize()
    runner.check()
    want = [fabric.recv(d).clone() for d in range(3)]
    sent = torch.tensor(rows_sent(plan))
    y = torch.zeros_like(y_seq)
    for run in range(2, 5):  # the band counters restart every run, the receive ones add up
        fabric.buffer.zero_()
        runner.overlapped(x, y)
        torch.cuda.synchronize()
        runner.check()
        assert torch.equal(y, y_seq)
        for d in range(3):  # the own buffer (d = 2) holds the local rows the producer stored
            assert torch.equal(fabric.recv(d), want[d]), f"run {run}, destination {d}"
        assert torch.equal(fabric.counters[:, plan.rank].cpu(), sent * run)
    t, nothing = runner.transport, torch.zeros(3, dtype=torch.int64, device=DEV)
    launch_wait_signals(  # nothing to wait for: returns
        t.signal, nothing, runner.err, runner.clock, rank=2, config=runner.consumer, scope=t.scope
    )
    torch.cuda.synchronize()
    runner.check()
    _check_rows(plan, y, fabric.recv(plan.rank), reference_y(plan, x, w))


@pytest.mark.parametrize("consumer_sms", ["own", "shared"])
def test_remembered_launches_equal_triton_launches(consumer_sms, monkeypatch):
    """After its first overlapped run the runner re-runs its remembered launches
    (harness/kernels/relaunch.py) without Triton's launch path. Every later run still waits for
    this run's bands (Y is NaN before each run, so a consumer that did not wait would send NaN),
    the producer still stores the local rows in the own receive buffer, the receive counters
    grow by one run each time, the receiver's wait is remembered too, and another plan
    (use_plan) goes through Triton again."""
    from triton.runtime.jit import JITFunction

    dtype, N = torch.bfloat16, 1024
    plan, x, w = _problem(dtype, K=512, N=N, mgb=2)
    plan.recv_rows = torch.zeros(3, dtype=torch.int64, device=DEV)  # nothing comes back
    fabric = LoopbackFabric(plan.dst_rows, N, dtype, DEV)
    ccta = 4 if consumer_sms == "own" else 8
    runner = OverlapRunner(
        plan, w, fabric.transport(plan.rank), ccta=ccta, consumer_sms=consumer_sms
    )
    y_ref = torch.empty(plan.n_padded, N, dtype=dtype, device=DEV)
    runner.sequential(x, y_ref)
    torch.cuda.synchronize()
    want = [fabric.recv(d).clone() for d in range(3)]
    sent = torch.tensor(rows_sent(plan))
    out = plan.row_dst < 0  # the rows the producer stores in Y (local rows: the own buffer)
    launched = []
    real = JITFunction.run

    def spy(self, *args, **kwargs):
        if not kwargs.get("warmup"):  # shared: the carve-out's compile-only call is no launch
            launched.append(self.fn.__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", spy)
    y = torch.empty_like(y_ref)
    for run in range(2, 7):
        y.fill_(float("nan"))
        fabric.buffer.zero_()
        runner.overlapped(x, y)
        torch.cuda.synchronize()
        runner.check()
        assert torch.equal(y[out], y_ref[out]), f"run {run}"
        for d in range(3):
            assert torch.equal(fabric.recv(d), want[d]), f"run {run}, destination {d}"
        assert torch.equal(fabric.counters[:, plan.rank].cpu(), sent * run)
    # another y than sequential's: the first overlapped run launched through Triton, no other
    assert sorted(launched) == ["_consumer_kernel", "_producer_kernel"], launched
    launched.clear()
    for _ in range(2):
        runner.wait_received()  # nothing to wait for: returns (the second is remembered)
    torch.cuda.synchronize()
    runner.check()
    assert launched == ["_wait_signals_kernel"], launched
    launched.clear()
    runner.use_plan(synthetic_plan(ROWS, rank=2, tile_m=128, mgb=1, device=DEV))
    runner.overlapped(x, y)
    torch.cuda.synchronize()
    runner.check()
    assert sorted(launched) == ["_consumer_kernel", "_producer_kernel"], launched
    assert torch.equal(y[out], y_ref[out])


@pytest.mark.parametrize("E", [16, 64])
@pytest.mark.parametrize("layout", ["aligned", "compact"])
@pytest.mark.parametrize("routing", ["balanced", "stress_skew"])
@pytest.mark.parametrize("order,group_cap", [("remote_first", 0), ("expert", 16)])
def test_device_plan_builds_without_sync_and_equals_build_plan(
    routing, layout, E, order, group_cap
):
    """build_plan_device on the GPU: no host synchronisation (sync debug mode 'error'), and the
    valid prefixes (trimmed) equal build_plan's plan of the same rows, the visiting order and
    the swizzle groups included. E=64: the group kernel's sums over experts take two chunks
    (kernels/plan.py _sums_before), across its barriers."""
    from dataclasses import fields

    from harness.layout import rank_layout
    from harness.workload import WorkloadSpec
    from systems.overlap.plan import CombinePlan, build_plan
    from systems.overlap.plan_device import build_plan_device

    spec = WorkloadSpec(
        tokens_per_rank=4096,
        hidden=8,
        out=8,
        experts_per_rank=E,
        top_k=2,
        world_size=8,
        routing=routing,
    )
    kw = dict(world_size=8, rank=0, experts_per_rank=E, tile_m=128, mgb=2, out_cols=8)
    kw |= dict(layout=layout, order=order, group_cap=group_cap)
    lay = rank_layout(spec, 0)
    ref = build_plan(lay.recv_src, lay.recv_expert, lay.recv_dst_index, elem_bytes=2, **kw)
    args = [t.to(DEV) for t in (lay.recv_src, lay.recv_expert, lay.recv_dst_index)]
    build_plan_device(*args, elem_bytes=2, **kw)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dev = build_plan_device(*args, elem_bytes=2, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert (dev.visit is None) == (order != "expert") and (dev.groups is None) == (not group_cap)
    host = dev.trimmed()
    for f in fields(CombinePlan):
        a, b = getattr(ref, f.name), getattr(host, f.name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b.cpu()), f.name
        else:
            assert a == b, f.name


@pytest.mark.parametrize("layout", ["aligned", "compact"])
def test_runner_from_device_plans_equals_host_plans(layout):
    """Producer + consumer overlapped from device-built plans (worst-case sized arrays, device
    counts), the plan changing every run: Y at every row but the local ones, and every receive
    buffer (the own one with the local rows the epilogue stored), equal the host plan's
    sequential run of the same rows (compact: mixed bands and pieces); Y past n_padded is
    never written."""
    from systems.overlap.plan import build_plan
    from systems.overlap.plan_device import build_plan_device, padded_input_device
    from tests.overlap_testing import synthetic_rows

    K, N, dtype = 512, 1024, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, K, N, generator=g) / K**0.5).to(DEV, dtype)
    cases = [ROWS, [[30, 400, 7], [129, 0, 300], [0, 0, 0]], ROWS]
    fabric = LoopbackFabric([2000] * 3, N, dtype, DEV)
    ref_fabric = LoopbackFabric([2000] * 3, N, dtype, DEV)
    runner = None
    for i, rows in enumerate(cases):
        src, expert, dst, _ = synthetic_rows(rows, rank=2)
        kw = dict(world_size=3, rank=2, experts_per_rank=3, tile_m=128, mgb=2, out_cols=N)
        kw["layout"] = layout
        ref = build_plan(src.to(DEV), expert.to(DEV), dst.to(DEV), elem_bytes=2, **kw)
        dev = build_plan_device(src.to(DEV), expert.to(DEV), dst.to(DEV), elem_bytes=2, **kw)
        P = ref.sizes()["n_padded"]
        x_recv = torch.randn(ref.n_rows, K, generator=g).to(DEV, dtype)
        x = padded_input_device(x_recv, dev)
        assert torch.equal(x[:P], padded_input(x_recv, ref.gather_index))
        if runner is None:
            runner = OverlapRunner(dev, w, fabric.transport(2), ccta=4)
        else:
            runner.use_plan(dev)
        ref_runner = OverlapRunner(ref, w, ref_fabric.transport(2), ccta=4)
        y = torch.full((dev.max_padded, N), float("nan"), dtype=dtype, device=DEV)
        y_ref = torch.empty(P, N, dtype=dtype, device=DEV)
        fabric.buffer.zero_()
        ref_fabric.buffer.zero_()
        runner.overlapped(x, y)
        ref_runner.sequential(x[:P].contiguous(), y_ref)
        torch.cuda.synchronize()
        runner.check()
        ref_runner.check()
        out = ref.row_dst < 0
        assert torch.equal(y[:P][out], y_ref[out]), f"run {i}"
        assert bool(torch.isnan(y[P:]).all())
        assert torch.equal(fabric.buffer, ref_fabric.buffer), f"run {i}"


def test_withheld_flag_times_out_naming_segment_and_band():
    plan = synthetic_plan(ROWS, rank=2, tile_m=64, mgb=1, device=DEV)
    y = torch.randn(plan.n_padded, 256, device=DEV).to(torch.float16)
    fabric = LoopbackFabric(plan.dst_rows, 256, y.dtype, DEV)
    ready = torch.full((plan.n_bands,), 8, dtype=torch.int32, device=DEV)
    seg = int(plan.n_segments) - 2
    band = int(plan.schedule[int(plan.seg_start[seg])])
    ready[band] = 7
    cfg = ConsumerConfig(timeout_s=0.05)
    err = _consume(plan, y, fabric, ready, 8, cfg, ccta=4)
    torch.cuda.synchronize()
    rec = read_error(err)
    assert rec is not None
    assert (rec.segment, rec.band, rec.rank, rec.seen, rec.want) == (seg, band, 2, 7, 8)
    with pytest.raises(OverlapTimeoutError, match=f"segment {seg}, band {band}"):
        from systems.overlap.errors import raise_if_error

        raise_if_error(err)


def test_receiver_wait_times_out_naming_the_source():
    signal = torch.tensor([4, 1, 0], dtype=torch.int64, device=DEV)
    err = new_error_buffer(DEV)
    launch_wait_signals(
        signal,
        torch.tensor([4, 2, 0], device=DEV),
        err,
        torch.zeros(1, dtype=torch.int64, device=DEV),
        rank=1,
        config=ConsumerConfig(timeout_s=0.05),
        scope="gpu",
    )
    torch.cuda.synchronize()
    rec = read_error(err)
    assert rec is not None and rec.source == 1 and (rec.seen, rec.want) == (1, 2)


@pytest.mark.skipif(
    torch.cuda.get_device_capability() != (9, 0), reason="the shared-memory argument is Hopper's"
)
def test_consumer_cta_owns_its_sm_on_hopper():
    plan, x, w = _problem(torch.bfloat16, K=2048, N=8192)
    fabric = LoopbackFabric(plan.dst_rows, 8192, torch.bfloat16, DEV)
    runner = OverlapRunner(plan, w, fabric.transport(plan.rank), ccta=4)
    y = torch.empty(plan.n_padded, 8192, dtype=torch.bfloat16, device=DEV)
    runner.overlapped(x, y)
    torch.cuda.synchronize()
    runner.check()
    rep = residency_report(runner.last_kernels["producer"], runner.last_kernels["consumer"])
    assert rep["exclusive"], rep


@pytest.mark.skipif(
    torch.cuda.get_device_capability() != (9, 0), reason="the register argument is Hopper's"
)
def test_shared_consumer_sits_next_to_the_producer_on_all_sms_and_matches():
    """consumer_sms="shared": the producer's grid is every SM, a small consumer CTA fits next to
    a producer CTA (registers, shared memory, threads), the consumer asked for the largest
    shared-memory carve-out, and every receive buffer equals the own-SM run's."""
    plan, x, w = _problem(torch.bfloat16, K=2048, N=8192)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    outs = {}
    for where in ("own", "shared"):
        fabric = LoopbackFabric(plan.dst_rows, 8192, torch.bfloat16, DEV)
        runner = OverlapRunner(plan, w, fabric.transport(plan.rank), ccta=8, consumer_sms=where)
        y = torch.empty(plan.n_padded, 8192, dtype=torch.bfloat16, device=DEV)
        runner.overlapped(x, y)
        torch.cuda.synchronize()
        runner.check()
        outs[where] = [fabric.recv(d).clone() for d in range(plan.world_size)]
        if where == "shared":
            assert runner.num_programs == sms
            assert runner.residency is not None and runner.residency["consumer_with_producer"]
            assert runner.residency["consumers_beside_producer"] >= 1, runner.residency
            print("residency (shared)", runner.residency)
            assert 100 in runner_mod._carveout_done.values()
    for a, b in zip(outs["own"], outs["shared"]):
        assert torch.equal(a, b)


_NVSHMEM_CHILD = r"""
import os, sys, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29573")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
import torch.distributed._symmetric_memory as symm_mem
if not symm_mem.is_nvshmem_available():
    print("NO_NVSHMEM"); sys.exit(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
from tests.overlap_testing import synthetic_plan, expected_sends, nvshmem_self_transport
from systems.overlap.errors import new_error_buffer, raise_if_error
from systems.overlap.runner import run_consumer
from systems.overlap.tuning import ConsumerConfig
plan = synthetic_plan([[100, 0], [64, 0], [30, 0]], rank=1, tile_m=64, mgb=2, device="cuda")
y = torch.randn(plan.n_padded, 256, device="cuda").to(torch.bfloat16)
tr = nvshmem_self_transport(plan.dst_rows[0], 256, torch.bfloat16, torch.device("cuda"))
for warps in (8, 4):  # stores through the NVSHMEM heap's own addresses
    tr.recv.zero_(); tr.signal.zero_()
    err = new_error_buffer("cuda")
    run_consumer(y, plan, torch.ones(plan.n_bands, dtype=torch.int32, device="cuda"), tr, err,
                 torch.zeros(2, dtype=torch.int64, device="cuda"), ready_target=1, rank=0, ccta=2,
                 config=ConsumerConfig(num_warps=warps))
    torch.cuda.synchronize()
    raise_if_error(err)
    want = expected_sends(plan, y, [torch.zeros_like(tr.recv)] * 2)[0]
    assert torch.equal(tr.recv, want), warps
    assert int(tr.signal[0]) == 194, (warps, int(tr.signal[0]))
    print("MODE_OK", warps)
dist.destroy_process_group()
"""


def test_nvshmem_put_to_self_in_child_process():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _NVSHMEM_CHILD],
        cwd=root,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=240,
    )
    if "NO_NVSHMEM" in proc.stdout:
        pytest.skip("torch has no NVSHMEM symmetric-memory backend here")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("MODE_OK") == 2


def test_tile_config_table_is_consistent():
    for cfg in (pick_config(128, 2048, 8192, torch.bfloat16), TileConfig()):
        assert cfg.band_increment(8192) == cfg.tiles_n(8192) * cfg.tile_increment()


def test_graph_replays_wait_for_the_producer_on_new_inputs():
    """runner.overlapped captured once in a CUDA graph, replayed on new inputs: every replay's
    consumer waits for that replay's bands (a target baked from an epoch would pass at once
    and copy Y before the producer wrote it; Y is NaN-filled before each replay)."""
    dtype, N = torch.bfloat16, 1024
    plan, x, w = _problem(dtype, K=2048, N=N, mgb=2)
    fabric = LoopbackFabric(plan.dst_rows, N, dtype, DEV)
    runner = OverlapRunner(plan, w, fabric.transport(plan.rank), ccta=4)
    y = torch.zeros(plan.n_padded, N, dtype=dtype, device=DEV)
    for _ in range(2):  # warm-up: compiles and remembered launches
        runner.overlapped(x, y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runner.overlapped(x, y)
    g = torch.Generator(device=DEV).manual_seed(1)
    for replay in range(4):
        x.copy_(torch.randn(x.shape, generator=g, device=DEV, dtype=torch.float32).to(dtype))
        y.fill_(float("nan"))
        fabric.buffer.zero_()
        graph.replay()
        torch.cuda.synchronize()
        runner.check()
        zeros = [torch.zeros(fabric.recv(d).shape, device=DEV) for d in range(3)]
        want = expected_sends(plan, reference_y(plan, x, w), zeros)
        for d in range(2):  # the remote destinations: what the consumer sent
            got = fabric.recv(d)
            assert not torch.isnan(got).any(), f"replay {replay}: destination {d} got NaN"
            assert _rel(got, want[d]) < 1e-2, f"replay {replay}, destination {d}"
