"""The Triton expert kernels against a float64 reference on the same packed weights.

On a CPU-only machine the kernels run in Triton's interpreter (tests/conftest.py); with
``CRISP_TEST_DEVICES=cuda`` and ``TRITON_INTERPRET=0`` the same tests run compiled on a GPU.

Error metric: ``||out - ref|| / ||ref||`` with ``ref = expert_mlp_ref(..., compute_dtype=float64)``.
Tolerances:

- fp32 out (fp32 activations, and every ``expert_mlp_accumulate_`` output): 1e-5. The kernels
  accumulate in fp32 over at most H products per stage; measured 1e-7..3e-7 at H=384.
- fp16 / bf16 out: ``2u`` with u the unit roundoff of the output dtype (fp16 2^-11 -> 9.8e-4,
  bf16 2^-8 -> 7.8e-3). Rounding the output alone gives a relative error of at most u (its
  RMS is about 0.4u: measured 2.0e-4..2.2e-4 for fp16 and 1.4e-3..1.9e-3 for bf16); on a GPU the
  prefill path rounds the dot operands (the dequantized weights and the fp32 intermediate) to
  the activation dtype too, one more rounding of the same size, hence 2u.
"""

import functools

import pytest
import torch

import crisp_kernels.expert_mlp_triton as kernels
from crisp_kernels import (
    Backend,
    PackedExpert,
    QuantFormat,
    expert_mlp,
    expert_mlp_accumulate_,
    expert_mlp_ref,
    pack_expert,
    select_backend,
)
from crisp_kernels._triton import interpreter_enabled
from crisp_kernels.expert_mlp_triton import DECODE_MAX_TOKENS, make_plan, select_config, select_plan

FP32_TOL = 1e-5
HALF_TOL = {torch.float16: 2 * 2.0**-11, torch.bfloat16: 2 * 2.0**-8}


def out_tol(dtype: torch.dtype) -> float:
    return FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype]


def internal_tol(x_dtype: torch.dtype, device: torch.device, num_tokens: int) -> float:
    """Tolerance of an fp32 output computed from ``x_dtype`` activations: the GPU prefill path
    rounds its dot operands to the activation dtype; every other path computes in fp32."""
    if device.type == "cuda" and num_tokens > DECODE_MAX_TOKENS and x_dtype != torch.float32:
        return HALF_TOL[x_dtype]
    return FP32_TOL


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    assert torch.isfinite(out).all()
    return ((out.double() - ref).norm() / ref.norm()).item()


def check_close(out, ref, tol):
    if ref.abs().max() == 0:
        assert torch.count_nonzero(out) == 0
        return
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


@functools.cache
def _cpu_expert(hidden: int, inter: int, group: int, symmetric: bool, seed: int = 0) -> PackedExpert:
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(inter, hidden, generator=gen) / hidden**0.5
    up = torch.randn(inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(hidden, inter, generator=gen) / inter**0.5
    return pack_expert(gate, up, down, QuantFormat(group_size=group, symmetric=symmetric))


def make_expert(device, hidden=384, inter=200, group=64, symmetric=False, seed=0) -> PackedExpert:
    return _cpu_expert(hidden, inter, group, symmetric, seed).to(device)


def make_x(num_tokens, hidden, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)


SHAPES = [(384, 200), (256, 64)]  # (H, I): H not a multiple of 128 bytes, I not of any block
TOKENS = [1, 3, 16, 17]  # both sides of the decode / prefill switch


def widths_around_blocks(num_tokens: int, inter: int) -> list[int]:
    bn = select_config(num_tokens).block_n
    return sorted({w for w in (0, 1, bn - 1, bn, bn + 1, inter) if w <= inter})


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}-I{s[1]}")
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_widths_match_reference(device, kernel_backend, shape, num_tokens):
    hidden, inter = shape
    case = SHAPES.index(shape) * len(TOKENS) + TOKENS.index(num_tokens)
    group, symmetric = (32, 64, 128)[case % 3], bool(case % 2)  # every format across the cases
    packed = make_expert(device, hidden, inter, group, symmetric)
    x = make_x(num_tokens, hidden, torch.float32, device)
    for width in widths_around_blocks(num_tokens, inter):
        out = expert_mlp(x, packed, width, backend=kernel_backend)
        assert out.shape == (num_tokens, hidden) and out.dtype == torch.float32
        check_close(out, expert_mlp_ref(x, packed, width, compute_dtype=torch.float64), FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens", [3, 17])
def test_dtypes(device, kernel_backend, dtype, num_tokens):
    packed = make_expert(device, group=128)
    x = make_x(num_tokens, 384, dtype, device)
    out = expert_mlp(x, packed, 150, backend=kernel_backend)
    assert out.dtype == dtype and out.shape == x.shape
    check_close(out, expert_mlp_ref(x, packed, 150, compute_dtype=torch.float64), out_tol(dtype))


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_formats(device, kernel_backend, group, symmetric):
    packed = make_expert(device, 256, 64, group, symmetric, seed=2)
    for num_tokens in (2, 18):
        x = make_x(num_tokens, 256, torch.float32, device)
        out = expert_mlp(x, packed, 37, backend=kernel_backend)
        check_close(out, expert_mlp_ref(x, packed, 37, compute_dtype=torch.float64), FP32_TOL)


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 40])
def test_token_widths(device, kernel_backend, num_tokens):
    packed = make_expert(device)
    width = 120
    gen = torch.Generator().manual_seed(num_tokens)
    token_widths = torch.randint(-5, 260, (num_tokens,), generator=gen)
    token_widths[0] = 0  # a token that uses nothing
    if num_tokens > 1:
        token_widths[1] = 500  # more than the width: clamped to it
    dtype = torch.int32 if num_tokens % 2 else torch.int64
    token_widths = token_widths.to(dtype).to(device)
    x = make_x(num_tokens, 384, torch.float32, device)
    out = expert_mlp(x, packed, width, token_widths=token_widths, backend=kernel_backend)
    ref = expert_mlp_ref(x, packed, width, token_widths=token_widths, compute_dtype=torch.float64)
    check_close(out, ref, FP32_TOL)
    assert torch.count_nonzero(out[0]) == 0
    if num_tokens > 1:
        check_close(out[1], expert_mlp_ref(x[1:2], packed, width, compute_dtype=torch.float64)[0], FP32_TOL)


def _accumulate_expected(out0, x, packed, width, rows, weights, token_widths):
    xr = x[rows.long()]
    y = expert_mlp_ref(xr, packed, width, token_widths=token_widths, compute_dtype=torch.float64)
    return out0.double().index_add(0, rows.long(), y * weights.double().unsqueeze(1))


@pytest.mark.parametrize(
    "num_tokens, dtype, with_widths",
    [(1, torch.float32, False), (7, torch.float16, True), (16, torch.bfloat16, False), (30, torch.float16, True)],
)
def test_accumulate(device, kernel_backend, num_tokens, dtype, with_widths):
    n_rows, width = 48, 90
    packed = make_expert(device, group=32)
    gen = torch.Generator().manual_seed(num_tokens)
    x = make_x(n_rows, 384, dtype, device)
    rows = torch.randperm(n_rows, generator=gen)[:num_tokens].to(device)
    weights = torch.rand(num_tokens, generator=gen).to(device)
    token_widths = torch.randint(0, 130, (num_tokens,), generator=gen).to(device) if with_widths else None
    out0 = torch.randn(n_rows, 384, generator=gen).to(device)
    out = out0.clone()
    result = expert_mlp_accumulate_(out, x, packed, width, rows=rows, weights=weights, token_widths=token_widths,
                                    backend=kernel_backend)  # fmt: skip
    assert result is out
    expected = _accumulate_expected(out0, x, packed, width, rows, weights, token_widths)
    check_close(out - out0, expected - out0.double(), internal_tol(dtype, device, num_tokens))
    untouched = torch.ones(n_rows, dtype=torch.bool, device=device)
    untouched[rows] = False
    assert torch.equal(out[untouched], out0[untouched])


@pytest.mark.parametrize("rows", [[3, 3, 5, 3], [0, 2, 2] * 6], ids=["decode", "prefill"])
def test_accumulate_repeated_rows(device, kernel_backend, rows):
    packed = make_expert(device, 256, 64)
    rows = torch.tensor(rows, device=device)
    weights = torch.linspace(0.1, 1.0, rows.shape[0], device=device)
    x = make_x(8, 256, torch.float32, device)
    out = torch.zeros(8, 256, device=device)
    expert_mlp_accumulate_(out, x, packed, rows=rows, weights=weights, backend=kernel_backend)
    expected = _accumulate_expected(torch.zeros(8, 256, device=device), x, packed, 64, rows, weights, None)
    check_close(out, expected, FP32_TOL)


@pytest.mark.parametrize("num_tokens", [2, 20])
@pytest.mark.parametrize("split", [1, 3])
def test_forced_split(device, kernel_backend, num_tokens, split):
    """Stage 2 stored (split 1) and added atomically over neuron chunks (split > 1), both paths."""
    width = 150
    packed = make_expert(device, symmetric=True)
    plan = make_plan(select_config(num_tokens), width, split)
    assert plan.split == split
    x = make_x(num_tokens, 384, torch.float16, device)
    ref = expert_mlp_ref(x, packed, width, compute_dtype=torch.float64)
    check_close(kernels.expert_mlp_triton(x, packed, width, None, plan=plan), ref, HALF_TOL[torch.float16])
    out = torch.zeros(num_tokens + 1, 384, device=device)
    rows = torch.arange(1, num_tokens + 1, device=device)
    x1 = torch.cat([x[:1], x])
    kernels.expert_mlp_accumulate_triton_(out, x1, packed, width, rows, torch.ones(num_tokens, device=device), None,
                                          plan=plan)  # fmt: skip
    check_close(out[1:], ref, internal_tol(torch.float16, device, num_tokens))
    assert torch.count_nonzero(out[0]) == 0


def _poisoned(packed: PackedExpert, width: int) -> PackedExpert:
    """A copy of ``packed`` whose rows >= width hold garbage: 0xFF codes, NaN scales, 255 zeros."""
    q, s = packed.qweight.clone(), packed.scales.clone()
    q[width:] = 0xFF
    s[width:] = float("nan")
    z = None
    if packed.zeros is not None:
        z = packed.zeros.clone()
        z[width:] = 255
    return PackedExpert(packed.fmt, q, s, z)


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("num_tokens", [3, 20])
def test_reads_nothing_past_the_prefix(device, kernel_backend, num_tokens, symmetric):
    width = 37  # not a multiple of any block: the last tile straddles the prefix end
    clean = make_expert(device, symmetric=symmetric)
    poisoned = _poisoned(clean, width)
    x = make_x(num_tokens, 384, torch.float32, device)
    ref = expert_mlp_ref(x, clean, width, compute_dtype=torch.float64)
    check_close(expert_mlp(x, poisoned.prefix(width), backend=kernel_backend), ref, FP32_TOL)
    check_close(expert_mlp(x, poisoned, width, backend=kernel_backend), ref, FP32_TOL)
    # token widths beyond the width are clamped, never reaching the poison
    token_widths = torch.full((num_tokens,), 10_000, device=device)
    check_close(expert_mlp(x, poisoned, width, token_widths=token_widths, backend=kernel_backend), ref, FP32_TOL)
    out = torch.zeros(num_tokens, 384, device=device)
    rows = torch.arange(num_tokens, device=device)
    expert_mlp_accumulate_(out, x, poisoned.prefix(width), rows=rows, weights=torch.ones(num_tokens, device=device),
                           backend=kernel_backend)  # fmt: skip
    check_close(out, ref, FP32_TOL)


@pytest.mark.parametrize("num_tokens", [4, 19])
def test_strided_activation_rows(device, kernel_backend, num_tokens):
    packed = make_expert(device, 256, 64)
    base = make_x(num_tokens, 256 + 70, torch.float16, device)
    x = base[:, 35 : 35 + 256]  # row stride 326, storage offset 35
    assert not x.is_contiguous() and x.stride(-1) == 1
    out = expert_mlp(x, packed, backend=kernel_backend)
    check_close(out, expert_mlp_ref(x.contiguous(), packed, compute_dtype=torch.float64), HALF_TOL[torch.float16])
    acc = torch.zeros(num_tokens, 256, device=device)
    rows = torch.arange(num_tokens, device=device).flip(0)
    expert_mlp_accumulate_(acc, x, packed, rows=rows, weights=torch.ones(num_tokens, device=device),
                           backend=kernel_backend)  # fmt: skip
    check_close(acc, expert_mlp_ref(x, packed, compute_dtype=torch.float64), internal_tol(torch.float16, device,
                                                                                          num_tokens))  # fmt: skip


def test_no_tokens_or_zero_width(device, kernel_backend):
    packed = make_expert(device, 256, 64)
    out = expert_mlp(make_x(0, 256, torch.float16, device), packed, backend=kernel_backend)
    assert out.shape == (0, 256) and out.dtype == torch.float16
    x = make_x(5, 256, torch.bfloat16, device)
    out = expert_mlp(x, packed, 0, backend=kernel_backend)
    assert out.dtype == torch.bfloat16 and torch.count_nonzero(out) == 0
    acc0 = torch.randn(5, 256, device=device)
    acc = acc0.clone()
    rows = torch.arange(5, device=device)
    expert_mlp_accumulate_(acc, x, packed, 0, rows=rows, weights=torch.ones(5, device=device), backend=kernel_backend)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    expert_mlp_accumulate_(acc, x, packed, rows=empty, weights=torch.zeros(0, device=device), backend=kernel_backend)
    assert torch.equal(acc, acc0)


# ----------------------------------------------------------------------------- plans


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8, 16, 17, 64, 65, 300])
@pytest.mark.parametrize("width", [1, 63, 64, 200, 14336])
def test_plan_covers_width(num_tokens, width):
    plan = select_plan(num_tokens, 4096, width, torch.device("cpu"))
    cfg = plan.config
    assert cfg.path == ("decode" if num_tokens <= DECODE_MAX_TOKENS else "prefill")
    assert cfg.block_t >= num_tokens if cfg.path == "decode" else min(cfg.block_t, cfg.block_n, cfg.block_k) >= 16
    if cfg.path == "prefill":
        assert min(cfg.block_j, cfg.block_h) >= 16  # tl.dot's minimum on a GPU
    assert plan.chunk % cfg.block_j == 0
    assert plan.split * plan.chunk >= width > (plan.split - 1) * plan.chunk  # no empty chunk, nothing missed


# ----------------------------------------------------------------------------- backends


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    expected = Backend.TRITON_INTERPRET if interpreter_enabled() else Backend.TORCH
    assert select_backend(cpu) is expected
    assert select_backend(torch.device("meta")) is Backend.TORCH
    assert select_backend(torch.device("cuda")) is Backend.TRITON  # a device object: no GPU touched
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select_backend(cpu) is Backend.TORCH


def test_backend_dispatch(monkeypatch):
    """backend=TORCH runs the reference; the Triton backends call the kernel launchers."""
    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1")

    def boom(*args, **kwargs):
        raise RuntimeError("kernel called")

    monkeypatch.setattr(kernels, "expert_mlp_triton", boom)
    monkeypatch.setattr(kernels, "expert_mlp_accumulate_triton_", boom)
    packed = make_expert("cpu", 256, 64)
    x = make_x(2, 256, torch.float16, "cpu")
    out = expert_mlp(x, packed, 10, backend=Backend.TORCH)
    assert out.dtype == torch.float16
    check_close(out, expert_mlp_ref(x, packed, 10, compute_dtype=torch.float64), HALF_TOL[torch.float16])
    assert torch.equal(expert_mlp(x, packed, 10, backend="torch"), out)
    for backend in (None, Backend.TRITON_INTERPRET, "triton-interpret"):
        with pytest.raises(RuntimeError, match="kernel called"):
            expert_mlp(x, packed, 10, backend=backend)
    acc = torch.zeros(2, 256)
    rows, weights = torch.arange(2), torch.ones(2)
    expert_mlp_accumulate_(acc, x, packed, 10, rows=rows, weights=weights, backend=Backend.TORCH)
    check_close(acc, expert_mlp_ref(x, packed, 10, compute_dtype=torch.float64), FP32_TOL)
    with pytest.raises(RuntimeError, match="kernel called"):
        expert_mlp_accumulate_(acc, x, packed, 10, rows=rows, weights=weights)


def test_backend_errors():
    packed = make_expert("cpu", 256, 64)
    x = make_x(2, 256, torch.float32, "cpu")
    with pytest.raises(ValueError, match="backend=TRITON needs CUDA tensors"):
        expert_mlp(x, packed, backend=Backend.TRITON)
    with pytest.raises(ValueError, match="'cuda-please' is not a valid Backend"):
        expert_mlp(x, packed, backend="cuda-please")


# ----------------------------------------------------------------------------- bad inputs


@pytest.fixture
def small():
    return make_expert("cpu", 256, 64), make_x(3, 256, torch.float32, "cpu")


@pytest.mark.parametrize(
    "make_bad, error, match",
    [
        (lambda x: x[:, :128], ValueError, r"x: expected shape \(T, H=256\), got \(3, 128\)"),
        (lambda x: x[0], ValueError, r"x: expected shape \(T, H=256\), got \(256,\)"),
        (lambda x: x.double(), ValueError, "x: expected dtype fp16, bf16 or fp32, got torch.float64"),
        (lambda x: x.int(), ValueError, "x: expected dtype fp16, bf16 or fp32, got torch.int32"),
        (lambda x: x.to("meta"), ValueError, "x is on meta but the packed expert is on cpu"),
        (lambda x: x.t().contiguous().t(), ValueError, "x: the hidden dimension must be contiguous"),
        (lambda x: x.tolist(), TypeError, "x: expected a torch.Tensor, got list"),
    ],
    ids=["hidden", "1d", "float64", "int", "device", "strided-hidden", "list"],
)
def test_bad_activations(small, make_bad, error, match):
    packed, x = small
    with pytest.raises(error, match=match):
        expert_mlp(make_bad(x), packed)
    with pytest.raises(error, match=match):
        expert_mlp_accumulate_(torch.zeros(3, 256), make_bad(x), packed, rows=torch.arange(3), weights=torch.ones(3))


def test_bad_packed(small):
    packed, x = small
    with pytest.raises(TypeError, match="packed: expected a PackedExpert, got dict"):
        expert_mlp(x, {"qweight": packed.qweight})
    q = packed.qweight.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, not contiguous
    with pytest.raises(ValueError, match="packed.qweight: must be contiguous"):
        expert_mlp(x, PackedExpert(packed.fmt, q, packed.scales, packed.zeros))
    with pytest.raises(ValueError, match="x is on cpu but the packed expert is on meta"):
        expert_mlp(x, packed.to("meta"))


@pytest.mark.parametrize(
    "width, error, match",
    [(-1, ValueError, "width=-1 is out of range"), (65, ValueError, "width=65 is out of range"),
     (2.0, TypeError, "width: expected an int"), (torch.tensor(3), TypeError, "width: expected an int")],
)  # fmt: skip
def test_bad_width(small, width, error, match):
    packed, x = small
    with pytest.raises(error, match=match):
        expert_mlp(x, packed, width)


@pytest.mark.parametrize(
    "token_widths, error, match",
    [
        (torch.ones(4, dtype=torch.int64), ValueError, r"token_widths: expected shape \(3,\), got \(4,\)"),
        (torch.ones(3, 1, dtype=torch.int64), ValueError, r"token_widths: expected shape \(3,\), got \(3, 1\)"),
        (torch.ones(3), ValueError, "token_widths: expected dtype in .*got torch.float32"),
        (torch.ones(3, dtype=torch.int16), ValueError, "token_widths: expected dtype in .*got torch.int16"),
        (torch.ones(3, dtype=torch.int64, device="meta"), ValueError, "token_widths is on meta, expected cpu"),
        ([1, 2, 3], TypeError, "token_widths: expected a torch.Tensor"),
    ],
    ids=["length", "2d", "float", "int16", "device", "list"],
)
def test_bad_token_widths(small, token_widths, error, match):
    packed, x = small
    with pytest.raises(error, match=match):
        expert_mlp(x, packed, token_widths=token_widths)
    with pytest.raises(error, match=match):
        expert_mlp_accumulate_(torch.zeros(3, 256), x, packed, rows=torch.arange(3), weights=torch.ones(3),
                               token_widths=token_widths)  # fmt: skip


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(out=torch.zeros(3, 128)), ValueError, r"out: expected \(N, H=256\), got \(3, 128\)"),
        (dict(out=torch.zeros(3, 256, dtype=torch.float16)), ValueError, "out: expected float32"),
        (dict(out=torch.zeros(3, 256, device="meta")), ValueError, "out is on meta, expected cpu like x"),
        (dict(out=torch.zeros(256, 3).t()), ValueError, "out: must be contiguous"),
        (dict(out=torch.zeros(4, 256)), ValueError, "out: expected 3 rows like x, got 4"),
        (dict(out=None), ValueError, r"out: expected \(N, H=256\), got NoneType"),
        (dict(rows=torch.arange(3.0)), ValueError, "rows: expected dtype in .*got torch.float32"),
        (dict(rows=torch.zeros(3, 1, dtype=torch.int64)), ValueError, r"rows: expected shape"),
        (dict(rows=[0, 1, 2]), TypeError, "rows: expected a torch.Tensor"),
        (dict(weights=torch.ones(2)), ValueError, r"weights: expected shape \(3,\), got \(2,\)"),
        (dict(weights=torch.ones(3, dtype=torch.float16)), ValueError, "weights: expected dtype in"),
        (dict(weights=torch.ones(3, device="meta")), ValueError, "weights is on meta"),
    ],
    ids=["out-hidden", "out-dtype", "out-device", "out-strided", "out-rows", "out-none", "rows-float", "rows-2d",
         "rows-list", "weights-length", "weights-dtype", "weights-device"],  # fmt: skip
)
def test_bad_accumulate_args(small, change, error, match):
    packed, x = small
    args = dict(out=torch.zeros(3, 256), rows=torch.arange(3), weights=torch.ones(3)) | change
    with pytest.raises(error, match=match):
        expert_mlp_accumulate_(args["out"], x, packed, rows=args["rows"], weights=args["weights"])


def _strided(t: torch.Tensor) -> torch.Tensor:
    """Same values, stride 2: a view into a buffer twice as long (the kernels index ptr + t)."""
    base = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
    base[::2] = t
    return base[::2]


@pytest.mark.parametrize("arg", ["token_widths", "rows", "weights"])
@pytest.mark.parametrize("entry", ["function", "op"])
def test_strided_token_vectors_refused(small, arg, entry):
    """Regression: a strided token_widths gave wrong output and strided rows / weights wrote out of
    bounds; every per-token vector must be refused unless its stride is 1."""
    packed, x = small
    vectors = dict(token_widths=torch.tensor([10, 64, 3]), rows=torch.arange(3), weights=torch.ones(3))
    vectors[arg] = _strided(vectors[arg])
    assert vectors[arg].stride(0) == 2
    match = f"{arg}: must be contiguous \\(stride 1\\), got stride 2"
    if arg == "token_widths":
        with pytest.raises(ValueError, match=match):
            if entry == "op":
                torch.ops.crisp.expert_mlp(x, packed.qweight, packed.scales, packed.zeros, 64, 64, vectors[arg])
            else:
                expert_mlp(x, packed, token_widths=vectors[arg])
    out = torch.zeros(3, 256)
    with pytest.raises(ValueError, match=match):
        if entry == "op":
            torch.ops.crisp.expert_mlp_accumulate_(out, x, packed.qweight, packed.scales, packed.zeros, 64, 64,
                                                   vectors["rows"], vectors["weights"], vectors["token_widths"])
        else:
            expert_mlp_accumulate_(out, x, packed, rows=vectors["rows"], weights=vectors["weights"],
                                   token_widths=vectors["token_widths"])
    assert torch.count_nonzero(out) == 0  # refused before anything was written


def test_contiguous_copy_of_strided_vector_matches(small):
    """The remedy the error names (``.contiguous()``) gives the reference result."""
    packed, x = small
    tw = _strided(torch.tensor([10, 64, 3]))
    out = expert_mlp(x, packed, token_widths=tw.contiguous())
    ref = expert_mlp_ref(x, packed, token_widths=tw, compute_dtype=torch.float64)
    assert (out.double() - ref).norm() <= FP32_TOL * ref.norm()


@pytest.mark.parametrize("arg", ["rows", "weights"])
def test_accumulate_needs_rows_and_weights(small, arg):
    packed, x = small
    args = dict(rows=torch.arange(3), weights=torch.ones(3)) | {arg: None}
    with pytest.raises(TypeError, match=f"{arg}: expected a .*torch.Tensor"):
        expert_mlp_accumulate_(torch.zeros(3, 256), x, packed, **args)
