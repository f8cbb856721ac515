"""The overlap system's steps (harness.system.Step): what the harness times, checks and bounds,
per scope (layer, operator) and per way of running the ranks: one process per rank (p2p /
nvshmem / shm, or W=1) or one process playing every rank over loopback.
"""

from __future__ import annotations

import torch

from harness.experts import grouped_mm_usable
from harness.system import CellInputs, Step
from systems.overlap.operator import OperatorRank
from systems.overlap.params import OverlapParams
from systems.overlap.rank_experts import RankExperts, all_sms


def _plan_facts(plan, runner) -> dict:
    """The row's facts of one rank's plan (host ints)."""
    return {
        "layout": plan.layout,
        "padded_rows": int(plan.n_padded),
        "valid_rows": int(plan.n_rows),
        "bands": int(plan.n_bands),
        "remote_bands": int(plan.n_remote_bands),
        "segments": int(plan.n_segments),
        "producer_programs": runner.num_programs,
        "consumer_sms": runner.consumer_sms,
    }


def _serialized(step: Step, runners) -> torch.Tensor:
    """step.timed() with each runner's producer run to the end before its consumer starts
    (runner.sequential for runner.overlapped): the method's own kernels, not overlapped."""
    for r in runners:
        r.overlapped = r.sequential
    try:
        return step.timed()
    finally:
        for r in runners:
            del r.overlapped


def _fc1_blocker(x: torch.Tensor, w1: torch.Tensor) -> str | None:
    if not grouped_mm_usable(x, w1):
        return "the per-expert fc1 fallback needs the expert counts on the host"
    return None


class _Checked(Step):
    """outputs(): the timed region, then check() (the device-side waits; by default those of
    every played rank's runner)."""

    def outputs(self) -> torch.Tensor:
        out = self.timed()
        self.check()
        return out

    def check(self) -> None:
        for rk in self.ranks:
            rk.runner.check()


class LayerStep(_Checked):
    """The public layer on this rank's cell: timed() is moe(x, expert_ids, gate) -> [T, H]."""

    def __init__(self, inp: CellInputs, group, params: OverlapParams) -> None:
        from systems.overlap.layer import OverlapMoE

        spec = inp.spec
        self.moe = OverlapMoE(
            spec.hidden,
            spec.ffn,
            spec.experts_per_rank,
            spec.top_k,
            spec.tokens_per_rank,
            group=group,
            params=params,
            w1=inp.w1,
            w2=inp.weights,
        ).requires_grad_(False)  # the forward alone (TrainStep turns the gradients on)
        self.x, self.ids, self.gate = inp.x, inp.expert_ids, inp.gate
        self.held = self.moe.hold(self.x, self.ids)  # one untimed dispatch: bounds, facts
        ex = self.moe.experts
        self.runner = ex.runner  # the timed rank's
        self.facts = _plan_facts(self.held.plan.trimmed(), ex.runner)
        if not ex.combines:  # W=1: the producer alone on every SM, no consumer
            self.facts |= {"producer_programs": all_sms(self.x.device), "consumer_sms": "none"}
        self.metrics = {}
        if self.moe.dispatch == "device":
            self.metrics = {"recv_worst_mib": self.moe.dispatcher.recv_mib}

    def timed(self) -> torch.Tensor:
        return self.moe(self.x, self.ids, self.gate)

    def check(self) -> None:
        self.moe.check()

    def buffers(self) -> list[torch.Tensor]:
        return self.moe.experts.buffers()

    def capture_blocker(self) -> str | None:
        if self.moe.dispatch == "nccl":
            return "dispatch=nccl: the split sizes' host sync"
        return _fc1_blocker(self.x, self.moe.w1)

    def compute_only(self) -> torch.Tensor:
        return self.moe.compute_only(self.held, self.gate)

    def comm_only(self) -> None:
        self.moe.comm_only(self.held, self.x, self.ids)

    def serialized(self) -> torch.Tensor:
        return _serialized(self, [self.moe.experts.runner])


class PlayedLayerStep(_Checked):
    """Every rank of a loopback cell in one process: one host-free dispatch of every rank, each
    rank's experts (puts into one LoopbackFabric) and scale; timed() stacks them [W*T, H]."""

    timed_rank = None

    def __init__(self, ranks: list[CellInputs], params: OverlapParams) -> None:
        from harness.dispatch_device import PlayedDispatch
        from systems.overlap.transport import LoopbackFabric

        spec = ranks[0].spec
        W, T, k = spec.world_size, spec.tokens_per_rank, spec.top_k
        x0 = ranks[0].x
        self.played = PlayedDispatch(W, spec.experts_per_rank, T, k, x0)
        self.xs, self.ids = [i.x for i in ranks], [i.expert_ids for i in ranks]
        self.gates = [i.gate for i in ranks]
        self.fabric = LoopbackFabric([T * k] * W, spec.out, spec.torch_dtype, x0.device)
        first = self.played(self.xs, self.ids)
        self.ranks = [
            RankExperts(
                inp.w1, inp.weights, W, r, T * k, self.fabric.transport(r), params, first[r]
            )
            for r, inp in enumerate(ranks)
        ]
        self.runner = self.ranks[0].runner  # the row's facts: rank 0's
        self.facts = _plan_facts(self.ranks[0].first.plan.trimmed(), self.runner)
        self.metrics = {"recv_worst_mib": self.played.recv_mib}

    def timed(self) -> torch.Tensor:
        ds = self.played(self.xs, self.ids, gather=False)  # rows gathered into x_pad directly
        for rk, d in zip(self.ranks, ds):
            rk.experts(d)
        return torch.cat([rk.scale(d, g) for rk, d, g in zip(self.ranks, ds, self.gates)])

    def buffers(self) -> list[torch.Tensor]:
        return [t for rk in self.ranks for t in rk.buffers()]

    def capture_blocker(self) -> str | None:
        return _fc1_blocker(self.xs[0], self.ranks[0].w1)

    def serialized(self) -> torch.Tensor:
        return _serialized(self, [rk.runner for rk in self.ranks])


class _OperatorStep(_Checked):
    """What both operator steps share: the bounds of the timed rank `rk`; facts: its plan's."""

    rk: OperatorRank
    facts: dict

    @property
    def runner(self):
        """The timed rank's runner."""
        return self.rk.runner

    def capture_blocker(self) -> str | None:
        return "overlap operator step: not declared capturable (only the layer step is)"

    def compute_only(self) -> torch.Tensor:
        """The producer alone on ALL SMs without flags, the scale."""
        return self.compute_shared(all_sms(self.rk.x.device))

    def compute_shared(self, num_programs: int | None = None) -> torch.Tensor:
        """The producer alone without flags on num_programs (None: its own grid), the scale."""
        self.rk.runner.compute_only(self.rk.x, self.rk.y, num_programs=num_programs)
        return self.rk.scaled()

    def comm_only(self) -> None:
        """The consumer alone on cCTA SMs, flags taken as set."""
        self.rk.runner.comm_only(self.rk.y)

    def serialized(self) -> torch.Tensor:
        return _serialized(self, [self.rk.runner])

    def buffers(self) -> list[torch.Tensor]:
        """The timed rank's receive buffer and GEMM output (its padded input is fixed)."""
        return [self.rk.runner.transport.recv, self.rk.y]

    def extra_bounds(self) -> dict:
        """compute_shared (m_compute_shared_ms; docs/method.md, Bounds)."""
        return {"compute_shared": self.compute_shared}


class PlayedOperatorStep(_OperatorStep):
    """Every rank of a loopback cell in one process; outputs() runs them all ([W*T, N]), the
    timed region is the busiest rank's step and scale (it has no peers to wait for)."""

    def __init__(self, ranks: list[CellInputs], params: OverlapParams) -> None:
        from systems.overlap.transport import LoopbackFabric

        spec = ranks[0].spec
        rows = [spec.tokens_per_rank * spec.top_k] * spec.world_size
        self.fabric = LoopbackFabric(rows, spec.out, spec.torch_dtype, ranks[0].x.device)
        self.ranks = [
            OperatorRank(inp, self.fabric.transport(r), params) for r, inp in enumerate(ranks)
        ]
        self.timed_rank = max(range(len(ranks)), key=lambda r: self.ranks[r].x.shape[0])
        self.rk = self.ranks[self.timed_rank]
        self.facts = _plan_facts(self.rk.plan, self.rk.runner)

    def outputs(self) -> torch.Tensor:
        for rk in self.ranks:
            rk.step()
        outs = [rk.scaled() for rk in self.ranks]
        self.check()
        return torch.cat(outs)

    def timed(self) -> torch.Tensor:
        self.rk.step()
        return self.rk.scaled()

    def poison(self) -> None:
        """Every rank's buffers NaN, then the other played ranks' steps put their rows again:
        what they send the timed rank is its peers' work, the rest must come from its call."""
        for rk in self.ranks:
            rk.runner.transport.recv.fill_(float("nan"))
            rk.y.fill_(float("nan"))
        for rk in self.ranks:
            if rk is not self.rk:
                rk.step()


class PerProcessOperatorStep(_OperatorStep):
    """This rank of a cell run one process per rank (p2p / nvshmem on GPUs, shm on the CPU)."""

    def __init__(self, inp: CellInputs, group, transport: str, params: OverlapParams) -> None:
        from systems.overlap.transport import peer_transport

        spec = inp.spec
        rows = spec.tokens_per_rank * spec.top_k
        t = peer_transport(transport, group, rows, spec.out, spec.torch_dtype, inp.x.device)
        self.rk, self.group = OperatorRank(inp, t, params), group
        self.epoch = torch.zeros(1, dtype=torch.int32, device=inp.x.device)
        #: the epoch handshake before every step; False only in the test that shows the race
        self.handshake = True
        self.facts = _plan_facts(self.rk.plan, self.rk.runner)

    def timed(self) -> torch.Tensor:
        """The epoch handshake (why: docs/method.md, The operator; a one-element NCCL
        all-reduce on the step's stream, timed), this rank's step, the wait for every peer's
        rows, the scale."""
        import torch.distributed as dist

        if self.handshake:
            dist.all_reduce(self.epoch, group=self.group)
        self.rk.step()
        self.rk.runner.wait_received()  # every peer's rows of every step so far
        return self.rk.scaled()

    def check(self) -> None:
        self.rk.runner.check()
