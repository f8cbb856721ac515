"""OverlapMoE's backward pass, overlapped at tile level like its forward (the roles reversed):
the derivation is docs/method.md, "The backward pass". A training forward keeps its plan, x_pad
[P, H] and the rows its combine brought [T*k, H] (RankExperts.keep); a and h are recomputed.
"""

from __future__ import annotations

import torch

from harness import dispatch as ld
from harness.experts import grouped_mm_usable
from harness.scale import Scaler
from systems.overlap.plan_device import padded_input_device
from systems.overlap.rank_experts import Held, RankExperts, all_sms, make_runner
from systems.overlap.steps import LayerStep, PlayedLayerStep, _serialized


def per_expert(plan, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [P', K] in plan's padded layout times w[e] [K, N] (any strides) per expert ->
    [P', N]; rows past the plan's n_padded are junk."""
    if grouped_mm_usable(x, w):
        return torch._grouped_mm(x, w, offs=plan.expert_row_start[1:].to(torch.int32))
    y, s = x.new_zeros(x.shape[0], w.shape[2]), plan.expert_row_start.tolist()
    for e in range(len(s) - 1):
        torch.matmul(x[s[e] : s[e + 1]], w[e], out=y[s[e] : s[e + 1]])
    return y


def per_expert_t(plan, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The weight gradient sum over expert e's rows of a^T b: [P', K], [P', N] -> [E, K, N]."""
    if grouped_mm_usable(a, b.view(1, *b.shape)):
        return torch._grouped_mm(a.t(), b, offs=plan.expert_row_start[1:].to(torch.int32))
    s = plan.expert_row_start.tolist()
    return torch.stack([a[s[e] : s[e + 1]].t() @ b[s[e] : s[e + 1]] for e in range(len(s) - 1)])


def owner_grads(rows: torch.Tensor, gate: torch.Tensor, dy: torch.Tensor):
    """(dgate [T, k] float32, dz [T*k, H] in dy's dtype) from the forward's combined rows
    [T*k, H] (pair order), gate [T, k] and dy [T, H]."""
    T, k = gate.shape
    dgate = torch.einsum("th,tkh->tk", dy.float(), rows.view(T, k, -1).float())
    dz = gate.float().unsqueeze(-1) * dy.float().unsqueeze(1)
    return dgate, dz.to(dy.dtype).flatten(0, 1)


def pair_rows(ds: list, dzs: list[torch.Tensor]) -> list[torch.Tensor]:
    """In one process (W=1, played ranks): every rank's received rows [bound, H] of the
    pair-order rows dzs[s] [T*k, H] of every source s, gathered by its dispatch's labels."""
    S = dzs[0].shape[0]
    pair = torch.cat([d.send_order + s * S for s, d in enumerate(ds)])  # send row -> pair
    dz = torch.cat(dzs) if len(dzs) > 1 else dzs[0]
    at = [(d.recv_src * S + d.recv_dst_index).clamp_min(0) for d in ds]
    return [dz.index_select(0, pair.index_select(0, i)) for i in at]


def combined_rows(ex: RankExperts, d) -> torch.Tensor:
    """A copy of what the forward's combine of dispatch d brought, [T*k, H] in pair order."""
    return ex.runner.transport.recv.index_select(0, d.pos.reshape(-1))


class RankBackward:
    """The expert side of one rank's backward (ex: its RankExperts, after a training forward):
    fc1's data gradient runs on a runner of its own over W1^T [E, F, H] and the forward's
    transport (one receive count for both runners' rows)."""

    def __init__(self, ex: RankExperts) -> None:
        self.ex, self.y = ex, None
        self.w1t = ex.w1.detach().transpose(1, 2).contiguous()
        self.runner = make_runner(ex.first.plan, self.w1t, ex.runner.transport, ex.params)
        self.runner.recv_expected = ex.runner.recv_expected
        self.runner.band_ready = torch.zeros_like(ex.runner.band_ready)
        self.unit = None  # the dx sum's unit gates [T, k]
        self.side = torch.cuda.Stream(self.w1t.device) if self.w1t.is_cuda else None

    def experts(self, held: Held, dz_recv: torch.Tensor, overlapped: bool = True):
        """(dW1, dW2) of this rank's experts from the received rows of dz [>= R, H]; fc1's data
        gradient rows leave for their owners where the layer combines and `overlapped` (else
        the producer alone on ALL SMs stores the local rows: the compute bound)."""
        ex, plan, x_pad = self.ex, held.plan, held.x_pad
        w1, w2 = ex.w1.detach(), ex.w2.detach()
        dz = padded_input_device(dz_recv, plan)
        a = per_expert(plan, x_pad, w1)
        da = torch.ops.aten.gelu_backward(per_expert(plan, dz, w2.transpose(1, 2)), a)
        self.w1t.copy_(w1.transpose(1, 2))  # the weights may have changed since the last step
        cur = torch.cuda.current_stream(a.device) if self.side else None
        if cur is not None:  # the weight gradients beside the return (joined below)
            self.side.wait_stream(cur)
            torch.cuda.set_stream(self.side)
        dw2 = per_expert_t(plan, torch.nn.functional.gelu(a), dz)
        dw1 = per_expert_t(plan, x_pad, da)
        if cur is not None:
            torch.cuda.set_stream(cur)
        self.runner.use_plan(plan)
        y = self.y = ex._buffer(self.y, da, self.w1t.shape[2])
        if ex.combines and overlapped:
            self.runner.overlapped(da, y)
        else:
            self.runner.compute_only(da, y, num_programs=all_sms(da.device))
        if cur is not None:
            cur.wait_stream(self.side)
            dw1.record_stream(cur)
            dw2.record_stream(cur)
        return dw1, dw2

    def dx(self, held: Held, wait: bool) -> torch.Tensor:
        """dx [T, H]: the sum of each token's k gradient rows in the receive buffer; wait: for
        every peer's rows first (one process per rank)."""
        pos = held.dispatch.pos
        if wait:
            self.runner.wait_received()
        if self.unit is None or self.unit.shape != pos.shape:
            self.unit = torch.ones(pos.shape, device=pos.device)
        return Scaler.on_device(pos, self.unit, pos.numel())(self.runner.transport.recv)


def rank_backward(ex: RankExperts) -> RankBackward:
    if ex.back is None:
        ex.back = RankBackward(ex)
    return ex.back


def to_experts(moe, d, dz: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """The received rows of dz [T*k, H] (pair order) on this rank, in d's received order."""
    if moe.group is not None and moe.dispatch == "device":  # per-pair rows, the layer's dispatch
        return moe._dispatch(dz, expert_ids).x_recv
    return ld.redispatch(d, dz, 1, moe.group)  # W=1 or nccl's held splits: send row j's pair


class LayerFunction(torch.autograd.Function):
    """OverlapMoE's forward with its overlapped backward (module doc)."""

    @staticmethod
    def forward(ctx, moe, expert_ids, x, gate, w1, w2):
        ex = moe.experts
        ex.keep = True
        try:
            y = moe._step(x, expert_ids, gate)
        finally:
            ex.keep = False
        ctx.moe, ctx.ids, ctx.held = moe, expert_ids, ex.kept
        ctx.save_for_backward(gate, combined_rows(ex, ex.kept.dispatch))
        return y

    @staticmethod
    def backward(ctx, dy):
        moe, held = ctx.moe, ctx.held
        gate, rows = ctx.saved_tensors
        back = rank_backward(moe.experts)
        dgate, dz = owner_grads(rows, gate, dy.contiguous())
        dw1, dw2 = back.experts(held, to_experts(moe, held.dispatch, dz, ctx.ids))
        dx = back.dx(held, wait=moe.experts.combines)
        return None, None, dx, dgate.to(gate.dtype), dw1, dw2


class _Train:
    """The train scope (harness): timed() is one forward + backward and returns every played
    rank's {"out", "dx", "dgate", "dw1", "dw2"}, stacked; eager only."""

    timed_rank = None

    def capture_blocker(self) -> str | None:
        return "train scope: autograd's backward is not captured"

    def serialized(self) -> dict:
        """The step with the forward's and the backward's runners serialized."""
        exs = getattr(self, "ranks", None) or [self.moe.experts]
        return _serialized(self, [r for ex in exs for r in (ex.runner, rank_backward(ex).runner)])


class LayerTrainStep(_Train, LayerStep):
    """The public layer under torch autograd: fresh gradients of x, gate, w1, w2 every call."""

    def __init__(self, inp, group, params) -> None:
        super().__init__(inp, group, params)
        self.moe.requires_grad_(True)
        self.dy = inp.dy
        self.xg = inp.x.detach().clone().requires_grad_()
        self.gg = inp.gate.detach().clone().requires_grad_()
        self.dz = inp.dy.repeat_interleave(inp.spec.top_k, 0)  # pair rows for comm_only

    def timed(self) -> dict:
        moe, xg, gg = self.moe, self.xg, self.gg
        for t in (xg, gg, moe.w1, moe.w2):
            t.grad = None
        y = moe(xg, self.ids, gg)
        y.backward(self.dy)
        return dict(out=y.detach(), dx=xg.grad, dgate=gg.grad, dw1=moe.w1.grad, dw2=moe.w2.grad)

    @torch.no_grad()
    def compute_only(self) -> tuple:
        """The step without its four exchanges, on the held dispatch: the forward's compute
        bound, the owner's gradients, the experts' with the held received rows standing in for
        dz's and fc1's data gradient by the producer alone (no puts), the dx sum."""
        ex, held = self.moe.experts, self.held
        out = self.moe.compute_only(held, self.gate)
        dgate, _ = owner_grads(combined_rows(ex, held.dispatch), self.gate, self.dy)
        back = rank_backward(ex)
        dw = back.experts(held, held.dispatch.x_recv, overlapped=False)
        return out, dgate, dw, back.dx(held, wait=False)

    @torch.no_grad()
    def comm_only(self) -> None:
        """The forward's two exchanges, then the backward's: dz's rows to the experts' ranks
        (with a group) and fc1's data-gradient puts (flags taken as set)."""
        self.moe.comm_only(self.held, self.x, self.ids)
        back, held = rank_backward(self.moe.experts), self.held
        if self.moe.group is not None:
            to_experts(self.moe, held.dispatch, self.dz, self.ids)
        back.runner.use_plan(held.plan)
        back.runner.comm_only(self.moe.experts._buffer(back.y, held.x_pad, self.x.shape[1]))


class PlayedTrainStep(_Train, PlayedLayerStep):
    """One process playing every rank (loopback): every rank's training forward, then every
    rank's backward, each stage for all ranks before the next."""

    def __init__(self, ranks, params) -> None:
        super().__init__(ranks, params)
        self.dys = [i.dy for i in ranks]

    def timed(self) -> dict:
        ranks, ds = self.ranks, self.played(self.xs, self.ids, gather=False)
        for rk, d in zip(ranks, ds):
            rk.keep = True
            rk.experts(d)
            rk.keep = False
        out = torch.cat([rk.scale(d, g) for rk, d, g in zip(ranks, ds, self.gates)])
        rows = [combined_rows(rk, d) for rk, d in zip(ranks, ds)]  # all before any dx put
        owner = [owner_grads(r, g, dy) for r, g, dy in zip(rows, self.gates, self.dys)]
        recv = pair_rows(ds, [dz for _, dz in owner])
        dw = [rank_backward(rk).experts(rk.kept, r) for rk, r in zip(ranks, recv)]
        dx = torch.cat([rk.back.dx(rk.kept, wait=False) for rk in ranks])
        (dw1, dw2), dgate = (torch.cat(w) for w in zip(*dw)), torch.cat([g for g, _ in owner])
        return {"out": out, "dx": dx, "dgate": dgate, "dw1": dw1, "dw2": dw2}

    def check(self) -> None:
        super().check()
        for rk in self.ranks:
            if rk.back is not None:
                rk.back.runner.check()
