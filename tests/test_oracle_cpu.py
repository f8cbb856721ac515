"""The CPU oracle of the overlapped combine equals the reference layer (W=4 gloo and loopback)."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.check import check
from harness.reference import dispatch, dispatch_local, reference_local
from harness.workload import WorkloadSpec, make_rank_weights, make_tokens
from systems.overlap.oracle_cpu import overlap_forward, overlap_loopback
from systems.overlap.plan import plans_for_spec

W = 4
CPU = torch.device("cpu")
ROUTINGS = ("balanced", "moderate_skew", "stress_skew")
COMBOS = [(r, mgb, tm) for r in ROUTINGS for mgb in (1, 2) for tm in (8, 16)]


def _spec(routing, W=W, E=3, dtype="float32"):
    return WorkloadSpec(
        tokens_per_rank=64,
        hidden=32,
        out=48,
        experts_per_rank=E,
        top_k=2,
        world_size=W,
        routing=routing,
        dtype=dtype,
    )


def _worker(rank, init, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=W)
    try:
        for routing, mgb, tm in COMBOS:
            spec = _spec(routing)
            plans, lays = plans_for_spec(spec, tile_m=tm, mgb=mgb)
            lay = lays[rank]
            x_recv = dispatch(make_tokens(spec, rank, CPU), lay, None)
            w = make_rank_weights(spec, rank, CPU)
            out = overlap_forward(plans, x_recv, w, lay, spec.tokens_per_rank)
            res = check(out, reference_local(spec, rank, CPU))
            q.put((rank, routing, mgb, tm, res.ok, res.max_rel_err, res.message))
    finally:
        dist.destroy_process_group()


def test_overlap_gloo_w4_equals_reference():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(f"tcp://127.0.0.1:{port}", q), nprocs=W, join=True)
    results = [q.get() for _ in range(len(COMBOS) * W)]
    bad = [r for r in results if not r[4]]
    assert not bad, bad
    assert max(r[5] for r in results) < 1e-5


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("W,E,tm,mgb", [(4, 3, 16, 2), (1, 2, 8, 1), (3, 5, 32, 2), (8, 2, 4, 3)])
def test_overlap_loopback_equals_reference(routing, W, E, tm, mgb):
    spec = _spec(routing, W=W, E=E)
    plans, lays = plans_for_spec(spec, tile_m=tm, mgb=mgb)
    x_recvs = [dispatch_local(spec, lay, CPU) for lay in lays]
    weights = [make_rank_weights(spec, r, CPU) for r in range(W)]
    outs = overlap_loopback(plans, x_recvs, weights, lays, spec.tokens_per_rank)
    for r in range(W):
        res = check(outs[r], reference_local(spec, r, CPU))
        assert res.ok and res.max_rel_err < 1e-5, (r, res)


def test_overlap_loopback_bfloat16_within_paper_tolerance():
    spec = _spec("stress_skew", dtype="bfloat16")
    plans, lays = plans_for_spec(spec, tile_m=16, mgb=2)
    x_recvs = [dispatch_local(spec, lay, CPU) for lay in lays]
    weights = [make_rank_weights(spec, r, CPU) for r in range(W)]
    outs = overlap_loopback(plans, x_recvs, weights, lays, spec.tokens_per_rank)
    for r in range(W):
        res = check(outs[r], reference_local(spec, r, CPU))
        assert res.ok, (r, res)
