"""The README's training example (OverlapMoE trained a few steps with an optimizer, after the
layer's example), run exactly as printed on the CPU (Triton's interpreter); one more step's
gradients are then checked against torch autograd of a plain float32 layer on the same weights,
routing and loss."""

from __future__ import annotations

import re

from tests.interpreted import ROOT, run_interpreted

CHECK = """
from harness.check import check
from harness.reference import moe_torch

gate, expert_ids = torch.topk(torch.softmax(router(x.float()), dim=-1), k)
gate.retain_grad()
opt.zero_grad()
torch.nn.functional.mse_loss(moe(x, expert_ids, gate).float(), target).backward()
w1, w2 = (w.detach().float().requires_grad_() for w in (moe.w1, moe.w2))
g = gate.detach().requires_grad_()
torch.nn.functional.mse_loss(moe_torch(x.float(), expert_ids, g, w1, w2), target).backward()
res = [check(a, b, 1e-2) for a, b in ((moe.w1.grad, w1.grad), (moe.w2.grad, w2.grad),
                                      (gate.grad, g.grad))]  # fmt: skip
print(all(r.ok for r in res), max(r.max_rel_err for r in res), [r.message for r in res])
"""


def readme_train_example() -> tuple[str, str]:
    """The README's layer block and the block after it that steps an optimizer."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    first = next(b for b in blocks if "OverlapMoE(" in b)
    return first, next(b for b in blocks if "opt.step()" in b)


def test_the_readme_training_example_runs_on_the_cpu_and_its_gradients_match_autograd():
    first, train = readme_train_example()
    assert "loss.backward()" in train and len(train.strip().splitlines()) <= 20
    code = first + train
    ok, err, *why = run_interpreted(code + CHECK).split(maxsplit=2)
    assert ok == "True", why
    assert 0 < float(err) < 1e-2  # fp16 rounding, not bit-equal
