"""Triton kernels for one expert over the first k neurons of its packed 4-bit weights.

Two launches per expert call (the pure-torch reference beside them is ``expert_mlp_ref`` in
``expert_mlp.py``):

1. **gate/up** ``h[t, j] = silu(x_t . gate_j) * (x_t . up_j)`` for j < k (or gpt-oss's clamped
   SwiGLU on ``x_t . gate_j + bg_j`` / ``x_t . up_j + bu_j``: ``ACT``), masked to 0 where
   j >= token_widths[t]; one program per block of ``block_n`` neurons, looping over H. Both
   rows of a neuron sit side by side in row j of ``qweight``, so the program streams
   ``2 * block_n`` contiguous rows. Stored as an fp32 (T, k) intermediate.
2. **down** ``out[row_t, :] (+)= weight_t * sum_j h[t, j] * down_j`` over the same rows j < k;
   one program per block of ``block_h`` bytes of H (2 * block_h outputs) and per chunk of
   neurons (split-K over j, ``split`` chunks). With ``split == 1`` and a fresh output the
   result is stored (deterministic); otherwise it is added with fp32 atomics. An expert's down
   bias (gpt-oss) is added by the first chunk, to tokens of width >= 1.

Every weight load is masked on ``j < k``: a width-k call reads nothing past row k of
``qweight``, ``scales`` or ``zeros``, so it is safe on a resident prefix of exactly
``nbytes(k)`` bytes. ``k`` is a runtime argument (no recompile per width); H, the group size,
the symmetric flag and the block sizes are compile-time constants.

Dequantization: the byte ``b`` of row j holds elements 2b (low nibble) and 2b+1 (high nibble).
Rather than interleaving the two nibbles, the kernels split the activations into their even
and odd elements and reduce each half against its own nibble (stage 1), or write the even and
odd outputs with two strided stores (stage 2). ``(q - z) * s`` is folded to one fma per
element, ``q * s + (-z * s)``, with ``-z * s`` computed once per loaded scale.

Paths (``select_plan``):

- **decode** (T <= 16, memory-bound): GEMV in the spirit of GemLite's, with ``tl.sum``
  reductions over a (tokens, neurons, bytes) broadcast: each weight byte is read and
  dequantized once for all tokens of the call. The tokens are padded to a power of two
  (1, 2, 4, 8, 16, one compiled variant each) and the tile sizes shrink as it grows so the
  3-D product stays near 8K elements per program (registers). Stage 2 is split over
  neurons until the grid covers the GPU about twice.
- **prefill** (T > 16): ``tl.dot`` tiles (every block >= 16) on the x dtype (fp16/bf16, fp32
  accumulate; fp32 activations use IEEE fp32 dots, not TF32). Under Triton's CPU interpreter
  the dot operands are cast to fp32 (its bf16 dot is wrong).

Block sizes are fixed per path (no autotuning: it cannot run without a GPU and a fixed,
tested config is what the interpreter tests exercise); tune on hardware with ``crisp-bench kernels``.

What has been checked and run where, and the open tuning questions: docs/kernels.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ._triton import interpreter_enabled, tl, triton
from .format import SYMMETRIC_ZERO, ActivationKind, PackedExpert, tail_group_size
from .triton_shared import dot_acc, num_sms, operand_dtype, token_rows

# ----------------------------------------------------------------------------- constants

DECODE_MAX_TOKENS = 16  # T <= this takes the GEMV path, larger T the tl.dot path
# Stage 2 is split over neurons until it has about this many programs per SM ...
_PROGRAMS_PER_SM = 2
# ... but never into chunks of fewer neurons than this (each program must stream enough bytes
# to pay for its atomic epilogue).
_MIN_SPLIT_NEURONS = 64
_SYM_ZERO = tl.constexpr(SYMMETRIC_ZERO)  # the zero point of the symmetric format
_ACT_CODES = {ActivationKind.SILU_GLU: 0, ActivationKind.GPT_OSS_CLAMPED_SWIGLU: 1}  # the kernels' ACT constexpr


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes of one path. H is counted in packed bytes (2 elements per byte)."""

    path: str  # "decode" or "prefill"
    block_t: int  # tokens per program (decode: the padded token count)
    block_n: int  # stage 1: neurons per program
    block_k: int  # stage 1: bytes of H per loop step
    block_j: int  # stage 2: neurons per loop step
    block_h: int  # stage 2: bytes of H per program (2 * block_h outputs)
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class LaunchPlan:
    config: KernelConfig
    split: int  # stage 2 neuron chunks; > 1 means fp32 atomics
    chunk: int  # neurons per chunk (a multiple of block_j)


# Decode tiles by padded token count: block_t * block_n * block_k (stage 1) and
# block_t * block_j * block_h (stage 2) stay at or under 8K elements. Stage 2 keeps about four
# tile-sized tensors live (bytes, scales, the two dequantized halves), so its tiles are halved
# at T = 1 and 2: compiled for sm_90 with ptxas (tests/test_kernels_compile.py), 64x128 at T=1
# used 255 registers and spilled 56-88 bytes per thread, 32x128 uses 167; at T=2, 2x32x128 used
# 238-244 registers, 2x32x64 uses 128. Not yet timed on a GPU.
DECODE_CONFIGS = {
    1: KernelConfig("decode", 1, 16, 256, 32, 128),
    2: KernelConfig("decode", 2, 16, 128, 32, 64),
    4: KernelConfig("decode", 4, 16, 64, 16, 128),
    8: KernelConfig("decode", 8, 16, 32, 16, 64),
    16: KernelConfig("decode", 16, 16, 32, 16, 32),
}
PREFILL_CONFIGS = {
    32: KernelConfig("prefill", 32, 64, 32, 32, 64, num_warps=4, num_stages=3),
    64: KernelConfig("prefill", 64, 64, 32, 32, 64, num_warps=4, num_stages=3),
}


def select_config(num_tokens: int) -> KernelConfig:
    if num_tokens <= DECODE_MAX_TOKENS:
        return DECODE_CONFIGS[triton.next_power_of_2(max(num_tokens, 1))]
    return PREFILL_CONFIGS[32 if num_tokens <= 32 else 64]


def select_plan(num_tokens: int, hidden_size: int, width: int, device: torch.device) -> LaunchPlan:
    """The path, blocks and stage-2 split for one call (plain Python, no device work)."""
    cfg = select_config(num_tokens)
    programs = triton.cdiv(num_tokens, cfg.block_t) * triton.cdiv(hidden_size // 2, cfg.block_h)
    want = triton.cdiv(_PROGRAMS_PER_SM * num_sms(device), programs)
    split = max(1, min(want, width // _MIN_SPLIT_NEURONS))
    return make_plan(cfg, width, split)


def make_plan(cfg: KernelConfig, width: int, split: int) -> LaunchPlan:
    """A plan with about ``split`` chunks of whole ``block_j`` steps (tests force splits with it)."""
    chunk = triton.cdiv(triton.cdiv(max(width, 1), max(split, 1)), cfg.block_j) * cfg.block_j
    return LaunchPlan(cfg, triton.cdiv(max(width, 1), chunk), chunk)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _dequant_pair(q, s, z):
    """Bytes ``q`` (uint8) -> (low-nibble weights, high-nibble weights) in fp32, as fmas."""
    neg_zs = -z * s
    lo = (q & 0xF).to(tl.float32) * s + neg_zs
    hi = (q >> 4).to(tl.float32) * s + neg_zs
    return lo, hi


@triton.jit
def _load_group_params(s_ptr, z_ptr, offs, mask, SYMMETRIC: tl.constexpr):
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SYMMETRIC:
        z = tl.full(s.shape, _SYM_ZERO, tl.float32)
    else:
        z = tl.load(z_ptr + offs, mask=mask, other=0).to(tl.float32)
    return s, z


@triton.jit
def _activate_masked(g, u, offs_t, t_mask, offs_n, n_mask, tw_ptr, b_ptr, HAS_TW: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):  # fmt: skip
    """h = act(g + b_gate, u + b_up) masked to 0 where j >= tw[t]; ACT 0 = SiLU GLU, 1 = gpt-oss's
    clamped SwiGLU with ALPHA / LIMIT (a model property, compile-time like the group size)."""
    if HAS_BIAS:  # row j of bias holds neuron j's (gate, up) pair: the prefix property holds
        b_off = offs_n.to(tl.int64) * 2
        g = g + tl.load(b_ptr + b_off, mask=n_mask, other=0.0)[None, :]
        u = u + tl.load(b_ptr + b_off + 1, mask=n_mask, other=0.0)[None, :]
    if ACT == 0:
        h = g * tl.sigmoid(g) * u
    else:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        h = (u + 1.0) * (g * tl.sigmoid(g * ALPHA))
    if HAS_TW:
        # j < min(k, tw) for 0 <= j: n < k is already the store mask, so no clamp is needed
        tw = tl.load(tw_ptr + offs_t, mask=t_mask, other=0)
        h = tl.where(offs_n[None, :] < tw[:, None], h, 0.0)
    return h


@triton.jit(do_not_specialize=["T", "k"])
def _gate_up_decode_kernel(
    x_ptr, rows_ptr, tw_ptr, q_ptr, s_ptr, z_ptr, b_ptr, h_ptr,
    T, k, stride_xt,
    HB: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_TW: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = 2 * HB // GROUP  # groups per H-vector
    GB: tl.constexpr = GROUP // 2  # bytes per group
    pid_n = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    x_row = token_rows(rows_ptr, offs_t, t_mask, HAS_ROWS) * stride_xt
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < k  # never read past the prefix
    q_row = offs_n.to(tl.int64) * (3 * HB)  # gate row; the up row follows at + HB
    s_row = offs_n.to(tl.int64) * (3 * G)
    acc_g = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for b0 in range(0, HB, BLOCK_K):
        offs_b = b0 + tl.arange(0, BLOCK_K)
        b_mask = offs_b < HB
        x_off = x_row[:, None] + 2 * offs_b[None, :]
        x_mask = t_mask[:, None] & b_mask[None, :]
        xe = tl.load(x_ptr + x_off, mask=x_mask, other=0.0).to(tl.float32)[:, None, :]
        xo = tl.load(x_ptr + x_off + 1, mask=x_mask, other=0.0).to(tl.float32)[:, None, :]
        w_mask = n_mask[:, None] & b_mask[None, :]
        q_off = q_row[:, None] + offs_b[None, :]
        if BLOCK_K <= GB:  # the whole step lies in one group: one scale per neuron
            g_off = (s_row + b0 // GB)[:, None]
            g_mask = n_mask[:, None]
        else:
            g_off = s_row[:, None] + (offs_b // GB)[None, :]
            g_mask = w_mask
        s, z = _load_group_params(s_ptr, z_ptr, g_off, g_mask, SYMMETRIC)
        lo, hi = _dequant_pair(tl.load(q_ptr + q_off, mask=w_mask, other=0), s, z)
        acc_g += tl.sum(xe * lo[None, :, :] + xo * hi[None, :, :], axis=2)
        s, z = _load_group_params(s_ptr, z_ptr, g_off + G, g_mask, SYMMETRIC)
        lo, hi = _dequant_pair(tl.load(q_ptr + q_off + HB, mask=w_mask, other=0), s, z)
        acc_u += tl.sum(xe * lo[None, :, :] + xo * hi[None, :, :], axis=2)
    h = _activate_masked(acc_g, acc_u, offs_t, t_mask, offs_n, n_mask, tw_ptr, b_ptr, HAS_TW, HAS_BIAS, ACT, ALPHA,
                         LIMIT)
    tl.store(h_ptr + offs_t.to(tl.int64)[:, None] * k + offs_n[None, :], h, mask=t_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["T", "k"])
def _gate_up_prefill_kernel(
    x_ptr, rows_ptr, tw_ptr, q_ptr, s_ptr, z_ptr, b_ptr, h_ptr,
    T, k, stride_xt,
    HB: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_TW: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = 2 * HB // GROUP
    GB: tl.constexpr = GROUP // 2
    # Token tiles vary fastest: the programs sharing one block of neurons run together and
    # read its weights from L2 rather than DRAM.
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    x_row = token_rows(rows_ptr, offs_t, t_mask, HAS_ROWS) * stride_xt
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < k
    q_col = offs_n.to(tl.int64) * (3 * HB)
    s_col = offs_n.to(tl.int64) * (3 * G)
    acc_g = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for b0 in range(0, HB, BLOCK_K):
        offs_b = b0 + tl.arange(0, BLOCK_K)
        b_mask = offs_b < HB
        x_off = x_row[:, None] + 2 * offs_b[None, :]
        x_mask = t_mask[:, None] & b_mask[None, :]
        xe = tl.load(x_ptr + x_off, mask=x_mask, other=0.0).to(DOT_DTYPE)
        xo = tl.load(x_ptr + x_off + 1, mask=x_mask, other=0.0).to(DOT_DTYPE)
        # weights as (bytes, neurons) tiles: the right operand of x @ w
        w_mask = b_mask[:, None] & n_mask[None, :]
        q_off = q_col[None, :] + offs_b[:, None]
        if BLOCK_K <= GB:  # the whole step lies in one group: one scale per neuron
            g_off = (s_col + b0 // GB)[None, :]
            g_mask = n_mask[None, :]
        else:
            g_off = s_col[None, :] + (offs_b // GB)[:, None]
            g_mask = w_mask
        s, z = _load_group_params(s_ptr, z_ptr, g_off, g_mask, SYMMETRIC)
        lo, hi = _dequant_pair(tl.load(q_ptr + q_off, mask=w_mask, other=0), s, z)
        acc_g = dot_acc(xe, lo, acc_g, DOT_DTYPE)
        acc_g = dot_acc(xo, hi, acc_g, DOT_DTYPE)
        s, z = _load_group_params(s_ptr, z_ptr, g_off + G, g_mask, SYMMETRIC)
        lo, hi = _dequant_pair(tl.load(q_ptr + q_off + HB, mask=w_mask, other=0), s, z)
        acc_u = dot_acc(xe, lo, acc_u, DOT_DTYPE)
        acc_u = dot_acc(xo, hi, acc_u, DOT_DTYPE)
    h = _activate_masked(acc_g, acc_u, offs_t, t_mask, offs_n, n_mask, tw_ptr, b_ptr, HAS_TW, HAS_BIAS, ACT, ALPHA,
                         LIMIT)
    tl.store(h_ptr + offs_t.to(tl.int64)[:, None] * k + offs_n[None, :], h, mask=t_mask[:, None] & n_mask[None, :])


@triton.jit
def _write_out(out_ptr, rows_ptr, w_ptr, tw_ptr, db_ptr, pid_s, acc_e, acc_o, offs_t, t_mask, offs_b, b_mask,
               stride_ot, HAS_ROWS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, ATOMIC: tl.constexpr,
               HAS_TW: tl.constexpr, HAS_DOWN_BIAS: tl.constexpr):  # fmt: skip
    if HAS_DOWN_BIAS:
        # The expert's down bias, added once: by the first neuron chunk only, and to tokens whose
        # width is >= 1 (a token at width 0 is not run; see format.py).
        db_mask = b_mask & ((offs_b * 0 + pid_s) == 0)  # a tensor compare: the interpreter's mask needs one
        dbe = tl.load(db_ptr + 2 * offs_b, mask=db_mask, other=0.0)[None, :]
        dbo = tl.load(db_ptr + 2 * offs_b + 1, mask=db_mask, other=0.0)[None, :]
        if HAS_TW:
            on = (tl.load(tw_ptr + offs_t, mask=t_mask, other=0) > 0)[:, None]
            dbe = tl.where(on, dbe, 0.0)
            dbo = tl.where(on, dbo, 0.0)
        acc_e = acc_e + dbe
        acc_o = acc_o + dbo
    if HAS_WEIGHTS:
        wt = tl.load(w_ptr + offs_t, mask=t_mask, other=0.0)[:, None]
        acc_e = acc_e * wt
        acc_o = acc_o * wt
    o_off = (token_rows(rows_ptr, offs_t, t_mask, HAS_ROWS) * stride_ot)[:, None] + 2 * offs_b[None, :]
    o_mask = t_mask[:, None] & b_mask[None, :]
    if ATOMIC:  # fp32 out: several splits (or a running sum over experts) add into it
        tl.atomic_add(out_ptr + o_off, acc_e, mask=o_mask, sem="relaxed")
        tl.atomic_add(out_ptr + o_off + 1, acc_o, mask=o_mask, sem="relaxed")
    else:
        tl.store(out_ptr + o_off, acc_e.to(out_ptr.dtype.element_ty), mask=o_mask)
        tl.store(out_ptr + o_off + 1, acc_o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _down_tile(
    h_ptr, q_ptr, s_ptr, z_ptr, offs_t, t_mask, j0, j_hi, k, offs_b, b_mask, grp,
    HB: tl.constexpr, G: tl.constexpr, SYMMETRIC: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    """One step of stage 2 over neurons j0 .. j0 + BLOCK_J (masked at j_hi <= k): the intermediate
    h (BLOCK_T, BLOCK_J) fp32 and the dequantized down rows, (even, odd) elements (BLOCK_J, BLOCK_H)."""
    offs_j = j0 + tl.arange(0, BLOCK_J)
    j_mask = offs_j < j_hi
    h_off = offs_t.to(tl.int64)[:, None] * k + offs_j[None, :]
    hv = tl.load(h_ptr + h_off, mask=t_mask[:, None] & j_mask[None, :], other=0.0)
    w_mask = j_mask[:, None] & b_mask[None, :]
    j64 = offs_j.to(tl.int64)[:, None]
    s, z = _load_group_params(s_ptr, z_ptr, j64 * (3 * G) + 2 * G + grp[None, :], w_mask, SYMMETRIC)
    q = tl.load(q_ptr + j64 * (3 * HB) + 2 * HB + offs_b[None, :], mask=w_mask, other=0)
    lo, hi = _dequant_pair(q, s, z)
    return hv, lo, hi


@triton.jit(do_not_specialize=["T", "k", "chunk"])
def _down_decode_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, out_ptr, rows_ptr, w_ptr, tw_ptr, db_ptr,
    T, k, chunk, stride_ot,
    HB: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, ATOMIC: tl.constexpr,
    HAS_TW: tl.constexpr, HAS_DOWN_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = 2 * HB // GROUP
    GB: tl.constexpr = GROUP // 2
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_b = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    b_mask = offs_b < HB
    grp = offs_b // GB
    j_lo = pid_s * chunk
    j_hi = tl.minimum(j_lo + chunk, k)
    acc_e = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    acc_o = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_J):
        hv, lo, hi = _down_tile(h_ptr, q_ptr, s_ptr, z_ptr, offs_t, t_mask, j0, j_hi, k, offs_b, b_mask, grp,
                                HB, G, SYMMETRIC, BLOCK_J)  # fmt: skip
        hv = hv[:, :, None]
        acc_e += tl.sum(hv * lo[None, :, :], axis=1)
        acc_o += tl.sum(hv * hi[None, :, :], axis=1)
    _write_out(out_ptr, rows_ptr, w_ptr, tw_ptr, db_ptr, pid_s, acc_e, acc_o, offs_t, t_mask, offs_b, b_mask,
               stride_ot, HAS_ROWS, HAS_WEIGHTS, ATOMIC, HAS_TW, HAS_DOWN_BIAS)  # fmt: skip


@triton.jit(do_not_specialize=["T", "k", "chunk"])
def _down_prefill_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, out_ptr, rows_ptr, w_ptr, tw_ptr, db_ptr,
    T, k, chunk, stride_ot,
    HB: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, ATOMIC: tl.constexpr,
    HAS_TW: tl.constexpr, HAS_DOWN_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = 2 * HB // GROUP
    GB: tl.constexpr = GROUP // 2
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_b = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    b_mask = offs_b < HB
    grp = offs_b // GB
    j_lo = pid_s * chunk
    j_hi = tl.minimum(j_lo + chunk, k)
    acc_e = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    acc_o = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_J):
        hv, lo, hi = _down_tile(h_ptr, q_ptr, s_ptr, z_ptr, offs_t, t_mask, j0, j_hi, k, offs_b, b_mask, grp,
                                HB, G, SYMMETRIC, BLOCK_J)  # fmt: skip
        acc_e = dot_acc(hv, lo, acc_e, DOT_DTYPE)
        acc_o = dot_acc(hv, hi, acc_o, DOT_DTYPE)
    _write_out(out_ptr, rows_ptr, w_ptr, tw_ptr, db_ptr, pid_s, acc_e, acc_o, offs_t, t_mask, offs_b, b_mask,
               stride_ot, HAS_ROWS, HAS_WEIGHTS, ATOMIC, HAS_TW, HAS_DOWN_BIAS)  # fmt: skip


# ----------------------------------------------------------------------------- launchers


def _launch(
    x: torch.Tensor,
    packed: PackedExpert,
    width: int,
    num_tokens: int,
    out: torch.Tensor,
    *,
    rows: torch.Tensor | None,
    weights: torch.Tensor | None,
    token_widths: torch.Tensor | None,
    atomic: bool,
    plan: LaunchPlan,
) -> None:
    """Both stages of one expert call; ``width >= 1`` and ``num_tokens >= 1``."""
    cfg = plan.config
    hb = packed.hidden_size // 2
    q, s = packed.qweight, packed.scales
    z = packed.zeros if packed.zeros is not None else s  # unused when symmetric
    # Pointers that a constexpr flag switches off still need a tensor: any will do.
    rows_arg = rows if rows is not None else q
    tw_arg = token_widths if token_widths is not None else q
    w_arg = weights if weights is not None else q
    b_arg = packed.bias if packed.bias is not None else q
    db_arg = packed.down_bias if packed.down_bias is not None else q
    act = packed.activation
    h = torch.empty((num_tokens, width), dtype=torch.float32, device=x.device)
    flags = dict(
        HB=hb,
        GROUP=packed.fmt.group_size,
        SYMMETRIC=packed.fmt.symmetric,
        HAS_ROWS=rows is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    gate_up_flags = dict(HAS_TW=token_widths is not None, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
                         BLOCK_K=cfg.block_k, HAS_BIAS=packed.bias is not None, ACT=_ACT_CODES[act.kind],
                         ALPHA=act.alpha or 0.0, LIMIT=act.limit or 0.0, **flags)  # fmt: skip
    down_flags = dict(HAS_WEIGHTS=weights is not None, ATOMIC=atomic, BLOCK_T=cfg.block_t, BLOCK_J=cfg.block_j,
                      BLOCK_H=cfg.block_h, HAS_TW=token_widths is not None,
                      HAS_DOWN_BIAS=packed.down_bias is not None, **flags)  # fmt: skip
    gate_up_args = (x, rows_arg, tw_arg, q, s, z, b_arg, h, num_tokens, width, x.stride(0))
    down_args = (h, q, s, z, out, rows_arg, w_arg, tw_arg, db_arg, num_tokens, width, plan.chunk, out.stride(0))
    n_neuron_blocks = triton.cdiv(width, cfg.block_n)
    n_h_blocks = triton.cdiv(hb, cfg.block_h)
    # Triton launches on the current CUDA device: make it x's.
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        if cfg.path == "decode":
            _gate_up_decode_kernel[(n_neuron_blocks,)](*gate_up_args, **gate_up_flags)
            _down_decode_kernel[(n_h_blocks, plan.split)](*down_args, **down_flags)
        else:
            n_t = triton.cdiv(num_tokens, cfg.block_t)
            dot_dtype = operand_dtype(x)
            _gate_up_prefill_kernel[(n_t, n_neuron_blocks)](*gate_up_args, DOT_DTYPE=dot_dtype, **gate_up_flags)
            _down_prefill_kernel[(n_t, n_h_blocks, plan.split)](*down_args, DOT_DTYPE=dot_dtype, **down_flags)


def expert_mlp_triton(
    x: torch.Tensor,
    packed: PackedExpert,
    width: int,
    token_widths: torch.Tensor | None,
    *,
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """(T, H) in x's dtype; arguments already checked by ``expert_mlp``.

    ``plan`` overrides :func:`select_plan` (tests use it to force a path or a split).
    """
    num_tokens, hidden = x.shape
    if num_tokens == 0 or width == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if packed.has_tail and width > packed.tail_start:  # 4-bit head + 2-bit tail, both added into fp32
        out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
        _head_and_tail(out, x, packed, width, None, None, token_widths, plan)
        return out.to(x.dtype)
    plan = plan or select_plan(num_tokens, hidden, width, x.device)
    if plan.split > 1:  # several programs add into each output element: fp32 atomics
        out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    elif x.dtype == torch.bfloat16 and interpreter_enabled():
        # one program per element, stored; the interpreter's fp32->bf16 cast truncates (the GPU
        # rounds to nearest even), so there the fp32 result is stored and torch rounds it.
        out = torch.empty((num_tokens, hidden), dtype=torch.float32, device=x.device)
    else:  # one program owns each output element: stored in x's dtype, deterministic
        out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    _launch(
        x, packed, width, num_tokens, out,
        rows=None, weights=None, token_widths=token_widths, atomic=plan.split > 1, plan=plan,
    )  # fmt: skip
    return out if out.dtype == x.dtype else out.to(x.dtype)


def expert_mlp_accumulate_triton_(
    out: torch.Tensor,
    x: torch.Tensor,
    packed: PackedExpert,
    width: int,
    rows: torch.Tensor,
    weights: torch.Tensor,
    token_widths: torch.Tensor | None,
    *,
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """``out[rows[t]] += weights[t] * expert(x[rows[t]])`` with fp32 atomics; returns ``out``.

    x rows are gathered inside the kernels (no copy). Atomics make repeated rows correct; with
    ``split == 1`` and distinct rows each element has one adder, so the sum is deterministic.
    ``rows`` are not range-checked here (that would need a device sync): ``expert_mlp_accumulate_``
    documents them as indices into x and out.
    """
    num_tokens = rows.shape[0]
    if num_tokens == 0 or width == 0:
        return out
    if packed.has_tail and width > packed.tail_start:
        _head_and_tail(out, x, packed, width, rows, weights, token_widths, plan)
        return out
    plan = plan or select_plan(num_tokens, x.shape[1], width, x.device)
    _launch(
        x, packed, width, num_tokens, out,
        rows=rows, weights=weights, token_widths=token_widths, atomic=True, plan=plan,
    )  # fmt: skip
    return out


def _head_and_tail(out, x, packed: PackedExpert, width: int, rows, weights, token_widths, plan) -> None:
    """A call reaching a 2-bit tail (``width > packed.tail_start``): the 4-bit rows with the kernels above
    (the same token widths: j < min(tail_start, tw)), then the tail's neurons with the 2-bit kernels
    (``expert_mlp_tail_triton``), both added into the fp32 ``out``."""
    from .expert_mlp_tail_triton import tail_mlp_accumulate_triton_

    num_tokens = x.shape[0] if rows is None else rows.shape[0]
    head = packed.tail_start
    if head:
        _launch(x, packed, head, num_tokens, out, rows=rows, weights=weights, token_widths=token_widths,
                atomic=True, plan=plan or select_plan(num_tokens, x.shape[1], head, x.device))
    q2, s2, z2 = packed.tail_tensors(width)  # (2 (width - head), 3, H/4) ...: neuron-major views
    tail_tw = None if token_widths is None else (token_widths.to(torch.int64) - head).clamp_min(0) * 2
    tail_mlp_accumulate_triton_(out, x, q2, s2, z2, tail_group_size(packed.fmt), q2.shape[0], rows, weights, tail_tw)
