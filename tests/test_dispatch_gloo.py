"""LayerDispatch over a real gloo group (W = 2 and 3) with the GPU path's label kernels run in
Triton's interpreter: the W > 1 paths of the labels' bound (rows from several sources grouped
by expert, expert_pos cut to the R real rows, a rank that receives nothing, the regrowth after
the sync) give the torch path's Dispatched on every rank. The one-GPU tests reach W = 1 only."""

import pytest
import torch
import torch.distributed as dist

from tests import ranks
from tests.fast_interpreter import install

FIELDS = (
    "x_recv",
    "send_order",
    "pos",
    "send_counts",
    "recv_counts",
    "recv_expert",
    "recv_src",
    "recv_dst_index",
    "expert_pos",
    "offs",
)
LISTS = ("send_splits", "recv_splits", "expert_rows")
T, K, E, H = 24, 2, 3, 4


def _routings(world: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """expert_ids [T, K]: every token to rank 0's experts ("hot": rank 0 receives W*T*K rows, the
    others none), or spread over every rank's experts."""
    pick = lambda n: torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(T)])  # noqa: E731
    return {"hot": pick(E), "spread": pick(world * E)}


def _check_rank(rank: int, world: int) -> list[str]:
    from harness.dispatch import LayerDispatch

    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(T, H, generator=g)
    done = []
    for name, ids in _routings(world, g).items():
        want = LayerDispatch(world, E)(x, ids)  # the torch path (the CPU's)
        r = want.x_recv.shape[0]
        for bound in (None, 5, 30):  # 30: below R and 2 x 30 below W*T*K for spread rows
            disp = LayerDispatch(world, E)
            disp.bound, disp.device_labels = bound, True
            first = min(world * T * K, 2 * T * K) if bound is None else bound
            grows = r > first
            for step in range(2):
                seen = []
                d = disp(x, ids, before_sync=seen.append)
                case = (world, rank, name, bound, step)
                for f in FIELDS:
                    a, b = getattr(d, f), getattr(want, f)
                    assert (a is None and b is None) or torch.equal(a, b), (case, f)
                for f in LISTS:
                    assert getattr(d, f) == getattr(want, f), (case, f)
                assert len(seen) == (2 if grows and step == 0 else 1), (case, len(seen))
                assert disp.regrown == int(grows), (case, disp.regrown)
                want_bound = max(r, min(2 * first, world * T * K)) if grows else first
                assert disp.bound == want_bound, (case, disp.bound)
                last = seen[-1]
                assert len(last.recv_src) == want_bound and int(last.n_rows) == r, case
                assert torch.equal(last.recv_src[:r], want.recv_src), case
                assert (last.recv_src[r:] == -1).all(), case
            done.append(f"{name}:{bound}:{r}")
    return done


def _worker(rank: int, world: int, init: str, q) -> None:
    install()  # tl.sort's xor_sum in numpy (tests/fast_interpreter.py)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        q.put((rank, _check_rank(rank, world)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3])  # W=3: the hot routing grows past the first bound
def test_dispatch_labels_at_a_bound_equal_the_torch_path_on_every_rank(world, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks import triton afresh
    q = ranks.context().SimpleQueue()
    ranks.run_ranks(_worker, (world, f"tcp://127.0.0.1:{ranks.free_port()}", q), world)
    got = dict(q.get() for _ in range(world))
    assert sorted(got) == list(range(world))
    # rank 0 receives every row of the hot routing (past the first bound at W = 3), the others
    # none; every rank ran both routings at every bound
    assert got[0][0] == f"hot:None:{world * T * K}" and got[1][0] == "hot:None:0"
    assert all(len(v) == 6 for v in got.values())
    # the growth rule max(R, min(2 bound, W*T*K)) is seen where bound < R < 2 bound
    assert any(30 < int(c.split(":")[2]) < 60 for v in got.values() for c in v if ":30:" in c)
