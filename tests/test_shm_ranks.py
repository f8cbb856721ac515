"""The overlap system's per-process path on the CPU: W real processes (gloo), the kernels in
Triton's interpreter, peers' receive buffers and counters in one shared file (transport shm).

The harness runs operator and layer cells at W = 2, 3, 4, aligned and compact, balanced and
stress_skew, 32 tokens a rank (1 at W=4: at stress_skew some ranks receive nothing), serial
beside them, the layer cells on the host-free dispatch (harness/dispatch_peer.py); two negative
controls show the checks can fail: a transport that sends one peer's rows elsewhere, and the
operator step without its epoch handshake in front of a slow receiver (the race the handshake
exists for).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from tests.interpreted import ROOT
from tests.multigpu import run_ranks

# no triton import here: the spawned ranks import it after setting TRITON_INTERPRET
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")

STEPS = 4


def _env() -> dict:
    return {**os.environ, "TRITON_INTERPRET": "1", "HARNESS_FUNCTIONAL": "1",
            "PYTHONPATH": str(ROOT)}  # fmt: skip


#: W=4 with 1 token a rank (at stress_skew ranks receive nothing), W=2 and 3 with 32 (W=3 at
#: layer scope only): the tier's time
TOKENS = {2: ["experiment.grid.tokens_per_rank=[32]"],
          3: ["experiment.grid.tokens_per_rank=[32]", "experiment.grid.ffn=[64]"],
          4: ["experiment.grid.tokens_per_rank=[1]"]}  # fmt: skip


@pytest.mark.parametrize("world", [2, 3, 4])
def test_per_process_cells_on_shm_are_right_by_both_checks(tmp_path, world):
    table = tmp_path / "ranks.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "experiment=overlap_functional_ranks",
         f"hardware.world_size={world}", f"experiment.grid.world_size=[{world}]",
         f"table={table}", "progress=false", *TOKENS[world]],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    df = pd.read_parquet(table)
    assert (df["status"] == "ok").all(), df[["system", "ffn", "status", "reason"]]
    over = df[df["system"] == "overlap"]
    tokens = {1} if world == 4 else {32}
    scopes = 1 if world == 3 else 2
    assert len(over) == 4 * scopes * len(tokens) and set(over["transport"]) == {"shm"}
    assert set(over["p_layout"]) == {"aligned", "compact"}
    assert set(over["ffn"]) == ({64} if world == 3 else {0, 64})  # W=3: layer cells alone
    assert set(df["routing"]) == {"balanced", "stress_skew"} and (df["world_size"] == world).all()
    assert set(df["tokens_per_rank"]) == tokens  # 1 at stress_skew: a rank receives nothing
    assert len(df[df["system"] == "serial"]) == 2 * scopes * len(tokens)
    assert set(df.loc[df["ffn"] > 0, "p_dispatch_used"]) == {"device"}  # harness/dispatch_peer.py
    assert (df["max_rel_err"] < df["tol"]).all() and (df["max_row_rel_err"] < df["tol"]).all()


def test_a_loopback_layer_on_several_processes_is_one_line_before_any_process_starts(tmp_path):
    """Issue 59's repro (an out-of-bounds write of rank 0 at 6172669) is refused up front."""
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "experiment=overlap_functional", "hardware=cpu",
         "hardware.world_size=2", "experiment.grid.world_size=[2]", "experiment.grid.ffn=[32]",
         "experiment.grid.out=[32]", "experiment.grid.routing=[balanced]",
         f"table={tmp_path / 't.parquet'}"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and not (tmp_path / "t.parquet").exists()
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: overlap: transport=loopback plays every rank"), line


def _layer_worker(rank: int, world: int, port: int, drop: bool, values) -> None:
    """OverlapMoE over shm at W=`world`; drop: rank 0 sends rank 1's rows to a scratch buffer.
    values[rank]: the worst relative error of STEPS forwards against a plain torch layer."""
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    from systems.overlap import OverlapMoE, OverlapParams

    try:
        H, F, E, k, T = 32, 64, 2, 2, 16
        g = torch.Generator().manual_seed(0)
        w1 = torch.randn(world * E, H, F, generator=g) / H**0.5
        w2 = torch.randn(world * E, F, H, generator=g) / F**0.5
        mine = slice(rank * E, (rank + 1) * E)
        moe = OverlapMoE(H, F, E, k, T, dtype=torch.float32, device="cpu", group=dist.group.WORLD,
                         params=OverlapParams(tile_m=64, ccta=2), w1=w1[mine].contiguous(),
                         w2=w2[mine].contiguous())  # fmt: skip
        scratch = torch.zeros(T * k, H)
        if drop and rank == 0:
            moe.transport.recv_ptrs[1] = scratch.data_ptr()
        worst = 0.0
        for step in range(STEPS):
            gs = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(T, H, generator=gs)
            ids = torch.stack([torch.randperm(world * E, generator=gs)[:k] for _ in range(T)])
            gate = torch.softmax(torch.randn(T, k, generator=gs), -1)
            y = moe(x, ids, gate)
            moe.check()
            h = torch.nn.functional.gelu(torch.einsum("th,tkhf->tkf", x, w1[ids]))
            ref = torch.einsum("tkf,tkfh,tk->th", h, w2[ids], gate)
            worst = max(worst, float((y - ref).norm() / ref.norm()))
        values[rank] = worst
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_layer_over_shm_is_exact_and_a_transport_that_drops_a_peer_fails():
    good = run_ranks(_layer_worker, 2, 1, False)
    assert max(v for (v,) in good) < 1e-5, good
    bad = run_ranks(_layer_worker, 2, 1, True)
    assert bad[0][0] < 1e-5 and bad[1][0] > 0.1, bad  # rank 1 lost rank 0's rows


def _handshake_worker(rank: int, world: int, port: int, handshake: bool, values) -> None:
    """The overlap system's per-process operator step over shm; rank 1 sleeps before reading
    its receive buffer. Step s scales every input by 2^(s % 3) (exact), so each output must be
    the reference times that factor. values[rank * STEPS + s]: step s's relative error."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["HARNESS_FUNCTIONAL"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    from harness.measure import cell_inputs
    from harness.system import RunContext
    from harness.workload import WorkloadSpec
    from systems.overlap.system import OverlapSystem

    try:
        spec = WorkloadSpec(tokens_per_rank=32, hidden=32, out=32, experts_per_rank=2, top_k=2,
                            world_size=world, routing="balanced", dtype="float16")  # fmt: skip
        ctx = RunContext(rank, world, torch.device("cpu"), None, "gloo")
        inputs, ref = cell_inputs(ctx, spec, [rank])
        system = OverlapSystem(ctx, {"tile_m": 64, "ccta": 2})
        system.setup(inputs)
        step = system.step
        step.handshake = handshake
        rk, x0 = step.rk, step.rk.x.clone()
        if rank == 1:  # the slow receiver
            scaled = rk.scaled
            rk.scaled = lambda: time.sleep(1.5) or scaled()
        for s in range(STEPS):
            rk.x.copy_(x0 * 2.0 ** (s % 3))
            out = system.timed().float()
            want = ref.float() * 2.0 ** (s % 3)
            values[rank * STEPS + s] = float((out - want).norm() / want.norm())
        step.check()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_epoch_handshake_protects_a_slow_receiver_and_without_it_the_check_fails():
    safe = run_ranks(_handshake_worker, 2, STEPS, True)
    assert max(max(e) for e in safe) < 8e-3, safe
    racy = run_ranks(_handshake_worker, 2, STEPS, False)
    assert max(racy[1]) > 0.1, racy  # rank 1 read rows of rank 0's next step
