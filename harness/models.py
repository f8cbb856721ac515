"""The paper's three models (docs/method.md, "Models"), forward only, plain PyTorch; the input is
seeded activations. Block i on x [B, S, H]:
    x = x + proj(sdpa(qkv(ln1(x))))     attention, `heads` heads, causal or not
    h = ln2(x)
    x = x + fc2(gelu(fc1(h)))           dense FFN, width ffn_mult x H    (i not in moe_blocks)
    x = x + moe(i, h, *router(h))       MoE FFN                          (i in moe_blocks)
Attention is data-parallel, the MoE expert-parallel (G experts, G / W per rank). The MoE call
(MoECall) is a layer-scope system (SystemMoE) or the float32 oracle (ReferenceMoE); ONE set of G
FFN experts (harness.workload's fc1 / fc2) serves every MoE block, other weights are per block.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.experts import activation
from harness.reference import moe_torch
from harness.system import CellInputs, System
from harness.workload import DTYPES, WorkloadSpec, make_fc1_weight, make_fc2_weight
from harness.workload import seeded_generator as generator

#: attention kernels, not cuDNN: after torch's cuDNN attention loads its cuDNN sub-libraries,
#: Transformer Engine (megatron_te, megatron_cutlass) fails to load libcudnn_cnn.so.9
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class ModelSpec:
    """One model: blocks, where the MoE sits (0-based block indices), the per-rank batch."""

    name: str
    blocks: int
    moe_blocks: tuple[int, ...]
    batch: int
    seq: int
    hidden: int
    heads: int
    causal: bool
    experts: int = 64
    top_k: int = 2
    ffn_mult: int = 4
    dtype: str = "bfloat16"

    @property
    def tokens(self) -> int:
        """Tokens per rank, T = B x S."""
        return self.batch * self.seq

    @property
    def ffn(self) -> int:
        """Expert (and dense FFN) width F = ffn_mult x H."""
        return self.ffn_mult * self.hidden

    def validate(self, world_size: int) -> None:
        """A one-line ValueError for a model that cannot run on `world_size` ranks (its sizes
        are integers >= 1: experiments.models.model_specs checked them)."""
        n = f"model {self.name}"
        if self.hidden % self.heads:
            raise ValueError(f"{n}: hidden {self.hidden} is not a multiple of heads {self.heads}")
        if not self.moe_blocks:
            raise ValueError(f"{n}: moe_blocks is empty; name at least one block (0-based)")
        mb = self.moe_blocks
        if len(set(mb)) != len(mb) or not all(0 <= b < self.blocks for b in mb):
            raise ValueError(
                f"{n}: moe_blocks {list(mb)} must be distinct 0-based indices "
                f"below blocks={self.blocks}"
            )
        if self.experts % world_size:
            raise ValueError(
                f"{n}: {self.experts} experts do not split over W={world_size} ranks "
                "(experts_per_rank = experts / W must be an integer)"
            )
        if self.top_k > self.experts:
            raise ValueError(f"{n}: top_k {self.top_k} exceeds experts {self.experts}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{n}: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def moe_spec(self, world_size: int, seed: int) -> WorkloadSpec:
        """The MoE block's cell: T = B x S, H, out = H, F, G / W experts per rank, top-k."""
        shape = dict(tokens_per_rank=self.tokens, hidden=self.hidden, out=self.hidden, ffn=self.ffn)
        shape |= dict(experts_per_rank=self.experts // world_size, top_k=self.top_k)
        # the setup's routing only: every forward's routing comes from the model's router
        run = dict(world_size=world_size, routing="balanced", dtype=self.dtype, seed=seed)
        return WorkloadSpec(**shape, **run)

    def as_dict(self) -> dict:
        return asdict(self) | {"moe_blocks": list(self.moe_blocks)}


class Router(torch.nn.Module):
    """Linear H -> G, softmax in float32, top-k, gates renormalised: h [T, H] -> ids [T, k]
    int64, gate [T, k] float32. With `forced` ids [T, k] the gates are the softmax at those."""

    def __init__(self, hidden: int, experts: int, top_k: int, dtype, device) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, experts, bias=False, dtype=dtype, device=device)
        self.top_k = top_k

    def forward(self, h: torch.Tensor, forced: torch.Tensor | None = None):
        probs = torch.softmax(self.linear(h).float(), dim=-1)  # [T, G]
        if forced is None:
            vals, ids = probs.topk(self.top_k, dim=-1)
        else:
            ids, vals = forced, probs.gather(1, forced)
        return ids, vals / vals.sum(-1, keepdim=True)


#: moe(block, h [T, H], ids [T, k], gate [T, k]) -> [T, H]
MoECall = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Block(torch.nn.Module):
    """One pre-LN block on x [B, S, H]: attention, then the dense FFN or the routed MoE."""

    def __init__(self, spec: ModelSpec, index: int, seed: int, device: torch.device) -> None:
        super().__init__()
        H, dt = spec.hidden, DTYPES[spec.dtype]
        kw = dict(bias=False, dtype=dt, device=device)
        self.spec, self.index = spec, index
        self.ln1 = torch.nn.LayerNorm(H, dtype=dt, device=device)
        self.ln2 = torch.nn.LayerNorm(H, dtype=dt, device=device)
        self.qkv = torch.nn.Linear(H, 3 * H, **kw)
        self.proj = torch.nn.Linear(H, H, **kw)
        self.moe = index in spec.moe_blocks
        if self.moe:
            self.router = Router(H, spec.experts, spec.top_k, dt, device)
            linears = [self.qkv, self.proj, self.router.linear]
        else:
            self.fc1 = torch.nn.Linear(H, spec.ffn, **kw)
            self.fc2 = torch.nn.Linear(spec.ffn, H, **kw)
            linears = [self.qkv, self.proj, self.fc1, self.fc2]
        tag = zlib.crc32(spec.name.encode())
        with torch.no_grad():
            for j, lin in enumerate(linears):  # nn.Linear's weight is [out, in]: fan-in = in
                gen = generator(device, seed, 10, tag, index, j)
                w = torch.randn(tuple(lin.weight.shape), generator=gen, device=lin.weight.device)
                lin.weight.copy_(w.mul_(lin.weight.shape[1] ** -0.5))

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, S, H] -> [B, S, H]: qkv, sdpa over `heads` heads, output projection."""
        B, S, H = h.shape
        nh = self.spec.heads
        q, k, v = self.qkv(h).view(B, S, 3, nh, H // nh).permute(2, 0, 3, 1, 4)
        with sdpa_kernel(SDPA_BACKENDS):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.spec.causal)  # [B,nh,S,d]
        return self.proj(o.transpose(1, 2).reshape(B, S, H))

    def forward(self, x: torch.Tensor, moe: MoECall, forced: torch.Tensor | None = None):
        """x [B, S, H] -> [B, S, H]; `forced` ids [T, k] fix this MoE block's top-k choice."""
        x = x + self.attention(self.ln1(x))
        h = self.ln2(x)
        if not self.moe:
            return x + self.fc2(activation(self.fc1(h)))
        B, S, H = h.shape
        flat = h.reshape(B * S, H)
        ids, gate = self.router(flat, forced)
        return x + moe(self.index, flat, ids, gate).to(x.dtype).view(B, S, H)


class MoEModel(torch.nn.Module):
    """`blocks` Blocks and a final LayerNorm: x [B, S, H] -> [B, S, H] (no embedding, no head).
    Every rank builds the same weights from (seed, model name, block)."""

    def __init__(self, spec: ModelSpec, seed: int, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.blocks = torch.nn.ModuleList(Block(spec, i, seed, device) for i in range(spec.blocks))
        self.ln_f = torch.nn.LayerNorm(spec.hidden, dtype=DTYPES[spec.dtype], device=device)
        self.eval()

    def forward(
        self, x: torch.Tensor, moe: MoECall, forced: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """x [B, S, H] -> [B, S, H]; forced maps a MoE block's index to its ids [T, k]."""
        forced = forced or {}
        with torch.no_grad():
            for blk in self.blocks:
                x = blk(x, moe, forced.get(blk.index))
            return self.ln_f(x)


def model_input(spec: ModelSpec, seed: int, rank: int, device: torch.device) -> torch.Tensor:
    """This rank's input activations x0 [B, S, H] in the model's dtype, seeded by (seed, rank)."""
    gen = generator(device, seed, 11, zlib.crc32(spec.name.encode()), rank)
    x = torch.randn(spec.batch, spec.seq, spec.hidden, generator=gen, device=device)
    return x.to(DTYPES[spec.dtype])


class ReferenceMoE:
    """The oracle of a MoE call: every global expert in float32 on this rank, no communication
    (reference.moe_torch over w1 [G, H, F], w2 [G, F, H]): h [T, H] -> [T, H] float32. Records
    the ids of each call in `ids` (block index -> [T, k])."""

    def __init__(self, spec: WorkloadSpec, device: torch.device) -> None:
        G = spec.n_experts
        self.w1 = torch.stack([make_fc1_weight(spec, g, device) for g in range(G)]).float()
        self.w2 = torch.stack([make_fc2_weight(spec, g, device) for g in range(G)]).float()
        self.ids: dict[int, torch.Tensor] = {}

    def __call__(self, block: int, h, ids, gate) -> torch.Tensor:
        self.ids[block] = ids.clone()
        return moe_torch(h.float(), ids, gate.float(), self.w1, self.w2)


class MoETimer:
    """Per-forward sums of the MoE calls' times: CUDA event pairs on the current stream on a GPU,
    the host clock elsewhere (every CPU op, gloo collectives too, is synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.forwards: list[list] = []  # per forward: a (start, stop) pair per MoE call

    def new_forward(self) -> None:
        self.forwards.append([])

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def time(self, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """call(), timed as one MoE call of the current forward."""
        start = self._now()
        out = call()
        self.forwards[-1].append((start, self._now()))
        return out

    def per_forward_ms(self) -> list[float]:
        """The summed MoE time of every recorded forward, ms (synchronises the device)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [sum(s.elapsed_time(e) for s, e in f) for f in self.forwards]
        return [sum((e - s) * 1e3 for s, e in f) for f in self.forwards]


class SystemMoE:
    """A layer-scope system as the model's MoE call: copy h [T, H], ids [T, k] and gate [T, k]
    into the CellInputs tensors the system set up with (it reads them on every forward), then
    system.timed() -> [T, H]. The optional timer times the system's call only, not the copy."""

    def __init__(self, system: System, inputs: CellInputs, timer: MoETimer | None = None):
        self.system, self.inputs, self.timer = system, inputs, timer

    def copy_in(self, h: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor) -> None:
        inp = self.inputs
        for name, src, dst in (("x", h, inp.x), ("expert_ids", ids, inp.expert_ids)):
            if dst is None or dst.shape != src.shape:
                got = None if dst is None else tuple(dst.shape)
                raise ValueError(f"SystemMoE: {name} {tuple(src.shape)} != the system's {got}")
        for dst, src in ((inp.x, h), (inp.expert_ids, ids), (inp.gate, gate)):
            dst.copy_(src)

    def __call__(self, block: int, h, ids, gate) -> torch.Tensor:
        self.copy_in(h, ids, gate)
        if self.timer is None:
            return self.system.timed()
        return self.timer.time(self.system.timed)


def owned_inputs(inputs: CellInputs) -> CellInputs:
    """The same CellInputs with x, expert_ids and gate as tensors of their own: on the CPU the
    harness's ids and gate are views of its cached routing (Tensor.to is a no-op there), which a
    copy-in must never overwrite."""
    x, ids, gate = inputs.x.clone(), inputs.expert_ids.clone(), inputs.gate.clone()
    return replace(inputs, x=x, expert_ids=ids, gate=gate)
