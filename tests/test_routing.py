import pytest
import torch

from harness.routing import ROUTINGS, imbalance, make_routing, popularity, sample_topk


def test_routing_is_deterministic_and_valid():
    a = make_routing(4, 300, 8, 2, "moderate_skew", seed=3)
    b = make_routing(4, 300, 8, 2, "moderate_skew", seed=3)
    c = make_routing(4, 300, 8, 2, "moderate_skew", seed=4)
    assert torch.equal(a.expert_ids, b.expert_ids)
    assert not torch.equal(a.expert_ids, c.expert_ids)
    assert a.expert_ids.shape == (4, 300, 2)
    assert a.expert_ids.min() >= 0 and a.expert_ids.max() < 32
    # top-k experts of a token are distinct
    assert (a.expert_ids[..., 0] != a.expert_ids[..., 1]).all()
    torch.testing.assert_close(a.gate_weights.sum(-1), torch.ones(4, 300))


def test_skew_orders_imbalance():
    imb = {
        r: imbalance(make_routing(4, 4000, 4, 2, r, seed=0).expert_ids, 4, 4)["imbalance_rank"]
        for r in ROUTINGS
    }
    assert imb["balanced"] < 1.1
    assert imb["balanced"] < imb["moderate_skew"] < imb["stress_skew"]


def test_sampling_follows_popularity():
    gen = torch.Generator().manual_seed(0)
    ids = sample_topk(200_000, 6, 1, 1.0, gen)
    freq = torch.bincount(ids[:, 0], minlength=6).double() / ids.shape[0]
    torch.testing.assert_close(freq, popularity(6, 1.0), atol=5e-3, rtol=0)


def test_unknown_routing_lists_choices():
    with pytest.raises(ValueError, match="balanced"):
        make_routing(2, 10, 2, 2, "zipf", seed=0)


def test_topk_larger_than_experts_is_refused():
    with pytest.raises(ValueError, match="top_k"):
        sample_topk(4, 2, 3, 0.0, torch.Generator())
