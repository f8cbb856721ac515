"""OverlapMoE: the paper's method as a torch module (docs/method.md, The layer as a library).

    moe = OverlapMoE(hidden=H, ffn=F, experts_per_rank=E, top_k=k, max_tokens=T_max)
    y = moe(x, expert_ids, gate)          # x [T, H], expert_ids [T, k], gate [T, k] -> [T, H]

Without a group this process is the whole world (W=1: fc2 is the producer alone); with one (one
process per rank) the dispatch is harness/dispatch_peer.py's: no host read, CUDA-graph
capturable (params.dispatch=nccl: one host sync a step). The backward is overlapped too
(backward.py; docs/method.md, The backward pass).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from harness import dispatch as ld
from harness.workload import DTYPES, WorkloadSpec
from systems.overlap.params import AUTO, KERNEL_DTYPES, OverlapParams
from systems.overlap.rank_experts import RankExperts, all_sms


def resolve(params: OverlapParams, spec: WorkloadSpec, transport: str, sm_count: int):
    """(params with every "auto" picked on the host, the picks' reasons {name: why}) for a cell
    of `spec` over `transport` on a GPU of sm_count SMs (0: the CPU)."""
    why = {}
    if AUTO in (params.ccta, params.mgb):
        from systems.overlap.autotune import pick

        ccta, mgb, why["auto"] = pick(
            spec, transport, sm_count, ccta=params.ccta, mgb=params.mgb, consumer=params.consumer
        )
        params = replace(params, ccta=int(ccta), mgb=int(mgb))
    if params.order == AUTO:
        from systems.overlap.autotune import pick_order

        order, why["auto_order"] = pick_order(spec, params.tile_m)
        params = replace(params, order=order)
    return params, why


def _dtype_device(dtype, device, w1) -> tuple[torch.dtype, torch.device]:
    """dtype and device as given, else w1's, else bfloat16 on the current GPU (or the CPU)."""
    dtype = dtype or (w1.dtype if w1 is not None else torch.bfloat16)
    if device is None:
        device = w1.device if w1 is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return dtype, device


class OverlapMoE(torch.nn.Module):
    """The MoE layer of one rank: w1 [E, H, F] and w2 [E, F, H] are this rank's experts (global
    expert g lives on rank g // E as local expert g % E).

    hidden H, ffn F, experts_per_rank E, top_k k, max_tokens: the most tokens a forward takes
    (every buffer is sized for it once); group: None (W=1) or the process group of the ranks;
    params: OverlapParams ("auto" knobs picked for a balanced routing of max_tokens); w1, w2:
    existing weights to use (not copied), else new ones drawn like nn.Linear's; dtype and
    device: as given, else w1's, else bfloat16 on the current GPU (or the CPU)."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        experts_per_rank: int,
        top_k: int,
        max_tokens: int,
        *,
        dtype: torch.dtype | None = None,
        device=None,
        group=None,
        params: OverlapParams | None = None,
        w1: torch.Tensor | None = None,
        w2: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        import torch.distributed as dist

        dtype, device = _dtype_device(dtype, device, w1)
        W = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        E, H, F, k = experts_per_rank, hidden, ffn, top_k
        self.world_size, self.rank, self.top_k, self.max_tokens = W, rank, k, max_tokens
        self.w1 = torch.nn.Parameter(self._weight(w1, (E, H, F), dtype, device))
        self.w2 = torch.nn.Parameter(self._weight(w2, (E, F, H), dtype, device))
        params = params or OverlapParams()
        self.transport_name = params.transport_for(W, device.type)
        if (group is None) != (self.transport_name == "loopback"):
            raise ValueError(
                f"OverlapMoE: transport {self.transport_name} with W={W}: loopback "
                "is this process alone (no group), p2p / nvshmem / shm need a group"
            )
        name = next((n for n, t in DTYPES.items() if t == dtype), str(dtype).split(".")[-1])
        spec = WorkloadSpec(max_tokens, H, H, E, k, W, "balanced", name, ffn=F)
        sms = all_sms(device) if device.type == "cuda" else 0
        cpu = device.type == "cpu"  # Triton's interpreter also runs float32
        params.validate(spec, sms, (*KERNEL_DTYPES, "float32") if cpu else KERNEL_DTYPES)
        #: the knobs that run ("auto" picked) and each pick's reason {"auto": ..., ...}
        self.params, self.picks = resolve(params, spec, self.transport_name, sms)
        self.group = group
        from harness.dispatch_device import dispatch_used

        #: "device" (host-free) or "nccl" (NCCL's all-to-all: one host sync a step)
        self.dispatch = dispatch_used(self.params.dispatch, W, group is None)
        rows = max_tokens * k  # the combine's receive buffer: every (token, slot) of this rank
        self.transport = self._transport(rows, H, dtype, device)
        self.dispatcher = self._dispatcher(E, H, dtype, device)
        x0 = torch.zeros(max_tokens, H, dtype=dtype, device=device)
        # the first plan's routing: token t's slot j to expert (t*k + j) mod W*E (distinct)
        ids = (torch.arange(max_tokens * k, device=device) % (W * E)).view(max_tokens, k)
        first = self._dispatch(x0, ids)
        self.experts = RankExperts(
            self.w1, self.w2, W, rank, rows, self.transport, self.params, first
        )

    @staticmethod
    def _weight(w, shape, dtype, device) -> torch.Tensor:
        if w is None:  # nn.Linear's draw: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = shape[1] ** -0.5
            return torch.empty(shape, dtype=dtype, device=device).uniform_(-bound, bound)
        if tuple(w.shape) != shape or w.dtype != dtype or w.device != device:
            raise ValueError(
                f"OverlapMoE: a weight {tuple(w.shape)} {w.dtype} on {w.device}, "
                f"expected {shape} {dtype} on {device}"
            )
        return w.detach()

    def _transport(self, rows: int, H: int, dtype, device):
        """This rank's combine transport: a receive buffer of `rows` rows [rows, H]."""
        from systems.overlap import transport as tr

        if self.group is None:
            self.fabric = tr.LoopbackFabric([rows], H, dtype, device)
            return self.fabric.transport(0)
        return tr.peer_transport(self.transport_name, self.group, rows, H, dtype, device)

    def _dispatcher(self, E: int, H: int, dtype, device):
        """The host-free dispatch (W=1: PlayedDispatch; a group: PeerDispatch), or NCCL's."""
        like = torch.empty(1, H, dtype=dtype, device=device)
        if self.dispatch == "device" and self.group is None:
            from harness.dispatch_device import PlayedDispatch

            return PlayedDispatch(1, E, self.max_tokens, self.top_k, like)
        if self.dispatch == "device":
            from harness.dispatch_peer import PeerDispatch

            args = (self.max_tokens, self.top_k, like, self.group, self.transport_name)
            return PeerDispatch(self.world_size, E, *args)
        return ld.LayerDispatch(self.world_size, E, self.group)

    def _dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, gather: bool = True):
        """One dispatch (ld.Dispatched) of x [T, H] by expert_ids [T, k], rows gathered (the held
        kind); W=1 without `gather`: rows go straight from the tokens to the padding."""
        if self.dispatch == "device" and self.group is None:
            return self.dispatcher([x], [expert_ids], gather=gather)[0]
        return self.dispatcher(x, expert_ids)

    def _check_inputs(self, x, expert_ids, gate) -> None:
        T = x.shape[0]
        if T > self.max_tokens or tuple(expert_ids.shape) != (T, self.top_k):
            raise ValueError(
                f"OverlapMoE: x [{T}, H] with expert_ids {tuple(expert_ids.shape)}"
                f": need T <= max_tokens={self.max_tokens} and [T, {self.top_k}]"
            )
        if tuple(gate.shape) != tuple(expert_ids.shape):
            raise ValueError(f"OverlapMoE: gate {tuple(gate.shape)} != expert_ids' shape")

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        """y [T, H] = sum_j gate[t, j] * expert_{ids[t, j]}(x[t]); x [T, H] (T <= max_tokens),
        expert_ids [T, k] global expert ids, gate [T, k]. No host sync without a group. Where
        grad is on and x, gate or a weight needs it, the overlapped backward (backward.py) puts
        the gradients of x, gate, w1 and w2 where autograd puts them."""
        needs = (x, gate, self.w1, self.w2)
        if torch.is_grad_enabled() and any(t.requires_grad for t in needs):
            from systems.overlap.backward import LayerFunction

            return LayerFunction.apply(self, expert_ids, x, gate, self.w1, self.w2)
        return self._step(x, expert_ids, gate)

    def _step(self, x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor):
        """The forward without autograd."""
        self._check_inputs(x, expert_ids, gate)
        ex = self.experts
        if self.dispatch == "device":
            d = self._dispatch(x, expert_ids, gather=False)
            ex.experts(d)
        else:  # the plan is built from the labels before the split sizes' host sync
            built = []
            d = self.dispatcher(x, expert_ids, before_sync=lambda r: built.append(ex.plan_of(r)))
            ex.experts(d, plan=built[-1])
        if ex.combines:
            ex.runner.wait_received()  # every peer's rows of every step so far
        return ex.scale(d, gate)

    def check(self) -> None:
        """Raise where a device-side wait of the forwards so far timed out (reads the device)."""
        self.experts.runner.check()
        if self.experts.back is not None:
            self.experts.back.runner.check()
        if hasattr(self.dispatcher, "check"):
            self.dispatcher.check()

    # -- parts of a forward, timed apart by benchmarks ----------------------------------
    def hold(self, x: torch.Tensor, expert_ids: torch.Tensor):
        """One dispatch kept with its own plan (rank_experts.Held), for the parts below."""
        return self.experts.hold(self._dispatch(x, expert_ids))

    def compute_only(self, held, gate: torch.Tensor) -> torch.Tensor:
        """A forward without its two exchanges, on a held dispatch: out [T, H]."""
        return self.experts.compute_only(held, gate)

    def comm_only(self, held, x: torch.Tensor, expert_ids: torch.Tensor) -> None:
        """The two exchanges alone on a held dispatch: the dispatch's counts and rows (with a
        group) and the combine's puts (flags taken as set)."""
        if self.dispatch == "nccl" and self.world_size > 1:
            ld.redispatch(held.dispatch, x, self.top_k, self.group)
        elif self.world_size > 1:
            self.dispatcher(x, expert_ids)
        self.experts.comm_only(held)
