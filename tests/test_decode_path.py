"""The executor's decode fast path (one token, one slot per expert: a shared row-0 index, no per-step
division and split) against the float64 reference, and the cases that must leave it: a token routed
twice to one expert, padding sentinels, weights and activations in other dtypes."""

from __future__ import annotations

import pytest
import torch
from test_runtime_executor import INTER, LAYERS, E, reference

from crisp_runtime import CrispPlan
from crisp_runtime.execution.runtime import CrispRuntime

TOP_K = 3


def run(index, weights, x, plan=None):
    plan = plan or CrispPlan.full(E, TOP_K, INTER, sorted(LAYERS))
    rt = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=None)
    out = rt.forward(1, x, index, weights)
    widths = plan.token_widths(1, index, weights.float())
    return out, reference(1, x, index, weights.float(), widths), rt


@pytest.mark.parametrize("index", [[[4, 0, 2]], [[3, 3, 1]], [[5, -1, 2]], [[1, 1, 1]]],
                         ids=["distinct", "twice", "padding", "thrice"])
def test_one_token_equals_reference(index):
    g = torch.Generator().manual_seed(sum(v for row in index for v in row) + 17)
    x = torch.randn(1, 64, generator=g)
    weights = torch.softmax(torch.randn(1, TOP_K, generator=g), -1)
    out, ref, _ = run(torch.tensor(index), weights, x)
    # fp32 kernels against float64: the tolerance of tests/test_runtime_executor.py
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_token_other_dtypes(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 64, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(1, TOP_K, generator=g), -1).to(dtype)
    out, ref, _ = run(torch.tensor([[2, 5, 0]]), weights, x)
    assert out.dtype == dtype
    # activations and weights rounded to dtype before the fp32 kernels; the output rounded once more
    u = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=4 * u, atol=4 * u)


def test_decode_steps_then_a_batch_are_independent():
    """Steps on the fast path must not leave state that changes a later batched step (the shared index)."""
    g = torch.Generator().manual_seed(11)
    plan = CrispPlan.full(E, TOP_K, INTER, sorted(LAYERS))
    rt = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=None)
    for _ in range(5):
        x = torch.randn(1, 64, generator=g)
        rt.forward(1, x, torch.randperm(E, generator=g)[:TOP_K][None], torch.rand(1, TOP_K, generator=g))
    x = torch.randn(4, 64, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(4)])
    weights = torch.rand(4, TOP_K, generator=g)
    out = rt.forward(1, x, index, weights)
    torch.testing.assert_close(out.double(), reference(1, x, index, weights, plan.token_widths(1, index, weights)),
                               rtol=1e-5, atol=1e-5)
