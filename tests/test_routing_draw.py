"""Issue 42, finding 6: the routing draw is fast for any k <= E (top_k = E under stress_skew
redrew for longer than every time-out), and the cells drawn before keep their routing bit for
bit."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.routing import (
    REDRAW_MAX_DRAWS,
    ROUTINGS,
    _race,
    make_routing,
    popularity,
    redraw_cost,
    sample_topk,
)

ROOT = Path(__file__).resolve().parents[1]


def _sample_topk_before(n_tokens, n_experts, top_k, s, gen):
    """harness.routing.sample_topk as it was before the race (rev 933b280), verbatim."""
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
            clash = (
                (ids[todo, :j] == draw[:, None]).any(1) if j else torch.zeros_like(draw, dtype=bool)
            )
            todo = todo[clash]
        ids[:, j] = col
    return ids


@pytest.mark.parametrize(
    "world,tokens,experts,top_k,routing",
    [
        (4, 256, 2, 2, "stress_skew"),  # smoke
        (1, 2, 2, 2, "stress_skew"),  # the most skewed k=2 cell: 2 experts
        (2, 4096, 8, 2, "moderate_skew"),
        (2, 1024, 64, 2, "balanced"),
        (8, 512, 4, 1, "stress_skew"),
        (2, 300, 32, 8, "stress_skew"),  # k=8 of 64: the redraw still serves it
    ],
)
def test_cells_the_redraw_served_keep_their_routing(world, tokens, experts, top_k, routing):
    s = ROUTINGS[routing]
    seed = 5
    new = make_routing(world, tokens, experts, top_k, routing, seed)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    ids = _sample_topk_before(world * tokens, world * experts, top_k, s, gen)
    logits = torch.randn(world * tokens, top_k, generator=gen)
    assert torch.equal(new.expert_ids.reshape(-1, top_k), ids)
    assert torch.equal(new.gate_weights.reshape(-1, top_k), torch.softmax(logits, -1).float())


def test_every_committed_tables_cells_take_the_redraw():
    shapes = set()
    for path in sorted((ROOT / "results" / "reference").glob("**/*.parquet")):
        df = pd.read_parquet(path)
        cols = ["world_size", "experts_per_rank", "top_k", "routing"]
        if not set(cols) <= set(df.columns):
            continue
        df = df[df["routing"].isin(list(ROUTINGS)) & (df["top_k"] > 0)]
        shapes |= set(df[cols].drop_duplicates().itertuples(index=False, name=None))
    assert shapes, "no committed table with routed cells found"
    for w, e, k, routing in shapes:
        assert redraw_cost(int(w) * int(e), int(k), ROUTINGS[routing]) <= REDRAW_MAX_DRAWS


def test_top_k_equal_to_the_experts_under_stress_skew_draws_in_seconds():
    # 256 experts (W=4 x E=64), every token takes all of them; the redraw's last slots would
    # wait on experts of mass ~1e-4 for hours. A subprocess, so the old draw cannot hang pytest.
    code = (
        "import time, torch\n"
        "from harness.routing import make_routing\n"
        "t = time.perf_counter()\n"
        "r = make_routing(4, 256, 64, 256, 'stress_skew', 0)\n"
        "took = time.perf_counter() - t\n"
        "ids = r.expert_ids.reshape(-1, 256)\n"
        "assert torch.equal(ids.sort(1).values, torch.arange(256).expand_as(ids))\n"
        "assert ids[:, 0].bincount(minlength=256).argmax() == 0\n"
        "print(took)\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the k = E = 256 stress_skew draw took longer than 30 s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.strip()) < 3.0, proc.stdout


def _exact_law(p: torch.Tensor, top_k: int) -> dict[tuple[int, ...], float]:
    """P(ordered tuple) of successive sampling without replacement from p."""
    law = {}
    for t in itertools.permutations(range(len(p)), top_k):
        prob, left = 1.0, 1.0
        for g in t:
            prob *= float(p[g]) / left
            left -= float(p[g])
        law[t] = prob
    return law


@pytest.mark.parametrize("draw", [_race, sample_topk], ids=["race", "sample_topk"])
def test_both_draws_follow_successive_sampling_without_replacement(draw):
    n, experts, top_k, s = 200_000, 4, 3, 1.6
    ids = draw(n, experts, top_k, s, torch.Generator().manual_seed(1))
    assert ids.shape == (n, top_k) and ids.dtype == torch.int64
    code = (ids * torch.tensor([experts**2, experts, 1])).sum(1)
    freq = torch.bincount(code, minlength=experts**3).double() / n
    for t, prob in _exact_law(popularity(experts, s), top_k).items():
        got = float(freq[t[0] * experts**2 + t[1] * experts + t[2]])
        assert abs(got - prob) < 4e-3, (t, got, prob)
    assert abs(float(freq.sum()) - 1.0) < 1e-12


def test_the_race_in_chunks_gives_distinct_experts(monkeypatch):
    import harness.routing as routing

    monkeypatch.setattr(routing, "RACE_CHUNK", 64)  # 64 keys: 2 tokens a chunk over 32 experts
    ids = routing._race(101, 32, 32, 1.6, torch.Generator().manual_seed(0))
    assert ids.shape == (101, 32)
    assert torch.equal(ids.sort(1).values, torch.arange(32).expand(101, 32))
    assert routing._race(0, 8, 3, 0.0, torch.Generator()).shape == (0, 3)
