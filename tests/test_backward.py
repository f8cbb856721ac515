"""OverlapMoE's backward (systems/overlap/backward.py) on the CPU, Triton's interpreter: the
train scope's output, dx, dgate, dw1 and dw2 against torch autograd of the reference layer
(harness/reference.py reference_train, float32) by the forward's check (relative Frobenius
and the worst row), through the harness's train steps:
  - one process: W=1 and one process playing W = 2, 3, 4 (loopback), aligned and compact,
    balanced and stress_skew, a token routed to no remote expert, an expert that receives
    nothing, k = E; two wrong gradients fail the check (a band of dx rows returned to the
    wrong owner, a slot missing from dx's sum); the backward reads nothing on the host (W=1,
    float32); the experiment layer_train writes checked rows;
  - W = 2, 3, 4 processes on shm (subgroups of one spawn of 4), the host-free dispatch and
    dispatch=nccl.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.interpreted import run_interpreted
from tests.multigpu import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")

#: (W, routing, layout, T, E, k); W=1 k=E; W=3 k = every expert; W=4 T=1: some rank and
#: some experts receive nothing
CELLS = [
    (1, "balanced", "aligned", 16, 2, 2),
    (2, "stress_skew", "compact", 16, 2, 2),
    (3, "balanced", "aligned", 16, 2, 6),
    (4, "stress_skew", "aligned", 1, 2, 2),
]

SCRIPT = """
import json, os, sys, tempfile
from dataclasses import replace
import pandas as pd, torch
from harness.check import check
from harness.measure import cell_inputs
from harness.system import RunContext
from harness.workload import WorkloadSpec, routing_of
from systems.overlap.system import OverlapSystem
from tests.inprocess import launch

ctx = RunContext(0, 1, torch.device("cpu"), None, "gloo")
out = {}
for W, routing, layout, T, E, k in json.loads(sys.argv[1]):
    spec = WorkloadSpec(T, 32, 32, E, k, W, routing, "float16", ffn=64, train=True)
    inputs, ref = cell_inputs(ctx, spec, list(range(W)))
    system = OverlapSystem(ctx, {"tile_m": 64, "ccta": 2, "layout": layout})
    system.setup(inputs)
    res = check(system.step.outputs(), ref)
    ids = routing_of(spec).expert_ids
    out[f"{W} {routing} {layout}"] = [res.ok, res.max_rel_err, res.max_row_rel_err, res.message,
        any(bool(((ids[r] // E) == r).all(1).any()) for r in range(W)),  # a token stays home
        bool(torch.bincount(ids.reshape(-1), minlength=W * E).eq(0).any())]  # an idle expert
    if W == 2:  # the negative controls, on this played cell (its backward runners exist now)
        back = system.step.ranks[0].back.runner
        t = back.transport  # rank 0's bands for rank 1 go to rank 0's own buffer
        back.transport = replace(t, recv_ptrs=t.recv_ptrs.flip(0))
        out["wrong owner"] = check(system.step.outputs(), ref).message
        back.transport = t
        unit = system.step.ranks[1].back.unit
        unit[:, 1] = 0  # rank 1's dx leaves its tokens' second slot out of the sum
        out["missing slot"] = check(system.step.outputs(), ref).message
from systems.overlap import OverlapMoE, OverlapParams
from systems.overlap.backward import LayerFunction
from tests.test_peer_dispatch import NoHostReads
moe = OverlapMoE(32, 64, 4, 2, 16, dtype=torch.float32, device="cpu",
                 params=OverlapParams(tile_m=64, ccta=2))
ids = torch.stack([torch.randperm(4)[:2] for _ in range(16)])
y = moe(torch.randn(16, 32, requires_grad=True), ids, torch.rand(16, 2, requires_grad=True))
with NoHostReads():  # float32: torch._grouped_mm, no per-expert loop reading the counts
    LayerFunction.backward(y.grad_fn, torch.randn(16, 32))
table = os.path.join(tempfile.mkdtemp(), "t.parquet")
assert launch("experiment=layer_train", "experiment.grid.routing=[stress_skew]",
              "experiment.grid.world_size=[1]", "experiment.grid.tokens_per_rank=[8]",
              f"table={table}", "progress=false") == 0
df = pd.read_parquet(table)
cols = ["system", "world_size", "scope", "status", "max_rel_err", "tol", "compute_ms", "comm_ms"]
out["rows"] = df[cols].to_dict("records")
print(json.dumps(out))
"""


def test_train_cells_in_one_process_match_autograd_and_wrong_gradients_fail():
    env = {"HARNESS_FUNCTIONAL": "1"}
    os.environ.update(env)  # run_interpreted passes this process's environment on
    try:
        script = SCRIPT.replace("sys.argv[1]", repr(json.dumps(CELLS)))
        got = json.loads(run_interpreted(script).splitlines()[-1])  # the run prints before
    finally:
        os.environ.pop("HARNESS_FUNCTIONAL")
    cells = [v for k, v in got.items() if k[0].isdigit()]
    assert all(ok and 0 < err < 8e-3 for ok, err, *_ in cells), cells
    assert any(c[4] for c in cells) and any(c[5] for c in cells)
    assert got["wrong owner"].startswith("dx: rel err"), got["wrong owner"]
    assert got["missing slot"].startswith("dx: rel err"), got["missing slot"]
    rows = {r["system"]: r for r in got["rows"]}  # W=1: overlap and serial
    assert all(r["status"] == "ok" and r["scope"] == "train" for r in rows.values()), rows
    assert all(0 < r["max_rel_err"] < r["tol"] for r in rows.values()), rows
    assert rows["overlap"]["compute_ms"] > 0 and rows["overlap"]["comm_ms"] > 0


#: per W of the processes: (routing, layout, T, k, dispatch)
SHM = {
    2: [("stress_skew", "compact", 16, 2, "auto"), ("balanced", "aligned", 16, 2, "nccl")],
    3: [("balanced", "aligned", 16, 6, "auto")],
    4: [("stress_skew", "aligned", 1, 2, "auto")],
}


def _shm_worker(rank: int, world: int, port: int, values) -> None:
    """Every W of SHM on the subgroup of ranks 0..W-1 (one spawn of `world` processes);
    values[i]: cell i's worst relative error (-1 where its check failed) on this rank."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["HARNESS_FUNCTIONAL"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    from harness.check import check
    from harness.measure import cell_inputs
    from harness.system import RunContext
    from harness.workload import WorkloadSpec
    from systems.overlap.system import OverlapSystem

    try:
        i, n = 0, sum(map(len, SHM.values()))
        for W, cells in SHM.items():
            group = dist.new_group(list(range(W)))  # collective on every rank
            for routing, layout, T, k, dispatch in cells:
                if rank < W:
                    spec = WorkloadSpec(T, 32, 32, 2, k, W, routing, "float16", ffn=64, train=True)
                    ctx = RunContext(rank, W, torch.device("cpu"), group, "gloo")
                    inputs, ref = cell_inputs(ctx, spec, [rank])
                    params = {"tile_m": 64, "ccta": 2, "layout": layout, "dispatch": dispatch}
                    system = OverlapSystem(ctx, params)
                    system.setup(inputs)
                    res = check(system.step.outputs(), ref)
                    system.step.check()
                    values[rank * n + i] = res.max_rel_err if res.ok else -1.0
                i += 1
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_train_cells_on_two_to_four_processes_over_shm_match_autograd():
    got = run_ranks(_shm_worker, 4, sum(map(len, SHM.values())))
    i = 0
    for W, cells in SHM.items():
        for _ in cells:
            errs = [got[r][i] for r in range(W)]
            assert all(0 < e < 8e-3 for e in errs), (W, cells, errs)
            i += 1


def test_dgate_rows_are_measured_against_the_median_row_norm_and_a_lost_row_still_fails():
    """dgate's rows are inner products that cancel (harness/check.py ROW_FLOOR): a row 10x below
    the median norm may carry its operands' rounding; a row off by half the median fails."""
    from harness.check import check

    g = torch.Generator().manual_seed(0)
    ref = {"dgate": torch.randn(400, 2, generator=g), "dx": torch.randn(400, 8, generator=g)}
    ref["dgate"][7] *= 0.01  # a cancelling dot product
    out = {k: v.clone() for k, v in ref.items()}
    med = float(ref["dgate"].norm(dim=1).median())
    out["dgate"][7] += 0.05 * med  # its rounding: 5x its own norm, 0.05 of the median
    assert check(out, ref).ok
    out["dgate"][9] += 0.5 * med
    assert not check(out, ref).ok
