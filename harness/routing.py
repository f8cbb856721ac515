"""Routing skews (docs/method.md, "Routing skews"; s per routing: ROUTINGS). A token's top_k
distinct experts are successive sampling without replacement from p (the law of
torch.multinomial(replacement=False)). One seeded CPU generator draws ALL ranks' tokens at once,
so every rank computes the same global routing with no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the Zipf exponent s of each routing
ROUTINGS: dict[str, float] = {"balanced": 0.0, "moderate_skew": 0.8, "stress_skew": 1.6}


def popularity(n_experts: int, s: float) -> torch.Tensor:
    """Expert popularity p [n_experts] (float64, sums to 1), p_g ~ (g+1)^-s."""
    p = torch.arange(1, n_experts + 1, dtype=torch.float64).pow(-s)
    return p / p.sum()


#: two draws of the one law: the collision redraw serves a cell up to this many expected draws
#: per token (worst case; every committed table's routing), the exponential race the rest (such
#: as top_k = E under stress_skew, where the last slots would redraw for hours)
REDRAW_MAX_DRAWS = 32.0
#: elements of one chunk of the race's keys [tokens, experts] (bounds its memory)
RACE_CHUNK = 1 << 22


def redraw_cost(n_experts: int, top_k: int, s: float) -> float:
    """Expected draws per token of the collision redraw, worst case: the sum over slots j of
    1 / (the mass outside the j most popular experts), which bounds a slot's redraws."""
    p = popularity(n_experts, s)
    outside = torch.flip(torch.cumsum(torch.flip(p, [0]), 0), [0])[:top_k]  # sum_{g >= j} p_g
    return float((1.0 / outside.clamp_min(1e-300)).sum())


def sample_topk(
    n_tokens: int, n_experts: int, top_k: int, s: float, gen: torch.Generator
) -> torch.Tensor:
    """Top-k distinct expert ids [n_tokens, top_k] (int64) drawn from popularity (g+1)^-s by
    successive sampling without replacement (REDRAW_MAX_DRAWS picks the draw)."""
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} exceeds the number of experts {n_experts}")
    if redraw_cost(n_experts, top_k, s) <= REDRAW_MAX_DRAWS:
        return _redraw(n_tokens, n_experts, top_k, s, gen)
    return _race(n_tokens, n_experts, top_k, s, gen)


def _redraw(n_tokens: int, n_experts: int, top_k: int, s: float, gen: torch.Generator):
    """[n_tokens, top_k]: slot j draws from p by inverse CDF, and tokens whose draw collides
    with an earlier slot redraw until none collide. Vectorised over tokens; loops only over
    slots and collision rounds (slow where the experts left to a slot hold little mass)."""
    cdf = torch.cumsum(popularity(n_experts, s), 0)
    cdf[-1] = 1.0
    ids = torch.empty(n_tokens, top_k, dtype=torch.int64)
    for j in range(top_k):
        todo = torch.arange(n_tokens)
        col = torch.empty(n_tokens, dtype=torch.int64)
        while todo.numel():
            u = torch.rand(todo.numel(), generator=gen, dtype=torch.float64)
            draw = torch.searchsorted(cdf, u).clamp_(max=n_experts - 1)
            col[todo] = draw
            todo = todo[(ids[todo, :j] == draw[:, None]).any(1)]
        ids[:, j] = col
    return ids


def _race(n_tokens: int, n_experts: int, top_k: int, s: float, gen: torch.Generator):
    """[n_tokens, top_k]: every expert g of a token gets the key X_g / p_g, X_g ~ Exp(1); the
    top_k smallest keys in increasing order are a draw of successive sampling without
    replacement (the first is expert g with probability p_g, the next from the rest, ...).
    Work n_tokens x n_experts whatever the skew, in chunks of RACE_CHUNK keys."""
    p = popularity(n_experts, s)
    rows = max(1, RACE_CHUNK // n_experts)
    out = []
    for t0 in range(0, n_tokens, rows):
        n = min(rows, n_tokens - t0)
        u = torch.rand(n, n_experts, generator=gen, dtype=torch.float64)
        keys = -torch.log1p(-u) / p  # -log(1 - u) ~ Exp(1), finite for u in [0, 1)
        out.append(torch.topk(keys, top_k, dim=1, largest=False, sorted=True).indices)
    return torch.cat(out) if out else torch.empty(0, top_k, dtype=torch.int64)


@dataclass(frozen=True)
class Routing:
    """Global routing of W ranks x T tokens."""

    expert_ids: torch.Tensor  # [W, T, top_k] int64, global expert index in [0, W*E)
    gate_weights: torch.Tensor  # [W, T, top_k] float32, rows sum to 1


def make_routing(
    world_size: int,
    tokens_per_rank: int,
    experts_per_rank: int,
    top_k: int,
    routing: str,
    seed: int,
) -> Routing:
    """Seeded global routing, identical on every rank (drawn on the CPU)."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choices: {sorted(ROUTINGS)}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    n_tok = world_size * tokens_per_rank
    ids = sample_topk(n_tok, world_size * experts_per_rank, top_k, ROUTINGS[routing], gen)
    w = torch.softmax(torch.randn(n_tok, top_k, generator=gen), dim=-1)
    shape = (world_size, tokens_per_rank, top_k)
    return Routing(expert_ids=ids.view(shape), gate_weights=w.view(shape).float())


def imbalance(expert_ids: torch.Tensor, world_size: int, experts_per_rank: int) -> dict[str, float]:
    """Load imbalance of a routing, expert_ids [W, T, top_k]: max/mean rows per receiving rank
    and per expert."""
    n_exp = world_size * experts_per_rank
    per_expert = torch.bincount(expert_ids.reshape(-1), minlength=n_exp).double()
    per_rank = per_expert.view(world_size, experts_per_rank).sum(1)
    return {
        "imbalance_rank": float(per_rank.max() / per_rank.mean()),
        "imbalance_expert": float(per_expert.max() / per_expert.mean()),
    }


def owner_expert_counts(expert_ids: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """C [W, W*E]: C[s, g] = rows owner s sends to global expert g. expert_ids [W, T, k]."""
    W = expert_ids.shape[0]
    n_exp = W * experts_per_rank
    src = torch.arange(W, device=expert_ids.device).view(W, 1, 1).expand_as(expert_ids)
    key = (src * n_exp + expert_ids).reshape(-1)
    return torch.bincount(key, minlength=W * n_exp).view(W, n_exp)
