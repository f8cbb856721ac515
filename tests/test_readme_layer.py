"""The README's OverlapMoE example, run exactly as printed on the CPU (Triton's interpreter), its
output checked against a plain torch MoE layer on the same weights and routing."""

from __future__ import annotations

import re

from tests.interpreted import ROOT, run_interpreted

CHECK = """
from harness.check import check

ref = torch.zeros(T, H)
for t in range(T):
    for j in range(k):
        e = int(expert_ids[t, j])
        h = torch.nn.functional.gelu(x[t].float() @ moe.w1[e].float())
        ref[t] += float(gate[t, j]) * (h @ moe.w2[e].float())
res = check(y, ref, 1e-2)
assert y.shape == (T, H) and y.dtype == torch.float16
print("ok" if res.ok else f"fail {res.message}", res.max_rel_err)
"""


def readme_example() -> str:
    """The python block of the README's section on the layer."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The layer in your own code", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_layer_example_runs_on_the_cpu_and_matches_the_reference():
    code = readme_example()
    assert "OverlapMoE" in code and len(code.strip().splitlines()) <= 15
    out = run_interpreted(code + CHECK).split()
    assert out[0] == "ok", out
    assert 0 < float(out[1]) < 1e-2  # a real comparison: fp16 rounding, not bit-equal
