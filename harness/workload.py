"""Workload cells: shapes, seeded activations and expert weights, identical on every rank. By
the expert width `ffn` (docs/method.md, "The operator" and "The layer"): 0 is the operator,
Y_e [M_e, N] = X_e [M_e, K] @ B_e (K = hidden, N = out); F > 0 a whole MoE layer,
Y_e = gelu(X_e @ W1_e) @ W2_e, W1_e [H, F], W2_e [F, H] (H = hidden = out).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

from harness.routing import ROUTINGS, Routing, imbalance, make_routing

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class WorkloadSpec:
    """One MoE layer cell. world_size W is the LOGICAL number of ranks of the layer."""

    tokens_per_rank: int
    hidden: int  # K
    out: int  # N
    experts_per_rank: int  # E
    top_k: int
    world_size: int
    routing: str
    dtype: str = "float32"
    seed: int = 0
    #: expert width F of FFN experts; 0 = the single-GEMM operator cell
    ffn: int = 0
    #: a layer cell timed as one training step, forward + backward (scope train)
    train: bool = False

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; choices: {sorted(ROUTINGS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choices: {sorted(DTYPES)}")
        for name in ("tokens_per_rank", "hidden", "out", "experts_per_rank", "top_k", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ffn < 0:
            raise ValueError(f"ffn must be >= 0 (0 = single-GEMM experts), got {self.ffn}")
        if self.ffn and self.out != self.hidden:
            raise ValueError(
                f"a layer cell (ffn={self.ffn}) returns the hidden width: out must equal hidden, "
                f"got hidden={self.hidden}, out={self.out}"
            )
        if self.train and not self.ffn:
            raise ValueError("a train cell is a layer cell: it needs ffn > 0")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} > number of experts {self.n_experts}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def scope(self) -> str:
        """The timed region's scope: "layer" for FFN cells, "train" for their forward +
        backward, "gemm+combine" for the operator."""
        return ("train" if self.train else "layer") if self.ffn else "gemm+combine"

    @property
    def n_experts(self) -> int:
        return self.world_size * self.experts_per_rank

    def key(self) -> str:
        items = {k: v for k, v in asdict(self).items() if k not in ("ffn", "train") or v}
        return hashlib.sha1(repr(sorted(items.items())).encode()).hexdigest()[:12]


def seeded_generator(device: torch.device, *parts: int) -> torch.Generator:
    """A generator on `device` seeded by a hash of the integer parts."""
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p) + 1) % (2**61 - 1)
    return torch.Generator(device=device).manual_seed(seed)


def _randn(spec: WorkloadSpec, device, tag: int, index: int, rows: int, cols: int, scale=1.0):
    """[rows, cols] standard normals x scale, in spec.dtype, seeded by (seed, tag, index)."""
    g = seeded_generator(device, spec.seed, tag, index)
    x = torch.randn(rows, cols, generator=g, device=device) * scale
    return x.to(spec.torch_dtype)


def make_tokens(spec: WorkloadSpec, rank: int, device: torch.device) -> torch.Tensor:
    """Token activations of one rank, x [T, K] in spec.dtype, seeded by (seed, rank)."""
    return _randn(spec, device, 1, rank, spec.tokens_per_rank, spec.hidden)


def make_grad(spec: WorkloadSpec, rank: int, device: torch.device) -> torch.Tensor:
    """A train cell's upstream gradient dL/dout of one rank, dy [T, H] in spec.dtype."""
    return _randn(spec, device, 5, rank, spec.tokens_per_rank, spec.out)


def make_expert_weight(
    spec: WorkloadSpec, global_expert: int, device: torch.device
) -> torch.Tensor:
    """Weight of one global expert, B_g [K, N] in spec.dtype, scaled by 1/sqrt(K)."""
    return _randn(spec, device, 2, global_expert, spec.hidden, spec.out, spec.hidden**-0.5)


def make_rank_weights(spec: WorkloadSpec, rank: int, device: torch.device) -> torch.Tensor:
    """The experts hosted on one rank, B [E, K, N], global experts rank*E .. rank*E+E-1.
    For FFN cells: fc2's weights W2 [E, F, H] (the GEMM that feeds the combine)."""
    make = make_fc2_weight if spec.ffn else make_expert_weight
    e0 = rank * spec.experts_per_rank
    return torch.stack([make(spec, g, device) for g in range(e0, e0 + spec.experts_per_rank)])


def make_fc1_weight(spec: WorkloadSpec, global_expert: int, device: torch.device) -> torch.Tensor:
    """fc1 of one global FFN expert, W1_g [H, F] in spec.dtype, scaled by 1/sqrt(H)."""
    return _randn(spec, device, 3, global_expert, spec.hidden, spec.ffn, spec.hidden**-0.5)


def make_fc2_weight(spec: WorkloadSpec, global_expert: int, device: torch.device) -> torch.Tensor:
    """fc2 of one global FFN expert, W2_g [F, H] in spec.dtype, scaled by 1/sqrt(F)."""
    return _randn(spec, device, 4, global_expert, spec.ffn, spec.hidden, spec.ffn**-0.5)


def make_rank_fc1(spec: WorkloadSpec, rank: int, device: torch.device) -> torch.Tensor:
    """fc1 of the FFN experts hosted on one rank, W1 [E, H, F]."""
    E = spec.experts_per_rank
    return torch.stack([make_fc1_weight(spec, g, device) for g in range(rank * E, rank * E + E)])


#: the global routing per (W, T, E, top_k, routing, seed): make_routing, cached
_routing = lru_cache(maxsize=8)(make_routing)


def routing_of(spec: WorkloadSpec) -> Routing:
    """The global routing of a spec (CPU tensors), cached."""
    W, T, E = spec.world_size, spec.tokens_per_rank, spec.experts_per_rank
    return _routing(W, T, E, spec.top_k, spec.routing, spec.seed)


def imbalance_of(spec: WorkloadSpec) -> dict[str, float]:
    """Measured imbalance (max/mean rows per rank and per expert) of the spec's routing."""
    return imbalance(routing_of(spec).expert_ids, spec.world_size, spec.experts_per_rank)
