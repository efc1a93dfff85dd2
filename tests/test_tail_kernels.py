"""The 2-bit tail kernels (crisp_kernels/expert_mlp_tail_triton.py) against their float64 reference.

On a CPU-only machine the kernels run in Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported); with ``CRISP_TEST_DEVICES=cuda`` and
``TRITON_INTERPRET=0`` the kernel tests run compiled on a GPU. The reference itself is checked
against a per-neuron float64 loop over the unpacked codes (``dense_tail``), so a wrong bit order or
group index cannot agree with itself.

Error metric: ``||d - d_ref|| / ||d_ref||`` on what a call adds to ``out`` (d = out - out0), the
reference computed in float64. Tolerances:

- 1e-5 for every interpreter case and every compiled decode case: the dequantized weights are
  exact in fp32 (``(code - zero) * scale`` with code, zero <= 3 and an fp16 scale needs at most
  13 significant bits, and so do both terms of the fma), so the only error is fp32 accumulation
  over H (stage 1) and width (stage 2) plus the fp32 intermediate: measured 1e-7..3e-7 here.
- compiled prefill with fp16 / bf16 activations: ``2u`` of that dtype (fp16 9.8e-4, bf16 7.8e-3),
  as tests/test_expert_mlp.py: the tl.dot operands (dequantized weights, the fp32 intermediate)
  are rounded to the activation dtype, each a relative error of at most u.
"""

import functools

import pytest
import torch

pytest.importorskip("triton")

import crisp_kernels.expert_mlp_tail_triton as tail  # noqa: E402
from crisp_kernels.expert_mlp_tail_triton import (  # noqa: E402
    TAIL_DECODE_CONFIGS,
    TAIL_DECODE_MAX_TOKENS,
    TAIL_PREFILL_CONFIGS,
    make_tail_plan,
    select_tail_config,
    select_tail_plan,
    tail_mlp_accumulate_ref_,
    tail_mlp_accumulate_triton_,
)

FP32_TOL = 1e-5
HALF_TOL = {torch.float16: 2 * 2.0**-11, torch.bfloat16: 2 * 2.0**-8}
N_SMALL = 70  # neurons of most cases: > the prefill block_n (64), not a multiple of any block
DECODE_BN = TAIL_DECODE_CONFIGS[1].block_n  # 16
DECODE_BJ = TAIL_DECODE_CONFIGS[1].block_j  # 32
PREFILL_BN = TAIL_PREFILL_CONFIGS[64].block_n  # 64
PREFILL_BJ = TAIL_PREFILL_CONFIGS[64].block_j  # 32


# ----------------------------------------------------------------------------- helpers


def pack_crumbs_local(codes: torch.Tensor) -> torch.Tensor:
    """(..., H) codes in [0, 3] -> (..., H/4) uint8: element 4b + i in bits [2i, 2i + 2) of byte b."""
    c = codes.to(torch.uint8)
    return c[..., 0::4] | (c[..., 1::4] << 2) | (c[..., 2::4] << 4) | (c[..., 3::4] << 6)


@functools.cache
def _cpu_tail(n: int, hidden: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4, (n, 3, hidden), generator=gen)
    zeros = torch.randint(0, 4, (n, 3, hidden // group), generator=gen).to(torch.uint8)
    scales = (0.01 + 0.09 * torch.rand(n, 3, hidden // group, generator=gen)).to(torch.float16)
    return codes, pack_crumbs_local(codes), scales, zeros


def make_tail(device, n=N_SMALL, hidden=256, group=128, seed=0):
    """(q2, s2, z2) on ``device`` and the (N, 3, H) codes they pack (on the CPU)."""
    codes, q2, s2, z2 = _cpu_tail(n, hidden, group, seed)
    return (q2.to(device), s2.to(device), z2.to(device)), codes


def make_x(num_tokens, hidden, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)


def tol_for(x_dtype, device, num_tokens) -> float:
    if device.type == "cuda" and num_tokens > TAIL_DECODE_MAX_TOKENS and x_dtype != torch.float32:
        return HALF_TOL[x_dtype]
    return FP32_TOL


def run_both(out0, x, tensors, group, width, rows=None, weights=None, token_widths=None, plan=None):
    """The kernel's result (fp32) and the reference's (float64), both from ``out0``."""
    out = out0.clone()
    tail_mlp_accumulate_triton_(out, x, *tensors, group, width, rows, weights, token_widths, plan=plan)
    ref = out0.double()
    tail_mlp_accumulate_ref_(ref, x, *tensors, group, width, rows, weights, token_widths)
    return out, ref


def check_close(out, ref, out0, tol):
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    added, added_ref = out.double() - out0.double(), ref - out0.double()
    if added_ref.abs().max() == 0:
        assert torch.equal(out, out0), "the reference adds nothing, the kernel changed out"
        return
    err = ((added - added_ref).norm() / added_ref.norm()).item()
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


def dense_tail(x, codes, s2, z2, group, width, rows=None, weights=None, token_widths=None):
    """An independent float64 computation of what a call adds to out: one neuron at a time."""
    x, s2, z2 = x.double().cpu(), s2.double().cpu(), z2.double().cpu()
    idx = list(range(x.shape[0])) if rows is None else rows.tolist()
    added = torch.zeros(x.shape[0] if rows is None else max(idx) + 1, x.shape[1], dtype=torch.float64)
    for t, r in enumerate(idx):
        used = width if token_widths is None else min(width, int(token_widths[t]))
        for j in range(max(used, 0)):
            w = [(codes[j, p].double() - z2[j, p].repeat_interleave(group)) * s2[j, p].repeat_interleave(group)
                 for p in range(3)]
            g, u = float(x[r] @ w[0]), float(x[r] @ w[1])
            h = g / (1.0 + torch.exp(torch.tensor(-g, dtype=torch.float64)).item()) * u
            added[r] += (1.0 if weights is None else float(weights[t])) * h * w[2]
    return added


@pytest.fixture
def dev(device, kernel_backend):
    """A device the kernels run on: CUDA compiled, or the CPU under TRITON_INTERPRET=1 (else skipped)."""
    return device


# ----------------------------------------------------------------------------- layout and reference


def test_local_packing_layout_is_the_formats():
    """The tests' own packing helper (independent of the product's) against format.pack_crumbs / unpack_crumbs."""
    from crisp_kernels.format import pack_crumbs, unpack_crumbs

    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]])
    # byte 0: 1 | 2 << 2 | 3 << 4 | 0 << 6 = 57; byte 1: 3 | 3 << 2 | 0 << 4 | 1 << 6 = 79
    assert pack_crumbs_local(codes).tolist() == [[57, 79]]
    rand = torch.randint(0, 4, (4, 3, 128))
    assert torch.equal(pack_crumbs(rand.to(torch.uint8)), pack_crumbs_local(rand).to(torch.uint8))
    assert torch.equal(unpack_crumbs(pack_crumbs_local(rand)).to(torch.int64), rand)


@pytest.mark.parametrize("case", ["plain", "rows-weights-widths"])
def test_reference_matches_dense_loop(case):
    (q2, s2, z2), codes = make_tail("cpu", n=12, hidden=128, group=64)
    x = make_x(6, 128, torch.float32, "cpu")
    rows = weights = tw = None
    if case != "plain":
        rows = torch.tensor([4, 0, 4, 2])
        weights = torch.tensor([0.5, -1.0, 2.0, 0.25])
        tw = torch.tensor([3, 0, 99, -2])
    out = torch.zeros(6, 128, dtype=torch.float64)
    tail_mlp_accumulate_ref_(out, x, q2, s2, z2, 64, 9, rows, weights, tw)
    expected = dense_tail(x, codes, s2, z2, 64, 9, rows, weights, tw)
    torch.testing.assert_close(out[: expected.shape[0]], expected, rtol=1e-12, atol=1e-12)
    assert out.abs().max() > 0


# ----------------------------------------------------------------------------- kernels vs reference


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16, 17, 33])
def test_token_counts(dev, num_tokens):
    (q2, s2, z2), _ = make_tail(dev)
    x = make_x(num_tokens, 256, torch.float32, dev)
    out0 = torch.zeros(num_tokens, 256, device=dev)
    expected_path = "decode" if num_tokens <= TAIL_DECODE_MAX_TOKENS else "prefill"
    assert select_tail_config(num_tokens).path == expected_path
    out, ref = run_both(out0, x, (q2, s2, z2), 128, N_SMALL)
    check_close(out, ref, out0, tol_for(x.dtype, dev, num_tokens))


HIDDEN_GROUPS = [(h, g) for h in (128, 256, 512) for g in (64, 128, 256) if h % g == 0]
# GT = 32 and 96: groups smaller than a decode step, and (96: 24 bytes) groups that are not a power of two,
# so that steps straddle groups: the per-byte scale path of every stage.
HIDDEN_GROUPS += [(128, 32), (384, 96)]


@pytest.mark.parametrize("num_tokens", [1, 17])
@pytest.mark.parametrize("hidden,group", HIDDEN_GROUPS)
def test_hidden_and_group_sizes(dev, hidden, group, num_tokens):
    (q2, s2, z2), _ = make_tail(dev, n=40, hidden=hidden, group=group)
    x = make_x(num_tokens, hidden, torch.float32, dev)
    out0 = torch.zeros(num_tokens, hidden, device=dev)
    out, ref = run_both(out0, x, (q2, s2, z2), group, 37)
    check_close(out, ref, out0, tol_for(x.dtype, dev, num_tokens))


@pytest.mark.parametrize("num_tokens", [2, 33])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_activation_dtypes(dev, dtype, num_tokens):
    (q2, s2, z2), _ = make_tail(dev)
    x = make_x(num_tokens, 256, dtype, dev)
    out0 = torch.zeros(num_tokens, 256, device=dev)
    out, ref = run_both(out0, x, (q2, s2, z2), 128, N_SMALL)
    check_close(out, ref, out0, tol_for(dtype, dev, num_tokens))


_DECODE_WIDTHS = sorted({0, 1, DECODE_BN - 1, DECODE_BN, DECODE_BN + 1, DECODE_BJ - 1, DECODE_BJ, DECODE_BJ + 1,
                         N_SMALL})
_PREFILL_WIDTHS = sorted({0, 1, PREFILL_BJ - 1, PREFILL_BJ, PREFILL_BJ + 1, PREFILL_BN - 1, PREFILL_BN, PREFILL_BN + 1,
                          N_SMALL})


@pytest.mark.parametrize(
    "num_tokens,width", [(1, w) for w in _DECODE_WIDTHS] + [(5, 17)] + [(33, w) for w in _PREFILL_WIDTHS]
)
def test_widths(dev, num_tokens, width):
    (q2, s2, z2), _ = make_tail(dev, hidden=128, group=64)
    x = make_x(num_tokens, 128, torch.float32, dev)
    out0 = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(3)).to(dev)
    out, ref = run_both(out0, x, (q2, s2, z2), 64, width)
    if width == 0:
        assert torch.equal(out, out0)
    check_close(out, ref, out0, tol_for(x.dtype, dev, num_tokens))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens", [5, 33])
def test_rows_weights_strided_x(dev, num_tokens, index_dtype):
    """Repeated rows add up (atomics), weights scale, x rows are strided, rows of x not gathered are not read,
    rows of out not addressed keep their exact values, and out is added to, not overwritten."""
    hidden, tx, no = 256, 40, 45
    (q2, s2, z2), _ = make_tail(dev, hidden=hidden, group=64)
    gen = torch.Generator().manual_seed(7)
    rows = torch.randint(0, tx // 2, (num_tokens,), generator=gen)
    rows[1] = rows[0]  # a repeat for sure
    weights = torch.rand(num_tokens, generator=gen) * 2 - 0.5
    wide = torch.full((tx, hidden + 24), float("nan"))  # row stride hidden + 24; NaN where nothing may be read
    wide[: tx // 2, :hidden] = torch.randn(tx // 2, hidden, generator=gen)
    x = wide.to(dev)[:, :hidden]
    assert x.stride(0) == hidden + 24
    out0 = torch.randn(no, hidden, generator=gen).to(dev)
    rows_d, weights_d = rows.to(index_dtype).to(dev), weights.to(dev)
    out, ref = run_both(out0, x, (q2, s2, z2), 64, N_SMALL, rows_d, weights_d)
    untouched = torch.ones(no, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(out[untouched.to(dev)], out0[untouched.to(dev)])
    check_close(out, ref, out0, tol_for(x.dtype, dev, num_tokens))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens", [5, 33])
def test_token_widths(dev, num_tokens, index_dtype):
    """Widths 0, negative (nothing), above width (clamped), and in between; each token's own row."""
    (q2, s2, z2), _ = make_tail(dev, hidden=128, group=64)
    width = 50
    pattern = [0, -3, width + 100, 1, 17, width, 2**31 - 1, -(2**31), 33]
    tw = torch.tensor((pattern * 4)[:num_tokens]).to(index_dtype)
    x = make_x(num_tokens, 128, torch.float32, dev)
    out0 = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(5)).to(dev)
    out, ref = run_both(out0, x, (q2, s2, z2), 64, width, token_widths=tw.to(dev))
    check_close(out, ref, out0, tol_for(x.dtype, dev, num_tokens))
    nothing = (tw <= 0).to(dev)
    assert nothing.any()
    assert torch.equal(out[nothing], out0[nothing])
    full = (tw >= width).to(dev)  # clamped: the same as without token widths
    out_all = out0.clone()
    tail_mlp_accumulate_triton_(out_all, x, q2, s2, z2, 64, width, None, None, None)
    torch.testing.assert_close(out[full], out_all[full], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("width", [1, 17, 40])
def test_never_reads_past_width(dev, num_tokens, width):
    """Neurons >= width hold NaN scales, 0xFF codes and zeros: the full tensors and a prefix view must give
    exactly the result of a clean copy of the prefix (finite, equal to the reference)."""
    hidden, group = 128, 64
    (q2, s2, z2), _ = make_tail(dev, hidden=hidden, group=group)
    pq, ps, pz = q2.clone(), s2.clone(), z2.clone()
    pq[width:] = 0xFF
    ps[width:] = float("nan")
    pz[width:] = 0xFF
    clean = (q2[:width].clone(), s2[:width].clone(), z2[:width].clone())
    x = make_x(num_tokens, hidden, torch.float32, dev)
    out0 = torch.zeros(num_tokens, hidden, device=dev)
    out_clean, ref = run_both(out0, x, clean, group, width)
    check_close(out_clean, ref, out0, tol_for(x.dtype, dev, num_tokens))
    for tensors in ((pq, ps, pz), (pq[:width], ps[:width], pz[:width])):
        out = out0.clone()
        tail_mlp_accumulate_triton_(out, x, *tensors, group, width, None, None, None)
        assert torch.isfinite(out).all()
        assert torch.equal(out, out_clean)


@pytest.mark.parametrize("group", [32, 128])  # 128: whole steps in one group (one scale per neuron); 32: not
@pytest.mark.parametrize("num_tokens,split", [(1, 1), (5, 2), (33, 1), (33, 2)])
def test_interpreter_loads_stay_in_prefix(dev, monkeypatch, num_tokens, split, group):
    """Every load the interpreter performs (mask on) of q2 / s2 / z2 lies in the first ``width`` neurons'
    bytes, also those whose values could not change the result (a load for a neuron whose h is never
    stored): on a GPU those would be reads past a resident prefix. CPU tensors are not copied by the
    interpreter, so the addresses are the tensors' own."""
    if dev.type != "cpu":
        pytest.skip("records the interpreter's loads")
    from triton.runtime import interpreter

    loaded = []
    real_load = interpreter.interpreter_builder.create_masked_load

    def recording_load(ptrs, mask, *args, **kwargs):
        loaded.append(ptrs.data[mask.data.astype(bool)].astype("uint64").ravel())
        return real_load(ptrs, mask, *args, **kwargs)

    monkeypatch.setattr(interpreter.interpreter_builder, "create_masked_load", recording_load)
    (q2, s2, z2), _ = make_tail(dev, hidden=128, group=group)
    width = 17
    x = make_x(num_tokens, 128, torch.float32, dev)
    out = torch.zeros(num_tokens, 128)
    plan = make_tail_plan(select_tail_config(num_tokens), width, split)
    tail_mlp_accumulate_triton_(out, x, q2, s2, z2, group, width, None, None, None, plan=plan)
    import numpy as np

    addrs = np.concatenate(loaded)
    for name, t in (("q2", q2), ("s2", s2), ("z2", z2)):
        base, row = t.data_ptr(), t[0].numel() * t.element_size()
        inside = (addrs >= base) & (addrs < base + t.numel() * t.element_size())
        assert (addrs[inside] < base + width * row).all(), f"{name}: a load past neuron {width}"
        assert (addrs[inside] >= base + (width - 1) * row).any(), f"{name}: neuron {width - 1} was never read"


@pytest.mark.parametrize("num_tokens,split", [(1, 2), (1, 3), (8, 2), (33, 2), (33, 3)])
def test_stage2_split(dev, num_tokens, split):
    (q2, s2, z2), _ = make_tail(dev, hidden=128, group=64)
    plan = make_tail_plan(select_tail_config(num_tokens), N_SMALL, split)
    assert plan.split == split
    x = make_x(num_tokens, 128, torch.float32, dev)
    out0 = torch.zeros(num_tokens, 128, device=dev)
    out, ref = run_both(out0, x, (q2, s2, z2), 64, N_SMALL, plan=plan)
    check_close(out, ref, out0, tol_for(x.dtype, dev, num_tokens))


def test_default_plan_splits_a_wide_tail(dev):
    """The one wide case: width 300 takes the default plan's split > 1 (stage 2 atomics between chunks)."""
    (q2, s2, z2), _ = make_tail(dev, n=300, hidden=128, group=64)
    x = make_x(2, 128, torch.float16, dev)
    assert select_tail_plan(2, 128, 300, dev).split > 1
    out0 = torch.zeros(2, 128, device=dev)
    out, ref = run_both(out0, x, (q2, s2, z2), 64, 300)
    check_close(out, ref, out0, tol_for(x.dtype, dev, 2))


@pytest.mark.parametrize("num_tokens", [1, 17])
def test_model_sized_hidden(dev, num_tokens):
    """H = 4096 (Mixtral's), GT = 128: many stage-1 steps and stage-2 programs per call."""
    (q2, s2, z2), _ = make_tail(dev, n=6, hidden=4096, group=128)
    x = make_x(num_tokens, 4096, torch.float16, dev)
    out0 = torch.zeros(num_tokens, 4096, device=dev)
    out, ref = run_both(out0, x, (q2, s2, z2), 128, 6)
    check_close(out, ref, out0, tol_for(x.dtype, dev, num_tokens))


def test_empty_calls_launch_nothing(dev, monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched")

    for name in ("_tail_gate_up_decode_kernel", "_tail_down_decode_kernel", "_tail_gate_up_prefill_kernel",
                 "_tail_down_prefill_kernel"):
        monkeypatch.setattr(tail, name, NoLaunch())
    (q2, s2, z2), _ = make_tail(dev, hidden=128, group=64)
    out0 = torch.randn(4, 128).to(dev)
    out = out0.clone()
    tail_mlp_accumulate_triton_(out, make_x(4, 128, torch.float32, dev), q2, s2, z2, 64, 0, None, None, None)
    tail_mlp_accumulate_triton_(out, make_x(0, 128, torch.float32, dev), q2, s2, z2, 64, 5, None, None, None)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    tail_mlp_accumulate_triton_(out, make_x(4, 128, torch.float32, dev), q2, s2, z2, 64, 5, empty, None, None)
    assert torch.equal(out, out0)
    with pytest.raises(AssertionError, match="launched"):  # the stub does catch a launch
        tail_mlp_accumulate_triton_(out, make_x(1, 128, torch.float32, dev), q2, s2, z2, 64, 5, None, None, None)


# ----------------------------------------------------------------------------- plans


def test_plans():
    cpu = torch.device("cpu")
    for t in (1, 2, 3, 5, 9, 16):
        cfg = select_tail_config(t)
        assert cfg.path == "decode" and cfg.block_t // 2 < t <= cfg.block_t  # padded to a power of two
    for t in (17, 32, 33, 1000):
        cfg = select_tail_config(t)
        assert cfg.path == "prefill" and min(cfg.block_t, cfg.block_n, cfg.block_k, cfg.block_j, cfg.block_h) >= 16
    for cfg in TAIL_DECODE_CONFIGS.values():  # the 4-bit kernels' element counts per program
        assert cfg.block_t * cfg.block_n * cfg.block_k * 4 <= 16384
    for width in (1, 31, 127, 128, 300, 1000, 4096):
        for t in (1, 16, 64):
            plan = select_tail_plan(t, 128, width, cpu)
            assert plan.chunk % plan.config.block_j == 0
            assert (plan.split - 1) * plan.chunk < width <= plan.split * plan.chunk
            assert plan.split == 1 or plan.chunk >= tail._MIN_SPLIT_NEURONS
    assert select_tail_plan(1, 128, 100, cpu).split == 1  # too narrow to split
    assert select_tail_plan(1, 128, 1024, cpu).split > 1


# ----------------------------------------------------------------------------- argument errors


def _good():
    (q2, s2, z2), _ = make_tail("cpu", n=8, hidden=128, group=64)
    return dict(out=torch.zeros(3, 128), x=torch.zeros(3, 128), q2=q2, s2=s2, z2=z2, group_size=64, width=8, rows=None,
                weights=None, token_widths=None)


BAD = {
    "x int dtype": (dict(x=torch.zeros(3, 128, dtype=torch.int32)), ValueError, "x: expected dtype"),
    "x 1-d": (dict(x=torch.zeros(128)), ValueError, "x: expected shape"),
    "x strided H": (dict(x=torch.zeros(128, 3).t()), ValueError, "x: the hidden dimension"),
    "H not multiple of 4": (dict(x=torch.zeros(3, 130), out=torch.zeros(3, 130)), ValueError, "multiple of 4"),
    "group does not divide H": (dict(group_size=96), ValueError, "group_size=96"),
    "group not multiple of 4": (dict(group_size=2), ValueError, "group_size=2"),
    "group bool": (dict(group_size=True), TypeError, "group_size"),
    "q2 dtype": (dict(q2=torch.zeros(8, 3, 32, dtype=torch.int8)), ValueError, "q2: expected dtype"),
    "q2 shape": (dict(q2=torch.zeros(8, 3, 64, dtype=torch.uint8)), ValueError, "q2: expected shape"),
    "q2 2-d": (dict(q2=torch.zeros(8, 96, dtype=torch.uint8)), ValueError, "q2: expected a tensor"),
    "q2 not contiguous": (dict(q2=torch.zeros(8, 32, 3, dtype=torch.uint8).transpose(1, 2)), ValueError,
                          "q2: must be contiguous"),
    "s2 dtype": (dict(s2=torch.zeros(8, 3, 2)), ValueError, "s2: expected dtype"),
    "s2 not contiguous": (dict(s2=torch.zeros(8, 2, 3, dtype=torch.float16).transpose(1, 2)), ValueError,
                          "s2: must be contiguous"),
    "z2 shape": (dict(z2=torch.zeros(7, 3, 2, dtype=torch.uint8)), ValueError, "z2: expected shape"),
    "width past N": (dict(width=9), ValueError, "width=9"),
    "width negative": (dict(width=-1), ValueError, "width=-1"),
    "width float": (dict(width=2.0), TypeError, "width"),
    "out fp16": (dict(out=torch.zeros(3, 128, dtype=torch.float16)), ValueError, "out: expected dtype"),
    "out wrong H": (dict(out=torch.zeros(3, 64)), ValueError, "out: expected shape"),
    "out too few rows": (dict(out=torch.zeros(2, 128)), ValueError, "out: rows=None"),
    "rows float": (dict(rows=torch.zeros(3)), ValueError, "rows: expected dtype"),
    "rows 2-d": (dict(rows=torch.zeros(3, 1, dtype=torch.int64)), ValueError, "rows: expected a tensor"),
    "rows strided": (dict(rows=torch.zeros(6, dtype=torch.int64)[::2]), ValueError, "rows: must be contiguous"),
    "weights fp16": (dict(weights=torch.ones(3, dtype=torch.float16)), ValueError, "weights: expected dtype"),
    "weights length": (dict(weights=torch.ones(4)), ValueError, "weights: expected shape"),
    "token_widths float": (dict(token_widths=torch.ones(3)), ValueError, "token_widths: expected dtype"),
    "token_widths length": (dict(token_widths=torch.ones(2, dtype=torch.int32)), ValueError,
                            "token_widths: expected shape"),
    "token_widths list": (dict(token_widths=[1, 2, 3]), TypeError, "token_widths"),
}


@pytest.mark.parametrize("fn", [tail_mlp_accumulate_triton_, tail_mlp_accumulate_ref_], ids=["triton", "ref"])
@pytest.mark.parametrize("case", list(BAD))
def test_argument_errors(fn, case):
    change, exc, message = BAD[case]
    args = _good() | change
    out_before = args["out"].clone()
    with pytest.raises(exc, match=message.replace("(", r"\(")):
        fn(**args)
    assert torch.equal(args["out"], out_before)


def test_good_arguments_pass_the_checks():
    """The base case of test_argument_errors is valid (so each error there is the one change's)."""
    args = _good()
    tail_mlp_accumulate_ref_(**args)
    assert args["out"].abs().max() == 0  # x is zero
