"""The CPU oracle of the overlapped combine equals the reference layer (W=4 gloo and loopback)."""

import pytest
import torch
import torch.distributed as dist

from harness.check import check
from harness.reference import dispatch, dispatch_local, reference_local
from harness.workload import WorkloadSpec, make_rank_weights, make_tokens
from systems.overlap.plan import padded_input
from tests import ranks
from tests.oracle_cpu import overlap_forward, overlap_loopback
from tests.overlap_testing import plans_for_spec

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
    q = ranks.context().SimpleQueue()
    ranks.run_ranks(_worker, (f"tcp://127.0.0.1:{ranks.free_port()}", q), W)
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


def _receive_buffers(plans, x_recvs, weights, n_cols):
    """Every rank's combine receive buffer after the oracle's walk (sends + local copies)."""
    from tests.oracle_cpu import _copy_local, produce

    backs = [x_recvs[0].new_zeros(int(p.recv_rows.sum()), n_cols) for p in plans]

    def send(seg, dst, offset, rows):
        assert not backs[dst][offset : offset + rows.shape[0]].any(), "a row written twice"
        backs[dst][offset : offset + rows.shape[0]] = rows

    for plan, x_recv, w in zip(plans, x_recvs, weights):
        y = produce(plan, padded_input(x_recv, plan.gather_index), w, send)
        _copy_local(plan, y, backs[plan.rank])
    return backs


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("W,E,tm,mgb", [(4, 3, 16, 1), (3, 5, 32, 2), (8, 2, 4, 3), (6, 2, 8, 1)])
def test_compact_layout_delivers_what_the_aligned_one_delivers(routing, W, E, tm, mgb):
    """Same x, weights and routing: every receive buffer ends up the same, aligned vs compact
    (integer-valued inputs, so every GEMM is exact and the comparison is bitwise)."""
    spec = _spec(routing, W=W, E=E)
    g = torch.Generator().manual_seed(W * 100 + E)
    lays = plans_for_spec(spec, tile_m=tm, mgb=mgb)[1]
    x_recvs = [
        torch.randint(-3, 4, (lay.recv_src.numel(), 32), generator=g).float() for lay in lays
    ]
    weights = [torch.randint(-3, 4, (E, 32, 48), generator=g).float() for _ in range(W)]
    backs = {}
    for layout in ("aligned", "compact"):
        plans = plans_for_spec(spec, tile_m=tm, mgb=mgb, layout=layout)[0]
        backs[layout] = _receive_buffers(plans, x_recvs, weights, 48)
    for d in range(W):
        assert torch.equal(backs["compact"][d], backs["aligned"][d]), d
        assert backs["aligned"][d].abs().sum() > 0
    compact = plans_for_spec(spec, tile_m=tm, mgb=mgb, layout="compact")[0]
    assert any(p.piece_band.unique().numel() < p.piece_band.numel() for p in compact), (
        "no mixed band: the case would not test the split"
    )


@pytest.mark.parametrize("layout", ["compact"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_compact_overlap_loopback_equals_reference(routing, layout):
    spec = _spec(routing, W=4, E=3)
    plans, lays = plans_for_spec(spec, tile_m=16, mgb=2, layout=layout)
    x_recvs = [dispatch_local(spec, lay, CPU) for lay in lays]
    weights = [make_rank_weights(spec, r, CPU) for r in range(4)]
    outs = overlap_loopback(plans, x_recvs, weights, lays, spec.tokens_per_rank)
    for r in range(4):
        res = check(outs[r], reference_local(spec, r, CPU))
        assert res.ok and res.max_rel_err < 1e-5, (r, res)
