"""The layer scope on the CPU: FFN experts, the device dispatch, and the serial layer end to end.

A layer cell (grid axis ffn = F > 0) times the whole MoE layer from this rank's tokens and
routing; systems without a layer scope are skipped with the reason.
"""

from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.dispatch import LayerDispatch, combine, from_expert_order, to_expert_order
from harness.experts import ffn_experts
from harness.layout import rank_layout
from harness.reference import reference_local
from harness.workload import WorkloadSpec, make_rank_fc1, make_rank_weights, make_tokens
from tests.inprocess import launch

ROOT = Path(__file__).resolve().parents[1]


def test_a_layer_cell_needs_out_equal_to_hidden():
    with pytest.raises(ValueError, match="out must equal hidden"):
        WorkloadSpec(64, 32, 48, 2, 2, 1, "balanced", ffn=16)
    with pytest.raises(ValueError, match="ffn must be >= 0"):
        WorkloadSpec(64, 32, 32, 2, 2, 1, "balanced", ffn=-1)
    spec = WorkloadSpec(64, 32, 32, 2, 2, 1, "balanced", ffn=16)
    assert spec.scope == "layer"
    assert WorkloadSpec(64, 32, 48, 2, 2, 1, "balanced").scope == "gemm+combine"


@pytest.mark.parametrize("routing", ["balanced", "stress_skew"])
def test_one_rank_layer_from_the_device_dispatch_matches_the_oracle(routing):
    """W=1: dispatch, experts grouped, combine and scale equal the float32 oracle, and the
    dispatch's rows line up with harness.layout's."""
    spec = WorkloadSpec(96, 32, 32, 4, 2, 1, routing, ffn=24)
    dev = torch.device("cpu")
    from harness.workload import routing_of

    ids = routing_of(spec).expert_ids[0]
    gate = routing_of(spec).gate_weights[0].float()
    x = make_tokens(spec, 0, dev)
    d = LayerDispatch(1, 4)(x, ids)
    lay = rank_layout(spec, 0)
    assert torch.equal(d.recv_expert, lay.recv_expert)
    assert torch.equal(d.recv_dst_index, lay.recv_dst_index)
    assert d.expert_rows == lay.expert_counts.tolist()
    y = ffn_experts(
        to_expert_order(d, d.x_recv),
        d.expert_rows,
        make_rank_fc1(spec, 0, dev),
        make_rank_weights(spec, 0, dev),
        d.offs,
    )
    back = combine(d, from_expert_order(d, y))
    out = (back[d.pos.view(-1)].view(96, 2, 32) * gate.unsqueeze(-1)).sum(1)
    ref = reference_local(spec, 0, dev)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_the_dispatch_regroups_by_expert_without_a_sort():
    """expert_pos puts (source, expert) blocks in (expert, source) order, and back."""
    from harness.dispatch import Dispatched, blocks, expert_positions

    counts = torch.tensor([[1, 2], [2, 1]])  # W=2 sources x E=2 experts
    block, idx = blocks(counts, 6)
    assert block.tolist() == [0, 1, 1, 2, 2, 3] and idx.tolist() == [0, 0, 1, 0, 1, 0]
    pos = expert_positions(counts, block, idx)
    rows = torch.arange(6)  # s0e0 | s0e1 s0e1 | s1e0 s1e0 | s1e1
    d = Dispatched(*(None,) * 8, pos, None, [], [], [])
    grouped = to_expert_order(d, rows)
    assert grouped.tolist() == [0, 3, 4, 1, 2, 5]  # e0: s0, s1 | e1: s0, s1
    assert from_expert_order(d, grouped).tolist() == rows.tolist()


def test_layer_cells_run_on_gloo_and_skip_systems_without_a_layer_scope(tmp_path):
    table = tmp_path / "t.parquet"
    code = launch(
        f"table={table}",
        "progress=false",
        "hardware.world_size=2",
        "experiment.grid.ffn=[48]",
        "experiment.grid.routing=[stress_skew]",
        "+experiment.systems.tutel_reimpl={}",
    )
    assert code == 0
    df = pd.read_parquet(table)
    serial = df[df["system"] == "serial"]
    assert set(serial["status"]) == {"ok"} and set(serial["scope"]) == {"layer"}
    assert (serial["ffn"] == 48).all() and (serial["max_rel_err"] < 1e-4).all()
    other = df[df["system"] == "tutel_reimpl"]
    assert set(other["status"]) == {"skipped"}
    assert other["reason"].str.contains("no layer scope").all()


def test_operator_cells_carry_ffn_0_and_the_default_axis_is_the_explicit_one():
    from hydra import compose, initialize_config_dir

    from harness.config import register_configs
    from harness.measure import expand_grid

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hardware.world_size=2"])
        cfg2 = compose("config", overrides=["hardware.world_size=2", "experiment.grid.ffn=[0]"])
    cells = expand_grid(cfg, 2)
    assert all(c["ffn"] == 0 for c in cells)
    assert [c["cell_hash"] for c in cells] == [c["cell_hash"] for c in expand_grid(cfg2, 2)]


def test_layer_grid_takes_out_from_hidden_and_counts_each_shape_once():
    from hydra import compose, initialize_config_dir

    from harness.config import register_configs
    from harness.measure import expand_grid

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=layer", "hardware.world_size=2"])
    cells = expand_grid(cfg, 2)
    assert len(cells) == 2 * 2 * 5 * 3 * 10  # T x H x E x routings x systems
    assert all(c["out"] == c["hidden"] and c["ffn"] == 2048 for c in cells)
    assert len({c["cell_hash"] for c in cells}) == len(cells)


def test_expert_gemm_takes_unaligned_widths_on_the_cpu():
    """torch._grouped_mm needs 16-byte rows: unaligned fp32 widths use the per-expert matmul."""
    from harness.experts import expert_gemm, grouped_mm_usable

    x = torch.randn(10, 6)  # 24-byte rows
    w = torch.randn(2, 6, 5)
    assert not grouped_mm_usable(x, w)
    y = expert_gemm(x, [4, 6], w)
    assert torch.allclose(y[:4], x[:4] @ w[0]) and torch.allclose(y[4:], x[4:] @ w[1])


_RECV_ROWS = r"""
import torch
from harness.dispatch import recv_rows_torch
from harness.kernels.dispatch import recv_rows
g = torch.Generator().manual_seed(0)
cases = [(1, 1), (1, 5), (3, 1), (2, 4), (4, 70), (8, 9), (16, 64), (33, 40)]  # G 1 to 1320
for W, E in cases:
    for zeros in (0.0, 0.4):
        cnt = torch.randint(0, 40 if W * E < 200 else 3, (W, E), generator=g)  # interpreter time
        cnt[torch.rand(W, E, generator=g) < zeros] = 0
        off = torch.randint(0, 1000, (W, E), generator=g)
        meta = torch.stack([cnt, off], -1)  # the counts exchange's [W, E, 2]: strided views
        R = int(cnt.sum())
        for epos in (False, True):
            got = recv_rows(meta[..., 0], meta[..., 1], R, epos)
            want = recv_rows_torch(cnt, off, R, epos)
            for a, b in zip(got, want):
                assert (a is None) == (b is None), (W, E)
                assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), (W, E, epos)
            # at a bound on the rows (the dispatch's launch before its sync): the same prefix;
            # the program holding row R is partly past it, the next ones wholly
            got = recv_rows(meta[..., 0], meta[..., 1], R + 777, epos)
            for a, b in zip(got[:4], want[:4]):
                assert a is None or (a.shape[0] == R + 777 and torch.equal(a[:R], b)), (W, E)
                assert a is None or (a[R:] == -1).all(), (W, E)  # past the rows: -1
            assert torch.equal(got[4], want[4])
        print("RECV_ROWS_OK", W, E, R)
from harness.dispatch import sort_meta_torch, split_sizes_torch
from harness.kernels.dispatch import sort_meta, split_sizes
# S past one block (1024 pairs) and not a multiple of it; G past one chunk of 256 experts
for W, E, S, k in [(1, 1, 6, 2), (1, 5, 300, 2), (3, 1, 40, 1), (2, 4, 2049, 2), (8, 70, 3000, 4)]:
    ids = torch.randint(0, W * E, (S // k, k), generator=g)
    ids.view(-1)[: S // 3] = ids.view(-1)[0]  # one hot expert: long runs of equal keys
    got = sort_meta(ids, W, E, k)
    want = sort_meta_torch(ids, W, E, k)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), (W, E, S)
    other = want[3][torch.randperm(W, generator=g)]  # an exchanged meta: any other [W, 2E]
    sizes = split_sizes(want[3], other, W, E)
    assert torch.equal(sizes, split_sizes_torch(want[3], other, W, E))
    assert sizes[-1] == other.view(W, E, 2)[..., 0].sum() == sizes[W : 2 * W].sum()
    print("SORT_META_OK", W, E, S)
"""


#: runs each script in one interpreter process; a script that fails prints FAILED and its trace
_EACH = r"""
import traceback
for name, code in SCRIPTS.items():
    try:
        exec(compile(code, name, "exec"), {"__name__": name})
    except BaseException:
        print(f"FAILED {name}:", traceback.format_exc())
"""


def _failed(out: str, name: str) -> str:
    at = out.find(f"FAILED {name}:")
    return out[at : at + 3000] if at >= 0 else out[-3000:]


@pytest.fixture(scope="module")
def interpreted() -> str:
    """The output of the interpreter scripts below, run in one fresh process (TRITON_INTERPRET
    must precede triton's import)."""
    from tests.interpreted import run_interpreted

    pytest.importorskip("triton")
    scripts = {"recv_rows": _RECV_ROWS, "bound": _BOUND}
    return run_interpreted(f"SCRIPTS = {scripts!r}\n{_EACH}", timeout=300)


def test_dispatch_kernels_equal_the_torch_ops_in_the_interpreter(interpreted):
    """harness/kernels/dispatch.py (the GPU path of the dispatch's bookkeeping) gives the torch
    references' tensors: recv_rows with empty blocks, one source or one expert, strided
    [W, E, 2] views, several chunks of blocks; sort_meta with runs of one expert and experts
    nobody routes to; split_sizes. A subprocess: TRITON_INTERPRET must precede triton."""
    assert interpreted.count("RECV_ROWS_OK") == 16, _failed(interpreted, "recv_rows")
    assert interpreted.count("SORT_META_OK") == 5, _failed(interpreted, "recv_rows")


_BOUND = r"""
import torch
from harness.dispatch import LayerDispatch
g = torch.Generator().manual_seed(1)
T, k, E, H = 50, 2, 4, 8
R = T * k  # W = 1: every row stays
x = torch.randn(T, H, generator=g)
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
want = LayerDispatch(1, E)(x, ids)  # the torch path (the CPU's)
fields = ("x_recv", "send_order", "pos", "send_counts", "recv_counts", "recv_expert", "recv_src",
          "recv_dst_index", "offs")
for bound, calls, grown in ((None, 1, R), (R + 200, 1, R + 200), (R // 3, 2, R)):
    disp = LayerDispatch(1, E)
    disp.bound, disp.device_labels = bound, True
    for step in range(2):  # a grown bound holds for the next step
        seen = []
        d = disp(x, ids, before_sync=seen.append)
        for f in fields:
            assert torch.equal(getattr(d, f), getattr(want, f)), (bound, f)
        assert d.expert_pos is None and d.expert_rows == want.expert_rows
        assert [len(r.recv_src) for r in seen][-1] == grown == disp.bound, (bound, seen)
        assert len(seen) == (calls if step == 0 else 1), (bound, step, len(seen))
        assert disp.regrown == (calls - 1), (bound, disp.regrown)
        last = seen[-1]
        assert int(last.n_rows) == R and (last.recv_src[R:] == -1).all()
        assert torch.equal(last.recv_dst_index[:R], want.recv_dst_index)
    print("BOUND_OK", bound)
"""


def test_the_dispatch_labels_at_its_bound_and_grows_it_past_a_step_that_receives_more(
    interpreted,
):
    """LayerDispatch with the GPU path's kernels (in the interpreter, W=1): the Dispatched
    equals the torch path's whatever the labels' bound; before_sync gets the labels at the
    bound (-1 past the R real rows, R counted on the device); a bound below R labels again
    after the sync (before_sync called twice), grows to R and holds for the next step."""
    assert interpreted.count("BOUND_OK") == 3, _failed(interpreted, "bound")


@pytest.mark.gpu
def test_remembered_dispatch_kernels_equal_the_torch_ops_on_the_gpu(monkeypatch):
    """The same cases on a GPU, twice: the second pass relaunches the remembered launches
    (harness/kernels/relaunch.py launch_cached) on new tensors, with recv_rows' row count
    swapped in, and must give the torch references' tensors again; sort_meta and split_sizes
    (the same shapes) no longer go through Triton's launch path."""
    from triton.runtime.jit import JITFunction

    from harness.dispatch import recv_rows_torch, sort_meta_torch, split_sizes_torch
    from harness.kernels import relaunch
    from harness.kernels.dispatch import recv_rows, sort_meta, split_sizes

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    relaunch._CACHED.clear()
    seen: list[list[str]] = []
    orig = JITFunction.run

    def spy(self, *args, **kwargs):  # a launch through Triton's own path
        seen[-1].append(self.fn.__name__)
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", spy)
    for rep in range(2):
        seen.append([])
        g = torch.Generator().manual_seed(rep)
        for W, E in [(1, 5), (2, 4), (4, 70), (8, 9)]:
            for _ in range(2):  # the same launch kinds, other counts: R changes
                cnt = torch.randint(0, 40, (W, E), generator=g)
                off = torch.randint(0, 1000, (W, E), generator=g)
                meta = torch.stack([cnt, off], -1).to(dev)
                R = int(cnt.sum())
                got = recv_rows(meta[..., 0], meta[..., 1], R, True)
                want = recv_rows_torch(cnt.to(dev), off.to(dev), R, True)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (rep, W, E)
                got = recv_rows(meta[..., 0], meta[..., 1], W * 40 * E, True)  # at a bound
                assert all(torch.equal(a[:R], b) for a, b in zip(got[:4], want[:4])), (W, E)
                assert all((a[R:] == -1).all() for a in got[:4]), (W, E)
        for W, E, S, k in [(1, 5, 300, 2), (2, 4, 999, 1), (8, 70, 3000, 4), (1, 64, 16384, 2)]:
            ids = torch.randint(0, W * E, (S // k, k), generator=g).to(dev)
            ids.view(-1)[: S // 3] = ids.view(-1)[0]  # one hot expert: long runs of equal keys
            got = sort_meta(ids, W, E, k)
            want = sort_meta_torch(ids, W, E, k)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (rep, W, E, S)
            other = want[3][torch.randperm(W, generator=g).to(dev)]
            sizes = split_sizes(want[3], other, W, E)
            assert torch.equal(sizes, split_sizes_torch(want[3], other, W, E))
    assert {"_sort_blocks_kernel", "_sort_place_kernel", "_split_sizes_kernel"} <= set(seen[0])
    if relaunch.FAST:
        sort = {"_sort_blocks_kernel", "_sort_place_kernel"}
        assert not {*sort, "_split_sizes_kernel"} & set(seen[1]), seen[1]
        assert len(seen[1]) < len(seen[0])
