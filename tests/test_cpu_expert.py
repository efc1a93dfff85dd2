"""The CPU expert kernel (crisp_kernels.cpu_expert) against the float64 reference on the same rows.

Error metric and tolerances as in tests/test_expert_mlp.py: ``||out - ref|| / ||ref||`` with
``ref = weights * expert_mlp_ref(..., compute_dtype=float64)``;

- Precision.FP32 (the dequant path): 1e-5, fp32 accumulation over at most H products per stage.
- Precision.BF16 (torch's int4pack op): 2u of bf16 = 7.8e-3, the kernels' tolerance for outputs
  computed from operands rounded to bf16. The activations given are bf16 values (exact), as they
  are in the GPU tests; the op rounds its outputs and the gate/up scales to bf16 as well: measured
  4e-3..6e-3 here.

The poisoned-prefix tests put NaN scales and garbage weights in every row past the width, in the
host rows AND in the int4pack copy, and require the output to be bitwise what the clean expert
gives: rows past k are never read.
"""

import functools
import threading

import pytest
import torch

from crisp_kernels import PackedExpert, QuantFormat, pack_expert
from crisp_kernels.cpu_expert import (
    BLOCK_N_CANDIDATES,
    DEFAULT_CHUNK,
    DEFAULT_CONFIG,
    GATE_UP_CHUNK,
    CpuExpert,
    CpuExpertConfig,
    CpuImpl,
    CpuKernelInfo,
    Int4PackLayout,
    Int4PackUnsupported,
    Precision,
    _int4pack,
    cpu_expert_prepare,
    expert_mlp_cpu_accumulate_,
    int4pack_layout,
    kernel_info,
    prepare_expert,
    reference_check,
    tolerance,
)
from crisp_kernels.expert_mlp import expert_mlp_ref
from crisp_kernels.format import pack_layer

FP32_TOL = 1e-5
BF16_TOL = 2 * 2.0**-8
# The int4pack layout's block on this machine (64 with AVX-512, 32 with AVX2): the widths and
# starts below sit on its boundaries.
BLOCK_N = int4pack_layout().block_n

# (H, I, group, symmetric): odd intermediate sizes (not multiples of 64), every group size.
SHAPES = [(256, 200, 64, False), (256, 130, 32, True), (384, 300, 128, False)]
# I > GATE_UP_CHUNK and > DEFAULT_CHUNK, for the chunk boundaries.
BIG = (128, GATE_UP_CHUNK + 76, 64, False)


@functools.cache
def expert(hidden, inter, group, symmetric, seed=0) -> PackedExpert:
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(inter, hidden, generator=gen) / hidden**0.5
    up = torch.randn(inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(hidden, inter, generator=gen) / inter**0.5
    return pack_expert(gate, up, down, QuantFormat(group_size=group, symmetric=symmetric))


@functools.cache
def prepared(hidden, inter, group, symmetric) -> CpuExpert:
    return prepare_expert(expert(hidden, inter, group, symmetric))


def inputs(tokens, hidden, dtype, width, per_token, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(dtype)  # bf16 values
    weights = torch.rand(tokens, generator=gen) + 0.1
    widths = None
    if per_token:
        widths = torch.randint(0, width + 2, (tokens,), generator=gen)  # > width is clamped
        widths[0] = width
    return x, weights, widths


def run(x, packed, widths, width, weights, config=DEFAULT_CONFIG):
    out = torch.zeros(x.shape, dtype=torch.float32)
    expert_mlp_cpu_accumulate_(x, packed, widths, width, weights, out, config=config)
    return out


# The paths under test: the torch paths by precision (int4pack for BF16 on a prepared expert, the
# dequant path otherwise: the choice made without the native kernel) and the native kernel, fp32
# whatever the precision asked, so held to the fp32 tolerance.
NATIVE = "native"
PATHS = [Precision.FP32, Precision.BF16, NATIVE]


def config_of(path, packed) -> CpuExpertConfig:
    if path == NATIVE:
        return CpuExpertConfig(impl=CpuImpl.NATIVE_FP32)
    torch_impl = (CpuImpl.INT4PACK_BF16 if path is Precision.BF16 and isinstance(packed, CpuExpert)
                  else CpuImpl.DEQUANT_FP32)
    return CpuExpertConfig(path, impl=torch_impl)


def tol_of(path) -> float:
    return FP32_TOL if path in (NATIVE, Precision.FP32) else BF16_TOL


def test_tolerances_are_the_kernels():
    assert tolerance(Precision.FP32) == FP32_TOL and tolerance(Precision.BF16) == BF16_TOL


def _widths(inter):
    return sorted({0, 1, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, inter - 1, inter})


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("precision", PATHS)
@pytest.mark.parametrize("kind", ["prepared", "host"])
def test_equals_reference(shape, tokens, precision, kind):
    packed = prepared(*shape) if kind == "prepared" else expert(*shape)
    tol = tol_of(precision)
    for dtype in (torch.float32, torch.bfloat16):
        for width in _widths(shape[1]):
            for per_token in (False, True):
                x, weights, widths = inputs(tokens, shape[0], dtype, width, per_token)
                err = reference_check(x, packed, widths, width, weights, config_of(precision, packed))
                assert err <= tol, f"{dtype} width {width} per_token {per_token}: {err:.3e} > {tol:.1e}"


@pytest.mark.parametrize("width", [DEFAULT_CHUNK - 1, DEFAULT_CHUNK + 1, GATE_UP_CHUNK - 1, GATE_UP_CHUNK,
                                   GATE_UP_CHUNK + 1, BIG[1]])
@pytest.mark.parametrize("precision", PATHS)
def test_chunk_boundaries(width, precision):
    x, weights, widths = inputs(3, BIG[0], torch.float32, width, per_token=True)
    err = reference_check(x, prepared(*BIG), widths, width, weights, config_of(precision, prepared(*BIG)))
    assert err <= tol_of(precision), f"{err:.3e}"


def test_width_zero_and_zero_token_widths_add_nothing():
    shape = SHAPES[0]
    x, weights, _ = inputs(3, shape[0], torch.bfloat16, 0, False)
    out = torch.ones(3, shape[0])
    expert_mlp_cpu_accumulate_(x, prepared(*shape), None, 0, weights, out)
    assert torch.equal(out, torch.ones(3, shape[0]))
    out2 = run(x, prepared(*shape), torch.zeros(3, dtype=torch.int64), shape[1], weights)
    assert torch.count_nonzero(out2) == 0


def test_accumulates_into_out():
    shape = SHAPES[0]
    x, weights, widths = inputs(3, shape[0], torch.bfloat16, 128, True)
    once = run(x, prepared(*shape), widths, 128, weights)
    out = torch.full((3, shape[0]), 0.5)
    expert_mlp_cpu_accumulate_(x, prepared(*shape), widths, 128, weights, out)
    assert torch.allclose(out, once + 0.5, rtol=0, atol=1e-6)


def _poison_host(packed: PackedExpert, width: int) -> PackedExpert:
    q, s = packed.qweight.clone(), packed.scales.clone()
    q[width:] = 0xA5
    s[width:] = float("nan")
    z = None if packed.zeros is None else packed.zeros.clone()
    if z is not None:
        z[width:] = 15
    return PackedExpert(packed.fmt, q, s, z)


def _poison_prepared(ce: CpuExpert, width: int) -> CpuExpert:
    blocked = width // BLOCK_N * BLOCK_N
    gate_up = ce.gate_up.clone()
    gate_up[2 * blocked:] = 0xA5
    sz = []
    for i, t in enumerate(ce.gate_up_sz):
        t = t.clone()
        t[:, max(0, 2 * (blocked - i * GATE_UP_CHUNK)):] = float("nan")
        sz.append(t)
    down = ce.down.clone()
    down[:, ce.down_rows * blocked // 2:] = 0xA5
    scales = ce.down_scales.clone()
    scales[:, blocked:] = float("nan")
    zero = None if ce.down_zero is None else ce.down_zero.clone()
    if zero is not None:
        zero[:, blocked:] = float("nan")
    return CpuExpert(_poison_host(ce.packed, width), gate_up, tuple(sz), down, scales, zero, ce.block_n)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], BIG])
@pytest.mark.parametrize("width", [0, 1, BLOCK_N, BLOCK_N + 1, 2 * BLOCK_N - 1])
@pytest.mark.parametrize("precision", PATHS)
def test_rows_past_width_are_never_read(shape, width, precision):
    clean = prepared(*shape)
    poisoned = _poison_prepared(clean, width)
    x, weights, widths = inputs(3, shape[0], torch.bfloat16, width, True)
    config = config_of(precision, clean)
    want = run(x, clean, widths, width, weights, config)
    got = run(x, poisoned, widths, width, weights, config)
    assert torch.equal(got, want)
    if width:
        assert torch.count_nonzero(want) > 0
        # The poison is live: one more row reaches it.
        assert not torch.isfinite(run(x, poisoned, None, width + 1, weights, config)).all()


def test_int4pack_layout_prefixes():
    """The layout facts the fast path relies on (torch's CPU int4pack), for the probed block B: a
    prefix of B n rows and a K range of a B-row matrix are byte ranges of the converted matrix,
    checked on other shapes than the probe's."""
    assert BLOCK_N in BLOCK_N_CANDIDATES
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (3 * BLOCK_N, 512), generator=gen, dtype=torch.uint8)
    full = _int4pack(q)
    for rows in (BLOCK_N, 2 * BLOCK_N):
        assert torch.equal(_int4pack(q[:rows]), full[:rows])
    block = _int4pack(q[:BLOCK_N]).flatten()
    for k0, k1 in ((0, 64), (0, 128), (0, 448), (32, 448), (64, 512), (128, 160)):
        assert torch.equal(_int4pack(q[:BLOCK_N, k0:k1]).flatten(), block[BLOCK_N * k0 // 2: BLOCK_N * k1 // 2])


def test_int4pack_layout_refuses_an_unknown_layout(monkeypatch):
    """A layout with none of the candidate blocks (here: rows stored in reverse) is refused with
    Int4PackUnsupported, never used: a wrong block gave relative errors of ~1.0."""
    import crisp_kernels.cpu_expert as cpu_expert

    real = cpu_expert._int4pack
    monkeypatch.setattr(cpu_expert, "_int4pack", lambda q: real(q.flip(0)).flip(0))
    with pytest.raises(Int4PackUnsupported, match="row blocks"):
        int4pack_layout()
    with pytest.raises(Int4PackUnsupported):
        prepare_expert(expert(*SHAPES[0]))


def test_a_wrong_block_is_caught_by_the_reference():
    """The probe matters: a candidate block larger than this machine's gives a wrong fast path at
    prefixes (the failure seen on an AVX2 host with 64 assumed: ~1.0), so the equality tests above
    can fail. At full width the slicing is the identity and any block is right. Group 128, so that the
    down pass slices whole candidate-row blocks (at g 64 a 128 block slices 64-row ones, right on an
    AVX-512 host's 64 layout). A smaller candidate than the machine's is not asserted: on an AVX-512
    host (block 64) block 32 computes right results, although the probe's byte checks refuse it."""
    larger = [b for b in BLOCK_N_CANDIDATES if b > BLOCK_N]
    if not larger:
        pytest.skip(f"this machine's int4pack block ({BLOCK_N}) is the largest candidate")
    shape = (256, 4 * max(BLOCK_N_CANDIDATES), 128, False)
    width = 3 * max(BLOCK_N_CANDIDATES)  # a prefix on every candidate's block boundary
    x, weights, _ = inputs(1, shape[0], torch.bfloat16, shape[1], False)
    int4pack = CpuExpertConfig(impl=CpuImpl.INT4PACK_BF16)
    assert reference_check(x, prepare_expert(expert(*shape), Int4PackLayout(BLOCK_N)), None, width,
                           weights, int4pack) <= BF16_TOL
    for other in larger:
        wrong = prepare_expert(expert(*shape), Int4PackLayout(other))
        assert reference_check(x, wrong, None, width, weights, int4pack) > 10 * BF16_TOL
        assert reference_check(x, wrong, None, shape[1], weights, int4pack) <= BF16_TOL


def test_prepare_layer_and_info():
    shape = SHAPES[0]
    hidden, inter, group, _ = shape
    gen = torch.Generator().manual_seed(4)
    layer = pack_layer(torch.randn(2, 2 * inter, hidden, generator=gen) / 16,
                       torch.randn(2, hidden, inter, generator=gen) / 16, QuantFormat(group_size=group))
    prep = cpu_expert_prepare(layer)
    blocked = inter // BLOCK_N * BLOCK_N
    # int4pack weights (3 Ib H / 2) + bf16 (scale, zero term) per group of each gate/up row
    # + the down scales (fp16) and zero terms (fp32) per group of each down column.
    want = 3 * blocked * hidden // 2 + 2 * blocked * (hidden // group) * 2 * 2 + blocked * (hidden // group) * 6
    assert prep.expert(1).nbytes == want and prep.nbytes == 2 * want
    x, weights, widths = inputs(2, hidden, torch.bfloat16, inter, True)
    out = run(x, prep.expert(1), widths, inter, weights, config_of(Precision.BF16, prep.expert(1)))
    ref = expert_mlp_ref(x, layer.expert(1), inter, token_widths=widths, compute_dtype=torch.float64)
    ref = ref * weights.double().unsqueeze(1)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= BF16_TOL
    # the default takes the native kernel (it builds on this machine: a C compiler is part of the kind)
    assert kernel_info(prep.expert(0), torch.bfloat16).impl is CpuImpl.NATIVE_FP32
    assert kernel_info(layer.expert(0), torch.float32) == CpuKernelInfo(CpuImpl.NATIVE_FP32, 0)
    torch_only = CpuExpertConfig(impl=CpuImpl.INT4PACK_BF16)
    assert kernel_info(prep.expert(0), torch.bfloat16, torch_only) == CpuKernelInfo(CpuImpl.INT4PACK_BF16, want)
    with pytest.raises(ValueError, match="pass prepare_expert"):
        kernel_info(layer.expert(0), torch.bfloat16, torch_only)


def test_without_the_native_kernel_the_torch_paths_are_chosen(monkeypatch):
    """Where the native kernel cannot build, the default falls back to the earlier choice: int4pack
    for bf16 on a prepared expert, the dequant path otherwise; asking for it explicitly is refused."""
    from crisp_kernels import cpu_native

    monkeypatch.setattr(cpu_native, "available", lambda: False)

    def unavailable():
        raise cpu_native.NativeUnavailable("no C compiler found")

    monkeypatch.setattr(cpu_native, "load", unavailable)
    shape = SHAPES[0]
    assert kernel_info(prepared(*shape), torch.bfloat16).impl is CpuImpl.INT4PACK_BF16
    assert kernel_info(prepared(*shape), torch.float32).impl is CpuImpl.DEQUANT_FP32
    assert kernel_info(expert(*shape), torch.bfloat16).impl is CpuImpl.DEQUANT_FP32
    x, weights, widths = inputs(3, shape[0], torch.bfloat16, shape[1], True)
    assert reference_check(x, prepared(*shape), widths, shape[1], weights) <= BF16_TOL
    with pytest.raises(cpu_native.NativeUnavailable, match="no C compiler"):
        run(x, expert(*shape), widths, shape[1], weights, CpuExpertConfig(impl=CpuImpl.NATIVE_FP32))


def test_runs_on_a_worker_thread():
    shape = SHAPES[2]
    x, weights, widths = inputs(4, shape[0], torch.bfloat16, shape[1], True)
    want = run(x, prepared(*shape), widths, shape[1], weights)
    outs = [torch.zeros(4, shape[0]) for _ in range(2)]
    threads = [threading.Thread(target=expert_mlp_cpu_accumulate_,
                                args=(x, prepared(*shape), widths, shape[1], weights, o)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in outs:
        assert torch.equal(o, want)


@pytest.mark.parametrize("case, match", [
    ("x_fp16", "x: expected fp32 or bf16"),
    ("out_bf16", "out: expected a contiguous float32"),
    ("out_shape", "out: expected a contiguous float32"),
    ("weights_int", "weights: expected dtype"),
    ("weights_len", r"weights: expected shape \(3,\)"),
    ("widths_float", "token_widths: expected dtype"),
    ("width_big", "out of range"),
    ("config", "config: expected a CpuExpertConfig"),
])
def test_bad_arguments(case, match):
    shape = SHAPES[0]
    hidden, inter = shape[0], shape[1]
    x, weights, _ = inputs(3, hidden, torch.bfloat16, inter, False)
    args = dict(x=x, packed=prepared(*shape), token_widths=None, width=inter, weights=weights,
                out=torch.zeros(3, hidden))
    kw = {}
    if case == "x_fp16":
        args["x"] = x.half()
    elif case == "out_bf16":
        args["out"] = args["out"].bfloat16()
    elif case == "out_shape":
        args["out"] = torch.zeros(2, hidden)
    elif case == "weights_int":
        args["weights"] = torch.ones(3, dtype=torch.int64)
    elif case == "weights_len":
        args["weights"] = torch.ones(2)
    elif case == "widths_float":
        args["token_widths"] = torch.ones(3)
    elif case == "width_big":
        args["width"] = inter + 1
    elif case == "config":
        kw["config"] = "bf16"
    with pytest.raises((ValueError, TypeError), match=match):
        expert_mlp_cpu_accumulate_(**args, **kw)


def test_config_checks():
    with pytest.raises(ValueError, match="chunk"):
        CpuExpertConfig(chunk=0)
    with pytest.raises(TypeError, match="precision"):
        CpuExpertConfig(precision="bf16")


# ----------------------------------------------------------------------------- row ranges (neuron split)


def _starts(width):
    """Split points: 0, 1, block - 1, block, block + 1, a block boundary past a gate/up chunk's
    start, width - 1 and width (nothing left), those in [0, width]."""
    return sorted({s for s in (0, 1, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, 3 * BLOCK_N + 5, width - 1, width)
                   if 0 <= s <= width})


@pytest.mark.parametrize("shape", [*SHAPES, BIG])
@pytest.mark.parametrize("precision", PATHS)
@pytest.mark.parametrize("kind", ["prepared", "host"])
def test_row_range_equals_reference(shape, precision, kind):
    """Rows [row_start, width) against the float64 expert at width minus at row_start, for odd
    shapes, starts inside and on 64-blocks, full and partial widths, per-token widths."""
    packed = prepared(*shape) if kind == "prepared" else expert(*shape)
    tol = tol_of(precision)
    for width in sorted({shape[1], shape[1] - 1, 2 * BLOCK_N + 3} & set(range(1, shape[1] + 1))):
        for start in _starts(width):
            for per_token in (False, True):
                x, weights, widths = inputs(3, shape[0], torch.bfloat16, width, per_token)
                if start == width:
                    assert torch.count_nonzero(run_range(x, packed, widths, width, weights, start, precision)) == 0
                    continue
                err = reference_check(x, packed, widths, width, weights, config_of(precision, packed),
                                      row_start=start)
                assert err <= tol, f"width {width} start {start} per_token {per_token}: {err:.3e} > {tol:.1e}"


def run_range(x, packed, widths, width, weights, start, precision):
    out = torch.zeros(x.shape, dtype=torch.float32)
    expert_mlp_cpu_accumulate_(x, packed, widths, width, weights, out, config=config_of(precision, packed),
                               row_start=start)
    return out


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], BIG])
@pytest.mark.parametrize("precision", PATHS)
def test_split_equals_unsplit(shape, precision):
    """rows [0, s) + rows [s, k) is the expert at k (a split is exact up to the summation order):
    fp32 within 1e-5 of the unsplit output; bf16 within 2u (the op rounds each call's down sum)."""
    packed = prepared(*shape)
    width = shape[1]
    x, weights, widths = inputs(4, shape[0], torch.bfloat16, width, per_token=True)
    whole = run(x, packed, widths, width, weights, config_of(precision, packed))
    for s in _starts(width):
        head = run(x, packed, widths, s, weights, config_of(precision, packed))
        tail = run_range(x, packed, widths, width, weights, s, precision)
        err = ((head + tail - whole).norm() / whole.norm()).item()
        assert err <= tol_of(precision), f"split at {s}: {err:.3e}"


def _poison_before(ce: CpuExpert, start: int) -> CpuExpert:
    """NaN / garbage in the host rows below ``start`` and in the int4pack blocks below the first
    64-block at or past it (rows [floor64(start), start) of the copy are not read either: they run
    from the host rows)."""
    b0 = -(-start // BLOCK_N) * BLOCK_N
    q, s = ce.packed.qweight.clone(), ce.packed.scales.clone()
    q[:start] = 0xA5
    s[:start] = float("nan")
    z = None if ce.packed.zeros is None else ce.packed.zeros.clone()
    if z is not None:
        z[:start] = 15
    gate_up = ce.gate_up.clone()
    gate_up[: 2 * b0] = 0xA5
    sz = []
    for i, t in enumerate(ce.gate_up_sz):
        t = t.clone()
        t[:, : max(0, 2 * (b0 - i * GATE_UP_CHUNK))] = float("nan")
        sz.append(t)
    down = ce.down.clone()
    down[:, : ce.down_rows * b0 // 2] = 0xA5
    scales = ce.down_scales.clone()
    scales[:, :b0] = float("nan")
    zero = None if ce.down_zero is None else ce.down_zero.clone()
    if zero is not None:
        zero[:, :b0] = float("nan")
    return CpuExpert(PackedExpert(ce.packed.fmt, q, s, z), gate_up, tuple(sz), down, scales, zero, ce.block_n)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], BIG])
@pytest.mark.parametrize("start", [1, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, 2 * BLOCK_N])
@pytest.mark.parametrize("precision", PATHS)
def test_rows_before_start_are_never_read(shape, start, precision):
    clean = prepared(*shape)
    poisoned = _poison_before(clean, start)
    width = shape[1]
    x, weights, widths = inputs(3, shape[0], torch.bfloat16, width, True)
    want = run_range(x, clean, widths, width, weights, start, precision)
    assert torch.equal(run_range(x, poisoned, widths, width, weights, start, precision), want)
    assert torch.count_nonzero(want) > 0
    # The poison is live: one row earlier reaches it.
    assert not torch.isfinite(run_range(x, poisoned, None, width, weights, start - 1, precision)).all()


@pytest.mark.parametrize("start", [-1, 201, True, 1.0])
def test_bad_row_start(start):
    shape = SHAPES[0]
    x, weights, _ = inputs(3, shape[0], torch.bfloat16, shape[1], False)
    with pytest.raises(ValueError, match="row_start: expected an int in"):
        expert_mlp_cpu_accumulate_(x, prepared(*shape), None, shape[1], weights, torch.zeros(3, shape[0]),
                                   row_start=start)
