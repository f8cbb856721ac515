"""The README's training example (OverlapMoE trained a few steps with an optimizer), run exactly
as printed on the CPU (Triton's interpreter); one more step's gradients are then checked
against torch autograd of a plain float32 layer on the same weights, routing and loss."""

from __future__ import annotations

import re

from tests.interpreted import ROOT, run_interpreted

#: the example as the README's section on the layer gives it (until it does, this text)
SNIPPET = """\
import torch
from systems.overlap import OverlapMoE

T, H, F, E, k = 64, 64, 128, 4, 2
moe = OverlapMoE(hidden=H, ffn=F, experts_per_rank=E, top_k=k, max_tokens=T, dtype=torch.float16)
dev = moe.w1.device
router = torch.nn.Linear(H, E, device=dev)
opt = torch.optim.SGD([*moe.parameters(), *router.parameters()], lr=0.1)
x = torch.randn(T, H, dtype=torch.float16, device=dev)
target = torch.randn(T, H, device=dev)
for step in range(3):
    gate, expert_ids = torch.topk(torch.softmax(router(x.float()), dim=-1), k)
    loss = torch.nn.functional.mse_loss(moe(x, expert_ids, gate).float(), target)
    opt.zero_grad()
    loss.backward()  # overlapped like the forward: dx's rows go home band by band
    opt.step()
moe.check()  # raises if a device-side wait timed out
"""

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


def readme_train_example() -> str:
    """The README's python block that steps an optimizer, else SNIPPET."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next((b for b in blocks if "opt.step()" in b), SNIPPET)


def test_the_readme_training_example_runs_on_the_cpu_and_its_gradients_match_autograd():
    code = readme_train_example()
    assert "loss.backward()" in code and len(code.strip().splitlines()) <= 20
    ok, err, *why = run_interpreted(code + CHECK).split(maxsplit=2)
    assert ok == "True", why
    assert 0 < float(err) < 1e-2  # fp16 rounding, not bit-equal
