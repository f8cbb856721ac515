"""The `overlap` system: the paper's method. Stage A (plan), stage B (producer + consumer), scale.

Per rank: the plan (systems/overlap/plan.py) lays the dispatched rows out remote-aligned
(X [P, K], zero rows where gather_index == -1; built in setup, like every system's permute);
forward runs the persistent producer (SMs - cCTA programs) and the consumer (cCTA programs, high
priority stream) concurrently, copies the local rows into the own combine receive buffer, waits
until every peer's rows arrived, and scales: out [T, N].

Transports (cell param `transport`; empty = `loopback` with one process, `p2p` with several):
  loopback  one process plays all W ranks of the cell on one GPU; destinations are regions of
            one local buffer. forward() (the checked output) runs every simulated rank and
            returns the W outputs stacked [W*T, N]; the TIMED region is the busiest simulated
            rank's step (producer + consumer + local copy + scale), which has no peers to wait
            for. A development proxy: never an interconnect number.
  p2p       one process per GPU, peer pointers from torch symmetric memory (CUDA backend)
  nvshmem   one process per GPU, torch symmetric memory on NVSHMEM (wide stores to its peers)
compute_only(): everything but the communication: the producer alone on ALL SMs without flags,
the local copy and scale; comm_only(): the consumer alone on cCTA SMs with the flags taken as
set. The harness derives the overlap ratio from these.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.layout import rank_layout
from harness.reference import dispatch_local, scale
from harness.system import CellInputs, RunContext, System
from harness.workload import WorkloadSpec, make_rank_weights
from systems.overlap.plan import padded_input, plan_for_layout

TILE_MS = (64, 128)
DEFAULT_TILE_M = 128
DEFAULT_CCTA = 16
DEFAULT_MGB = 1


class _Rank:
    """One (possibly simulated) rank's state: layout, plan, padded operands, runner."""

    def __init__(self, spec: WorkloadSpec, lay, x_recv, weights, tile_m, mgb, transport, ccta):
        from systems.overlap.runner import OverlapRunner

        self.lay = lay
        self.plan = plan_for_layout(
            lay,
            world_size=spec.world_size,
            experts_per_rank=spec.experts_per_rank,
            tile_m=tile_m,
            mgb=mgb,
            out_cols=spec.out,
            elem_bytes=x_recv.element_size(),
            device=x_recv.device,
        )
        self.x = padded_input(x_recv, self.plan.gather_index)
        self.y = torch.empty(self.x.shape[0], spec.out, dtype=x_recv.dtype, device=x_recv.device)
        self.runner = OverlapRunner(self.plan, weights, transport, ccta=ccta)
        self.tokens = spec.tokens_per_rank

    def step(self) -> None:
        """Producer + consumer concurrently, then the local rows into the own buffer."""
        self.runner.overlapped(self.x, self.y)
        self.runner.local_copy(self.y)


class OverlapSystem(System):
    name = "overlap"

    def __init__(self, ctx: RunContext, params: dict[str, Any]) -> None:
        super().__init__(ctx, params)
        self.ccta = int(params.get("ccta") or DEFAULT_CCTA)
        self.mgb = int(params.get("mgb") or DEFAULT_MGB)
        self.tile_m = int(params.get("tile_m") or DEFAULT_TILE_M)
        self._transport = str(params.get("transport") or "")

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        ccta = int(params.get("ccta") or DEFAULT_CCTA)
        if sm_count and not 1 <= ccta < sm_count:
            raise ValueError(f"overlap: ccta={ccta} must be in [1, {sm_count})")
        if int(params.get("tile_m") or DEFAULT_TILE_M) not in TILE_MS:
            raise ValueError(f"overlap: tile_m must be one of {TILE_MS}")
        if int(params.get("mgb") or DEFAULT_MGB) < 1:
            raise ValueError("overlap: mgb must be >= 1")
        if spec.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"overlap: dtype must be float16 or bfloat16, got {spec.dtype}")
        if spec.hidden % 8 or spec.out % 8:
            raise ValueError("overlap: K and N must be multiples of 8 (16-byte rows)")
        tr = params.get("transport") or ""
        if tr not in ("", "loopback", "p2p", "nvshmem"):
            raise ValueError(f"overlap: unknown transport {tr!r}; choices: loopback, p2p, nvshmem")

    # -- setup ---------------------------------------------------------------------------
    def setup(self, inputs: CellInputs) -> None:
        spec, ctx = inputs.spec, self.ctx
        tr = self._transport or ("loopback" if ctx.world_size == 1 else "p2p")
        self._transport = tr
        if tr == "loopback":
            if ctx.world_size != 1:
                raise ValueError("loopback plays every rank in one process: run with W=1 process")
            self._setup_loopback(spec, inputs)
        else:
            if spec.world_size != ctx.world_size or ctx.world_size < 2:
                raise ValueError(f"{tr} needs one process per rank and at least 2 ranks")
            self._setup_distributed(spec, inputs, tr)

    def _setup_loopback(self, spec: WorkloadSpec, inputs: CellInputs) -> None:
        from systems.overlap.transport import LoopbackFabric

        dev = inputs.x.device
        W = spec.world_size
        self.fabric = LoopbackFabric(
            [spec.tokens_per_rank * spec.top_k] * W, spec.out, spec.torch_dtype, dev
        )
        self.ranks = []
        for r in range(W):
            lay = inputs.layout if r == inputs.layout.rank else rank_layout(spec, r)
            x_recv = inputs.x_recv if r == inputs.layout.rank else dispatch_local(spec, lay, dev)
            w = inputs.weights if r == inputs.layout.rank else make_rank_weights(spec, r, dev)
            t = self.fabric.transport(r)
            self.ranks.append(_Rank(spec, lay, x_recv, w, self.tile_m, self.mgb, t, self.ccta))
        self.simulated_ranks = list(range(W))
        self.busy = max(range(W), key=lambda r: self.ranks[r].x.shape[0])

    def _setup_distributed(self, spec: WorkloadSpec, inputs: CellInputs, tr: str) -> None:
        from systems.overlap.transport import nvshmem_transport, p2p_transport

        make = p2p_transport if tr == "p2p" else nvshmem_transport
        rows = spec.tokens_per_rank * spec.top_k
        t = make(self.ctx.group, rows, spec.out, spec.torch_dtype, inputs.x.device)
        me = _Rank(
            spec,
            inputs.layout,
            inputs.x_recv,
            inputs.weights,
            self.tile_m,
            self.mgb,
            t,
            self.ccta,
        )
        self.ranks = [me]
        self.busy = 0

    # -- runs ----------------------------------------------------------------------------
    def forward(self) -> torch.Tensor:
        if self._transport == "loopback":
            for rk in self.ranks:
                rk.step()
            outs = [
                scale(self.fabric.recv(r), rk.lay, rk.tokens) for r, rk in enumerate(self.ranks)
            ]
            for rk in self.ranks:
                rk.runner.check()
            return torch.cat(outs)
        out = self.timed()
        self.ranks[0].runner.check()
        return out

    def timed(self) -> torch.Tensor:
        """The timed region: one rank's overlapped step and scale (the busiest in loopback)."""
        rk = self.ranks[self.busy]
        rk.step()
        if self._transport != "loopback":
            rows_from = rk.plan.recv_rows.clone()
            rows_from[rk.plan.rank] = 0  # own rows arrive by the local copy, not a signal
            rk.runner.wait_received(rows_from)
        return scale(rk.runner.transport.recv, rk.lay, rk.tokens)

    def compute_only(self) -> torch.Tensor:
        """Everything timed() does but the communication: producer on ALL SMs without flags,
        local copy and scale."""
        rk = self.ranks[self.busy]
        sms = torch.cuda.get_device_properties(rk.x.device).multi_processor_count
        rk.runner.compute_only(rk.x, rk.y, num_programs=sms)
        rk.runner.local_copy(rk.y)
        return scale(rk.runner.transport.recv, rk.lay, rk.tokens)

    def comm_only(self) -> None:
        self.ranks[self.busy].runner.comm_only(self.ranks[self.busy].y)

    # -- reporting -----------------------------------------------------------------------
    @property
    def impl(self) -> str:
        return "native (triton producer/consumer)"

    @property
    def transport(self) -> str:
        return self._transport

    def row_fields(self) -> dict[str, Any]:
        rk = self.ranks[self.busy]
        tile = rk.runner.tile
        return {
            "ccta": self.ccta,
            "mgb": self.mgb,
            "tile_m": tile.block_m,
            "tile_n": tile.block_n,
            "tile_k": tile.block_k,
        }

    @property
    def extra(self) -> dict[str, Any]:
        p = self.ranks[self.busy].plan
        return {
            "timed_rank": self.busy,
            "padded_rows": int(p.n_padded),
            "valid_rows": int(p.n_rows),
            "bands": int(p.n_bands),
            "remote_bands": int(p.n_remote_bands),
            "segments": int(p.n_segments),
            "producer_programs": self.ranks[self.busy].runner.num_programs,
        }
