"""The native CPU kernel with 8-bit activations (``crisp_expert_rows_q8``, ``Precision.Q8``) against its reference.

Two contracts:

- **Its own arithmetic** (``crisp_kernels.cpu_expert_q8.expert_mlp_q8_ref``: the same int8 rounding of x and of
  the down coefficients, in float64): equal within 1e-5 in relative norm (fp32 accumulation, as the fp32
  kernel's tolerance), after allowing one step for each down coefficient that lies within
  ``BOUNDARY_SLACK`` of a rounding boundary (the kernel's fp32 activation may round it the other way:
  ``boundary_allowance``), and adding fp32 summation's bound for the worst-conditioned neuron in the range
  (``summation_bound``: a one-neuron range whose pre-activation cancels 1000-fold needs it).
- **The model's** (the float64 reference of the unquantized activations): ``tolerance(Precision.Q8)`` = 2**-5;
  measured 0.85-1.2% on these random experts. And it is not the fp32 path: the error is above 1e-4.

Shapes: odd intermediate sizes, H / 2 not a multiple of 32 bytes (the kernel's 16-byte tail), every group size
(32: the two halves of a 32-byte step in different groups), symmetric and asymmetric; widths 0, 1, a neuron block
+- 1, full; row ranges starting inside a neuron block; 1-64 tokens (every tile remainder); 1-5 threads.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_expert import expert, inputs
from test_cpu_native import NARROWER_BUILDS, narrower_kernel

from crisp_kernels import cpu_native
from crisp_kernels.cpu_expert import (
    CpuExpertConfig,
    CpuImpl,
    Precision,
    choose_impl,
    expert_mlp_cpu_accumulate_,
    reference_check,
    tolerance,
)
from crisp_kernels.cpu_expert_q8 import NEURON_BLOCK, boundary_allowance, expert_mlp_q8_ref, quantize_blocks
from crisp_kernels.expert_mlp import expert_mlp_ref

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernel does not build here")

OWN_TOL = 1e-5  # fp32 accumulation against the float64 evaluation of the same quantized arithmetic
Q8 = CpuExpertConfig(Precision.Q8)
# (H, I, group, symmetric): H = 96 and 160 leave a 16-byte tail per row; I odd and not a multiple of 16;
# H = 1088 has 17 groups (the down pass builds its coefficient pairs 16 groups a vector, then one alone).
# Group 64 at one token reduces 128 bytes of a row at a time (q8_dots_1_g64), then 32-byte steps: H = 1088 leaves
# one step after 4 such chunks, H = 448 three after 1, H = 192 three and no chunk
SHAPES = [(256, 200, 64, False), (96, 40, 32, False), (160, 77, 32, True), (384, 300, 128, False),
          (2048, 150, 64, True), (1088, 70, 64, False), (448, 37, 64, True), (192, 33, 64, False)]


def call(kernel, packed, x, widths, start, stop, weights, threads) -> torch.Tensor:
    out = torch.zeros(x.shape)
    kt = None if widths is None else widths.to(torch.int64).clamp(0, stop).contiguous()
    kernel.rows_q8(x, packed.qweight, packed.scales, packed.zeros, packed.fmt.group_size, kt, start, stop,
                   weights, out, threads)
    return out


FP32_U = 2.0**-24  # unit roundoff of fp32


def summation_bound(x, packed, start, stop) -> float:
    """The fp32 accumulation's relative error bound on the rows' gate / up dots: the kernel sums one fp32 term
    per x block (scale x exact integer), so recursive summation's bound n u kappa applies, n = H / 32 terms,
    kappa = sum |term| / |sum| of the worst neuron's dot (a pre-activation 1000x smaller than its terms loses
    1000x more of itself; 2.8e-4 measured on one such neuron, bound 3.4e-4)."""
    from crisp_kernels.cpu_expert_q8 import X_BLOCK, _codes

    if stop <= start:
        return 0.0
    g = packed.fmt.group_size
    q, s, z = _codes(packed, start, stop)
    xq, sx = quantize_blocks(x.float(), X_BLOCK)
    tokens, hidden = x.shape
    blocks = hidden // X_BLOCK
    xb = xq.double().view(tokens, blocks, X_BLOCK)
    kappa = 1.0
    for proj in (0, 1):
        centred = (q[:, proj] - z[:, proj].repeat_interleave(g, dim=1)).view(-1, blocks, X_BLOCK)
        terms = torch.einsum("tbk,jbk->tjb", xb, centred) * s[:, proj].repeat_interleave(g // X_BLOCK, 1) \
            * sx.double().unsqueeze(1)
        kappa = max(kappa, (terms.abs().sum(-1) / terms.sum(-1).abs().clamp_min(1e-300)).max().item())
    return 2 * blocks * FP32_U * kappa  # gate and up: their errors add in silu(gate) up


def own_error(got, x, packed, widths, start, stop, weights) -> float:
    """Relative norm of what exceeds the boundary allowance, against the quantized reference, in units of its
    tolerance (1: at the bound): OWN_TOL plus the fp32 summation bound of the worst-conditioned neuron."""
    kt = None if widths is None else widths.to(torch.int64).clamp(0, stop)
    w = weights.double().unsqueeze(1)
    ref = expert_mlp_q8_ref(x, packed, stop, token_widths=kt, row_start=start) * w
    allow = boundary_allowance(x, packed, stop, token_widths=kt, row_start=start) * w
    excess = ((got.double() - ref).abs() - allow).clamp(min=0)
    tol = OWN_TOL + summation_bound(x, packed, start, stop)
    if ref.norm() == 0:
        return excess.norm().item() / tol
    return (excess.norm() / ref.norm()).item() / tol


def _ranges(inter):
    b = NEURON_BLOCK
    return [(0, inter), (0, 1), (0, b - 1), (0, b), (0, b + 1), (7, inter), (b + 3, inter - 1), (b, 2 * b + 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 9])
def test_equals_its_own_arithmetic(shape, tokens):
    kernel = cpu_native.load()
    packed = expert(*shape)
    for per_token in (False, True):
        x, weights, widths = inputs(tokens, shape[0], torch.float32, shape[1], per_token, seed=tokens)
        for start, stop in _ranges(shape[1]):
            for threads in (1, 2):
                got = call(kernel, packed, x, widths, start, stop, weights, threads)
                assert own_error(got, x, packed, widths, start, stop, weights) <= 1, (start, stop, threads)


@pytest.mark.parametrize("tokens", [*range(1, 10), 16, 63, 64])
def test_every_token_tile_remainder(tokens):
    shape = (256, 200, 64, False)
    packed = expert(*shape)
    x, weights, widths = inputs(tokens, shape[0], torch.float32, shape[1], per_token=True, seed=3)
    got = call(cpu_native.load(), packed, x, widths, 0, shape[1], weights, 2)
    assert own_error(got, x, packed, widths, 0, shape[1], weights) <= 1


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[6]])
def test_a_tokens_output_does_not_depend_on_the_other_tokens_of_the_call(shape):
    """Each token's row of a call is the same bits as that token alone (group 64: the one-token pass token by
    token; other groups: the tiles' per-token accumulators), at each width and thread count."""
    kernel = cpu_native.load()
    packed = expert(*shape)
    x, weights, widths = inputs(7, shape[0], torch.float32, shape[1], per_token=True, seed=11)
    for threads in (1, 2):
        together = call(kernel, packed, x, widths, 0, shape[1], weights, threads)
        for t in range(x.shape[0]):
            alone = call(kernel, packed, x[t:t + 1].contiguous(), widths[t:t + 1], 0, shape[1], weights[t:t + 1],
                         threads)
            assert torch.equal(together[t], alone[0]), (t, threads)


@pytest.mark.parametrize("shape", SHAPES)
def test_within_the_q8_tolerance_of_the_unquantized_reference_and_not_fp32(shape):
    packed = expert(*shape)
    x, weights, widths = inputs(4, shape[0], torch.float32, shape[1], per_token=False)
    err = reference_check(x, packed, None, shape[1], weights, Q8)
    assert 1e-4 < err <= tolerance(Precision.Q8)


def test_threads_do_not_change_the_blocks():
    """Thread ranges start on neuron-block boundaries, so the quantization blocks are the same for any thread
    count: only the order of the per-thread sums differs."""
    kernel = cpu_native.load()
    shape = (256, 1100, 64, False)
    packed = expert(*shape)
    x, weights, widths = inputs(3, shape[0], torch.float32, shape[1], per_token=True)
    one = call(kernel, packed, x, widths, 5, shape[1], weights, 1)
    for threads in (2, 3, 5, 5000):
        got = call(kernel, packed, x, widths, 5, shape[1], weights, threads)
        assert torch.equal(got, call(kernel, packed, x, widths, 5, shape[1], weights, threads))
        assert ((got - one).norm() / one.norm()).item() <= OWN_TOL


def test_rows_outside_the_range_are_never_read():
    """NaN scales and garbage codes before row_start and from the stop on: the output is bitwise the clean one."""
    shape = (256, 200, 64, False)
    clean = expert(*shape)
    start, stop = 21, 150
    q, s = clean.qweight.clone(), clean.scales.clone()
    q[:start], q[stop:] = 0xAB, 0xCD
    s[:start], s[stop:] = float("nan"), float("nan")
    from dataclasses import replace

    poisoned = replace(clean, qweight=q, scales=s)
    x, weights, widths = inputs(3, shape[0], torch.float32, shape[1], per_token=True)
    kernel = cpu_native.load()
    want = call(kernel, clean, x, widths, start, stop, weights, 2)
    assert torch.isfinite(want).all()
    assert torch.equal(call(kernel, poisoned, x, widths, start, stop, weights, 2), want)


def test_zero_activations_and_empty_ranges_add_nothing():
    shape = (256, 200, 64, False)
    packed = expert(*shape)
    kernel = cpu_native.load()
    x = torch.zeros(2, shape[0])
    weights = torch.ones(2)
    assert torch.count_nonzero(call(kernel, packed, x, None, 0, shape[1], weights, 2)) == 0  # sx = 0: xq = 0
    x, weights, _ = inputs(2, shape[0], torch.float32, shape[1], per_token=False)
    assert torch.count_nonzero(call(kernel, packed, x, None, 50, 50, weights, 2)) == 0
    zero_widths = torch.zeros(2, dtype=torch.int64)
    assert torch.count_nonzero(call(kernel, packed, x, zero_widths, 0, shape[1], weights, 2)) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_token_with_inf_or_nan_gets_nan_and_the_others_are_untouched(bad):
    """The 8-bit codes of inf / nan would be a C cast's undefined value: the token's whole output is nan instead
    (the fp32 path's is non-finite too), never finite numbers; the other tokens are what they are alone."""
    shape = (256, 200, 64, False)
    packed = expert(*shape)
    kernel = cpu_native.load()
    x, weights, _ = inputs(3, shape[0], torch.float32, shape[1], per_token=False)
    clean = call(kernel, packed, x, None, 0, shape[1], weights, 2)
    x[1, 77] = bad
    got = call(kernel, packed, x, None, 0, shape[1], weights, 2)
    assert torch.isnan(got[1]).all()
    assert torch.equal(got[[0, 2]], clean[[0, 2]])


def test_quantize_blocks_rounds_half_to_even_and_keeps_zero_blocks():
    v = torch.tensor([[127.0, 0.5, 1.5, -2.5] + [0.0] * 28 + [0.0] * 32])
    q, scale = quantize_blocks(v, 32)
    assert scale.tolist() == [[1.0, 0.0]]
    assert q[0, :4].tolist() == [127.0, 0.0, 2.0, -2.0] and torch.count_nonzero(q[0, 32:]) == 0


def test_the_config_chooses_the_q8_kernel_and_falls_back_to_bf16_without_it(monkeypatch):
    packed = expert(*SHAPES[0])
    assert choose_impl(packed, torch.float32, 1, Q8) is CpuImpl.NATIVE_Q8
    assert choose_impl(packed, torch.float32, 1, CpuExpertConfig()) is CpuImpl.NATIVE_FP32
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    assert choose_impl(packed, torch.float32, 1, Q8) is CpuImpl.DEQUANT_FP32  # no int4pack copy given


def test_the_accumulate_entry_point_runs_it():
    shape = (256, 200, 64, False)
    packed = expert(*shape)
    x, weights, widths = inputs(3, shape[0], torch.float32, shape[1], per_token=True)
    out = torch.full(x.shape, 0.25)
    expert_mlp_cpu_accumulate_(x, packed, widths, 130, weights, out, config=Q8, row_start=9)
    got = out - 0.25
    assert own_error(got, x, packed, widths.clamp(0, 130), 9, 130, weights) <= 1
    fp32 = expert_mlp_ref(x, packed, 130, token_widths=widths.clamp(0, 130), compute_dtype=torch.float64)
    fp32 -= expert_mlp_ref(x, packed, 9, token_widths=widths.clamp(0, 130), compute_dtype=torch.float64)
    fp32 *= weights.double().unsqueeze(1)
    assert ((got.double() - fp32).norm() / fp32.norm()).item() <= tolerance(Precision.Q8)


@pytest.mark.parametrize("build", sorted(NARROWER_BUILDS))
def test_narrower_builds_equal_its_own_arithmetic(tmp_path, build):
    """The portable C path (no AVX2) and the AVX2 path compute the same quantized arithmetic."""
    kernel = narrower_kernel(tmp_path, build)
    for shape in (SHAPES[0], SHAPES[2]):
        packed = expert(*shape)
        for tokens in (1, 5):
            x, weights, widths = inputs(tokens, shape[0], torch.float32, shape[1], per_token=True)
            for start, stop in ((0, shape[1]), (7, shape[1] - 1)):
                got = call(kernel, packed, x, widths, start, stop, weights, 2)
                assert own_error(got, x, packed, widths, start, stop, weights) <= 1
