"""tests/fast_interpreter.py's xor_sum gives the interpreter's own values, and tl.sort on it
sorts (the dispatch's counting sort relies on it)."""

from __future__ import annotations

from tests.interpreted import run_interpreted

SCRIPT = r"""
import torch, triton, triton.language as tl
from triton.runtime import interpreter
from tests.fast_interpreter import install

@triton.jit
def xors(x, out_rows, out_cols, out_all, sorted_, R: tl.constexpr, C: tl.constexpr):
    v = tl.load(x + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    tl.store(out_rows + tl.arange(0, R), tl.xor_sum(v, 1))
    tl.store(out_cols + tl.arange(0, C), tl.xor_sum(v, 0))
    tl.store(out_all, tl.xor_sum(tl.reshape(v, [R * C]), 0))
    tl.store(sorted_ + tl.arange(0, R * C), tl.sort(tl.reshape(v, [R * C])))

def run():
    out = [torch.zeros(8, dtype=torch.int32), torch.zeros(16, dtype=torch.int32),
           torch.zeros(1, dtype=torch.int32), torch.zeros(128, dtype=torch.int32)]
    xors[(1,)](x, *out, R=8, C=16)
    return out

g = torch.Generator().manual_seed(3)
x = torch.randint(-2**31, 2**31 - 1, (8, 16), dtype=torch.int32, generator=g)
slow = run()
assert not getattr(interpreter.ReduceOps, "fast_xor", False)
assert install()
fast = run()
assert all(torch.equal(a, b) for a, b in zip(slow, fast)), (slow, fast)
assert torch.equal(fast[3], torch.sort(x.flatten()).values)
print("same")
"""


def test_the_fast_xor_sum_equals_the_interpreters_own():
    assert run_interpreted(SCRIPT, fast=False).split() == ["same"]
