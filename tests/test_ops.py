"""The ``torch.ops.crisp`` custom ops: schema, fake tensors, tracing, and the same results and
errors as the Python entry points. Tiny shapes: opcheck runs each op several times."""

import pytest
import torch

import crisp_kernels  # noqa: F401  (registers torch.ops.crisp)
from crisp_kernels import QuantFormat, expert_mlp, expert_mlp_accumulate_, pack_expert

H, I = 64, 16


def _expert(symmetric: bool, device):
    gen = torch.Generator().manual_seed(0)
    return pack_expert(
        torch.randn(I, H, generator=gen) / 8,
        torch.randn(I, H, generator=gen) / 8,
        torch.randn(H, I, generator=gen) / 4,
        QuantFormat(group_size=32, symmetric=symmetric),
    ).to(device)


def _args(p):
    return p.qweight, p.scales, p.zeros, p.fmt.group_size


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_expert_mlp_op(device, kernel_backend, symmetric):
    p = _expert(symmetric, device)
    x = torch.randn(3, H, device=device)
    token_widths = torch.tensor([0, 5, 99], device=device)
    y = torch.ops.crisp.expert_mlp(x, *_args(p), 10, token_widths)
    assert torch.equal(y, expert_mlp(x, p, 10, token_widths=token_widths))
    torch.library.opcheck(torch.ops.crisp.expert_mlp.default, (x, *_args(p), 10, token_widths))
    torch.library.opcheck(torch.ops.crisp.expert_mlp.default, (x.half(), *_args(p), I, None))


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_expert_mlp_accumulate_op(device, kernel_backend, symmetric):
    p = _expert(symmetric, device)
    x = torch.randn(4, H, device=device)
    rows = torch.tensor([3, 1], device=device)
    weights = torch.tensor([0.25, 0.75], device=device)
    out0 = torch.randn(4, H, device=device)
    out = out0.clone()
    assert torch.ops.crisp.expert_mlp_accumulate_(out, x, *_args(p), 12, rows, weights, None) is None
    expected = out0.clone()
    expert_mlp_accumulate_(expected, x, p, 12, rows=rows, weights=weights)
    assert torch.equal(out, expected)
    assert not torch.equal(out, out0)
    torch.library.opcheck(
        torch.ops.crisp.expert_mlp_accumulate_.default,
        (out, x, *_args(p), 12, rows, weights, torch.tensor([16, 4], device=device)),
    )


def test_fake_shapes():
    p = _expert(False, "meta")
    x = torch.empty(5, H, device="meta", dtype=torch.bfloat16)
    y = torch.ops.crisp.expert_mlp(x, *_args(p), 7, None)
    assert y.shape == (5, H) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    with pytest.raises(RuntimeError, match="x: expected hidden size 64, got 32"):
        torch.ops.crisp.expert_mlp(torch.empty(5, 32, device="meta"), *_args(p), 7, None)


def test_traces_without_graph_breaks(device, kernel_backend):
    p = _expert(False, device)

    def f(x, out, rows, weights):
        y = torch.ops.crisp.expert_mlp(x, *_args(p), 9, None)
        torch.ops.crisp.expert_mlp_accumulate_(out, x, *_args(p), 9, rows, weights, None)
        return y * 2

    x = torch.randn(2, H, device=device)
    rows, weights = torch.tensor([1, 0], device=device), torch.ones(2, device=device)
    out = torch.zeros(2, H, device=device)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y = compiled(x, out, rows, weights)
    expected_out = torch.zeros(2, H, device=device)
    expert_mlp_accumulate_(expected_out, x, p, 9, rows=rows, weights=weights)
    assert torch.equal(y, 2 * expert_mlp(x, p, 9))
    assert torch.equal(out, expected_out)


def test_op_errors_are_the_entry_points():
    p = _expert(False, "cpu")
    with pytest.raises(ValueError, match=r"x: expected shape \(T, H=64\)"):
        torch.ops.crisp.expert_mlp(torch.randn(2, 32), *_args(p), 4, None)
    with pytest.raises(ValueError, match="width=17 is out of range"):
        torch.ops.crisp.expert_mlp(torch.randn(2, H), *_args(p), 17, None)
    with pytest.raises(ValueError, match="PackedExpert.zeros: expected uint8"):
        torch.ops.crisp.expert_mlp(torch.randn(2, H), p.qweight, p.scales, p.zeros.int(), 32, 4, None)
    with pytest.raises(ValueError, match="out: expected float32"):
        torch.ops.crisp.expert_mlp_accumulate_(torch.zeros(2, H).half(), torch.randn(2, H), *_args(p), 4,
                                               torch.arange(2), torch.ones(2), None)  # fmt: skip
