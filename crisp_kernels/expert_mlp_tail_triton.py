"""Triton kernels for the 2-bit "tail" neurons of one expert, added into an fp32 output.

CRISP orders an expert's neurons by importance, so the least important ones (the tail) can be
stored at 2 bits (format.py: ``PackedExpert.tail_tensors``). These kernels compute those neurons'
share of the expert, ``out[rows[t]] += weights[t] * sum_j h[t, j] * down_j``, next to the 4-bit
kernels of ``expert_mlp_triton.py`` (which run the head): both add into the same fp32 buffer.
They follow the 4-bit kernels' structure: two launches per call,

1. **gate/up** ``h[t, j] = silu(x_t . gate_j) * (x_t . up_j)`` for j < width, masked to 0 where
   j >= token_widths[t]; one program per block of neurons, looping over H; stored as an fp32
   (T, width) intermediate.
2. **down** ``out[rows[t], :] += weights[t] * sum_j h[t, j] * down_j``; one program per block of
   bytes of H (4 outputs per byte) and per chunk of neurons (split-K over j), always with fp32
   atomics (``out`` is an accumulation buffer; rows may repeat).

Layout (N neurons, neuron-major, so the first ``width`` neurons are one contiguous prefix):

    q2 (N, 3, H // 4) uint8   projection 0 = gate row, 1 = up row, 2 = down column (an H-vector)
    s2 (N, 3, H // GT) fp16   scale of group e // GT of that projection
    z2 (N, 3, H // GT) uint8  zero point in [0, 3]

Byte b of a projection holds elements 4b + i, i = 0..3, in bits [2i, 2i + 2) (the lowest two bits
are element 4b). Element e dequantizes to ``(code_e - zero) * scale``, folded to one fma per
element, ``code * s + (-z * s)`` with ``-z * s`` computed once per loaded scale. As the 4-bit
kernels split the activations into even and odd elements, these split them into the four phases
4b + i (four strided loads) and reduce each against its own 2-bit field (stage 1), or write the
four phases of the output with four strided atomics (stage 2).

Every weight load is masked on ``j < width``: a call never reads past row ``width`` of q2, s2 or
z2, so it is safe on a resident prefix of exactly ``width`` neurons. ``width`` and the token count
are runtime arguments (no recompile per width); H, the group size and the blocks are constexprs.

Paths (``select_tail_plan``):

- **decode** (T <= 16): a GEMV with ``tl.sum`` over a (tokens, neurons, bytes) broadcast, each
  weight byte read and dequantized once for all tokens; tokens padded to a power of two. Each
  byte carries four elements (two at 4 bits), so the byte tiles are half the 4-bit kernels':
  every program holds as many weight *elements* as the 4-bit kernel's at the same T (stage 1
  4K-16K elements, the 4-bit ``DECODE_CONFIGS`` sizing, whose registers were checked there).
- **prefill** (T > 16): ``tl.dot`` tiles (every block >= 16), operands in the x dtype (fp32
  accumulate; fp32 activations use IEEE fp32 dots). Under Triton's CPU interpreter the dot
  operands are cast to fp32 (its bf16 dot is wrong): ``triton_shared.operand_dtype``.

Stage 2 is split over neurons (fp32 atomics) until the grid covers the GPU about twice, in chunks
of at least ``_MIN_SPLIT_NEURONS`` neurons. The blocks are fixed, untuned: not yet timed on a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ._triton import tl, triton
from .checks import ACTIVATION_DTYPES, INDEX_DTYPES, check_token_vector
from .format import TAIL_BITS, unpack_crumbs
from .triton_shared import dot_acc, num_sms, operand_dtype, token_rows

# ----------------------------------------------------------------------------- constants

TAIL_CODES_PER_BYTE = 8 // TAIL_BITS  # 4
TAIL_DECODE_MAX_TOKENS = 16  # T <= this takes the GEMV path, larger T the tl.dot path
# Stage 2 is split over neurons until it has about this many programs per SM, but never into chunks of
# fewer than _MIN_SPLIT_NEURONS: a 2-bit neuron is half the bytes of a 4-bit one, so twice the 4-bit
# kernels' 64 for the same bytes streamed per atomic epilogue.
_PROGRAMS_PER_SM = 2
_MIN_SPLIT_NEURONS = 128
_Q_DTYPE = torch.uint8
_S_DTYPE = torch.float16
_Z_DTYPE = torch.uint8


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class TailKernelConfig:
    """Block sizes of one path. H is counted in packed bytes (4 elements per byte)."""

    path: str  # "decode" or "prefill"
    block_t: int  # tokens per program (decode: the padded token count)
    block_n: int  # stage 1: neurons per program
    block_k: int  # stage 1: bytes of H per loop step (4 * block_k elements)
    block_j: int  # stage 2: neurons per loop step
    block_h: int  # stage 2: bytes of H per program (4 * block_h outputs)
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class TailLaunchPlan:
    config: TailKernelConfig
    split: int  # stage 2 neuron chunks (each adds its partial sums with atomics)
    chunk: int  # neurons per chunk (a multiple of block_j)


# The 4-bit DECODE_CONFIGS with the byte blocks halved (block_k, block_h): the same elements per program.
TAIL_DECODE_CONFIGS = {
    1: TailKernelConfig("decode", 1, 16, 128, 32, 64),
    2: TailKernelConfig("decode", 2, 16, 64, 32, 32),
    4: TailKernelConfig("decode", 4, 16, 32, 16, 64),
    8: TailKernelConfig("decode", 8, 16, 16, 16, 32),
    16: TailKernelConfig("decode", 16, 16, 16, 16, 16),
}
# tl.dot needs every block >= 16; block_k = 16 bytes is 64 elements per dot, as the 4-bit kernels' 32.
TAIL_PREFILL_CONFIGS = {
    32: TailKernelConfig("prefill", 32, 64, 16, 32, 32),
    64: TailKernelConfig("prefill", 64, 64, 16, 32, 32),
}


def select_tail_config(num_tokens: int) -> TailKernelConfig:
    if num_tokens <= TAIL_DECODE_MAX_TOKENS:
        return TAIL_DECODE_CONFIGS[triton.next_power_of_2(max(num_tokens, 1))]
    return TAIL_PREFILL_CONFIGS[32 if num_tokens <= 32 else 64]


def make_tail_plan(cfg: TailKernelConfig, width: int, split: int) -> TailLaunchPlan:
    """A plan with about ``split`` chunks of whole ``block_j`` steps (tests force splits with it)."""
    chunk = triton.cdiv(triton.cdiv(max(width, 1), max(split, 1)), cfg.block_j) * cfg.block_j
    return TailLaunchPlan(cfg, triton.cdiv(max(width, 1), chunk), chunk)


def select_tail_plan(num_tokens: int, hidden_size: int, width: int, device: torch.device) -> TailLaunchPlan:
    """The path, blocks and stage-2 split for one call (plain Python, no device work)."""
    cfg = select_tail_config(num_tokens)
    programs = triton.cdiv(num_tokens, cfg.block_t) * triton.cdiv(hidden_size // TAIL_CODES_PER_BYTE, cfg.block_h)
    want = triton.cdiv(_PROGRAMS_PER_SM * num_sms(device), programs)
    return make_tail_plan(cfg, width, max(1, min(want, width // _MIN_SPLIT_NEURONS)))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _dequant_crumbs(q, s, z):
    """Bytes ``q`` (uint8) -> the weights of elements 4b, 4b+1, 4b+2, 4b+3 in fp32, as fmas."""
    neg_zs = -z * s
    w0 = (q & 3).to(tl.float32) * s + neg_zs
    w1 = ((q >> 2) & 3).to(tl.float32) * s + neg_zs
    w2 = ((q >> 4) & 3).to(tl.float32) * s + neg_zs
    w3 = (q >> 6).to(tl.float32) * s + neg_zs
    return w0, w1, w2, w3


@triton.jit
def _load_crumbs(q_ptr, q_off, w_mask, s_ptr, z_ptr, g_off, g_mask):
    """Load and dequantize a tile of bytes with their groups' scales / zeros (masked lanes give 0)."""
    s = tl.load(s_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g_off, mask=g_mask, other=0).to(tl.float32)
    q = tl.load(q_ptr + q_off, mask=w_mask, other=0)
    return _dequant_crumbs(q, s, z)


@triton.jit
def _load_x_phases(x_ptr, x_off, x_mask, DTYPE: tl.constexpr):
    """The activations of elements 4b + i, i = 0..3, of the bytes b in ``x_off`` (4 strided loads)."""
    x0 = tl.load(x_ptr + x_off, mask=x_mask, other=0.0).to(DTYPE)
    x1 = tl.load(x_ptr + x_off + 1, mask=x_mask, other=0.0).to(DTYPE)
    x2 = tl.load(x_ptr + x_off + 2, mask=x_mask, other=0.0).to(DTYPE)
    x3 = tl.load(x_ptr + x_off + 3, mask=x_mask, other=0.0).to(DTYPE)
    return x0, x1, x2, x3


@triton.jit
def _silu_glu_masked(g, u, offs_t, t_mask, offs_n, tw_ptr, HAS_TW: tl.constexpr):
    """h = silu(g) * u, masked to 0 where j >= tw[t] (so tw <= 0 gives the token nothing)."""
    h = g * tl.sigmoid(g) * u
    if HAS_TW:  # j < min(width, tw): j < width is already the store mask, so no clamp is needed
        tw = tl.load(tw_ptr + offs_t, mask=t_mask, other=0)
        h = tl.where(offs_n[None, :] < tw[:, None], h, 0.0)
    return h


@triton.jit(do_not_specialize=["T", "width"])
def _tail_gate_up_decode_kernel(
    x_ptr, rows_ptr, tw_ptr, q_ptr, s_ptr, z_ptr, h_ptr,
    T, width, stride_xt,
    HQ: tl.constexpr, GROUP: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_TW: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = 4 * HQ // GROUP  # groups per H-vector
    GB: tl.constexpr = GROUP // 4  # bytes per group
    pid_n = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    x_row = token_rows(rows_ptr, offs_t, t_mask, HAS_ROWS) * stride_xt
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width  # never read past the prefix
    q_row = offs_n.to(tl.int64) * (3 * HQ)  # gate row; the up row follows at + HQ
    s_row = offs_n.to(tl.int64) * (3 * G)
    acc_g = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for b0 in range(0, HQ, BLOCK_K):
        offs_b = b0 + tl.arange(0, BLOCK_K)
        b_mask = offs_b < HQ
        x_off = x_row[:, None] + 4 * offs_b[None, :]
        x0, x1, x2, x3 = _load_x_phases(x_ptr, x_off, t_mask[:, None] & b_mask[None, :], tl.float32)
        x0 = x0[:, None, :]
        x1 = x1[:, None, :]
        x2 = x2[:, None, :]
        x3 = x3[:, None, :]
        w_mask = n_mask[:, None] & b_mask[None, :]
        q_off = q_row[:, None] + offs_b[None, :]
        if GB % BLOCK_K == 0:  # the whole step lies in one group: one scale per neuron
            g_off = (s_row + b0 // GB)[:, None]
            g_mask = n_mask[:, None]
        else:
            g_off = s_row[:, None] + (offs_b // GB)[None, :]
            g_mask = w_mask
        w0, w1, w2, w3 = _load_crumbs(q_ptr, q_off, w_mask, s_ptr, z_ptr, g_off, g_mask)
        acc_g += tl.sum(x0 * w0[None, :, :] + x1 * w1[None, :, :] + x2 * w2[None, :, :] + x3 * w3[None, :, :], axis=2)
        w0, w1, w2, w3 = _load_crumbs(q_ptr, q_off + HQ, w_mask, s_ptr, z_ptr, g_off + G, g_mask)
        acc_u += tl.sum(x0 * w0[None, :, :] + x1 * w1[None, :, :] + x2 * w2[None, :, :] + x3 * w3[None, :, :], axis=2)
    h = _silu_glu_masked(acc_g, acc_u, offs_t, t_mask, offs_n, tw_ptr, HAS_TW)
    h_off = offs_t.to(tl.int64)[:, None] * width + offs_n[None, :]
    tl.store(h_ptr + h_off, h, mask=t_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["T", "width"])
def _tail_gate_up_prefill_kernel(
    x_ptr, rows_ptr, tw_ptr, q_ptr, s_ptr, z_ptr, h_ptr,
    T, width, stride_xt,
    HQ: tl.constexpr, GROUP: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_TW: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = 4 * HQ // GROUP
    GB: tl.constexpr = GROUP // 4
    # Token tiles vary fastest: the programs sharing one block of neurons run together (L2 reuse).
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    x_row = token_rows(rows_ptr, offs_t, t_mask, HAS_ROWS) * stride_xt
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    q_col = offs_n.to(tl.int64) * (3 * HQ)
    s_col = offs_n.to(tl.int64) * (3 * G)
    acc_g = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for b0 in range(0, HQ, BLOCK_K):
        offs_b = b0 + tl.arange(0, BLOCK_K)
        b_mask = offs_b < HQ
        x_off = x_row[:, None] + 4 * offs_b[None, :]
        x0, x1, x2, x3 = _load_x_phases(x_ptr, x_off, t_mask[:, None] & b_mask[None, :], DOT_DTYPE)
        # weights as (bytes, neurons) tiles: the right operand of x @ w
        w_mask = b_mask[:, None] & n_mask[None, :]
        q_off = q_col[None, :] + offs_b[:, None]
        if GB % BLOCK_K == 0:  # the whole step lies in one group: one scale per neuron
            g_off = (s_col + b0 // GB)[None, :]
            g_mask = n_mask[None, :]
        else:
            g_off = s_col[None, :] + (offs_b // GB)[:, None]
            g_mask = w_mask
        w0, w1, w2, w3 = _load_crumbs(q_ptr, q_off, w_mask, s_ptr, z_ptr, g_off, g_mask)
        acc_g = dot_acc(x0, w0, acc_g, DOT_DTYPE)
        acc_g = dot_acc(x1, w1, acc_g, DOT_DTYPE)
        acc_g = dot_acc(x2, w2, acc_g, DOT_DTYPE)
        acc_g = dot_acc(x3, w3, acc_g, DOT_DTYPE)
        w0, w1, w2, w3 = _load_crumbs(q_ptr, q_off + HQ, w_mask, s_ptr, z_ptr, g_off + G, g_mask)
        acc_u = dot_acc(x0, w0, acc_u, DOT_DTYPE)
        acc_u = dot_acc(x1, w1, acc_u, DOT_DTYPE)
        acc_u = dot_acc(x2, w2, acc_u, DOT_DTYPE)
        acc_u = dot_acc(x3, w3, acc_u, DOT_DTYPE)
    h = _silu_glu_masked(acc_g, acc_u, offs_t, t_mask, offs_n, tw_ptr, HAS_TW)
    h_off = offs_t.to(tl.int64)[:, None] * width + offs_n[None, :]
    tl.store(h_ptr + h_off, h, mask=t_mask[:, None] & n_mask[None, :])


@triton.jit
def _tail_down_tile(
    h_ptr, q_ptr, s_ptr, z_ptr, offs_t, t_mask, j0, j_hi, width, offs_b, b_mask, grp,
    HQ: tl.constexpr, G: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    """One step of stage 2 over neurons j0 .. j0 + BLOCK_J (masked at j_hi <= width): the intermediate
    h (BLOCK_T, BLOCK_J) fp32 and the dequantized down columns, four phases of (BLOCK_J, BLOCK_H)."""
    offs_j = j0 + tl.arange(0, BLOCK_J)
    j_mask = offs_j < j_hi
    h_off = offs_t.to(tl.int64)[:, None] * width + offs_j[None, :]
    hv = tl.load(h_ptr + h_off, mask=t_mask[:, None] & j_mask[None, :], other=0.0)
    w_mask = j_mask[:, None] & b_mask[None, :]
    j64 = offs_j.to(tl.int64)[:, None]
    g_off = j64 * (3 * G) + 2 * G + grp[None, :]
    q_off = j64 * (3 * HQ) + 2 * HQ + offs_b[None, :]
    w0, w1, w2, w3 = _load_crumbs(q_ptr, q_off, w_mask, s_ptr, z_ptr, g_off, w_mask)
    return hv, w0, w1, w2, w3


@triton.jit
def _tail_add_out(out_ptr, rows_ptr, w_ptr, acc0, acc1, acc2, acc3, offs_t, t_mask, offs_b, b_mask, stride_ot,
                  HAS_ROWS: tl.constexpr, HAS_WEIGHTS: tl.constexpr):  # fmt: skip
    """``out[rows[t], 4b + i] += weights[t] * acc_i`` with fp32 atomics (rows may repeat; chunks add up)."""
    if HAS_WEIGHTS:
        wt = tl.load(w_ptr + offs_t, mask=t_mask, other=0.0)[:, None]
        acc0 = acc0 * wt
        acc1 = acc1 * wt
        acc2 = acc2 * wt
        acc3 = acc3 * wt
    o_off = (token_rows(rows_ptr, offs_t, t_mask, HAS_ROWS) * stride_ot)[:, None] + 4 * offs_b[None, :]
    o_mask = t_mask[:, None] & b_mask[None, :]
    tl.atomic_add(out_ptr + o_off, acc0, mask=o_mask, sem="relaxed")
    tl.atomic_add(out_ptr + o_off + 1, acc1, mask=o_mask, sem="relaxed")
    tl.atomic_add(out_ptr + o_off + 2, acc2, mask=o_mask, sem="relaxed")
    tl.atomic_add(out_ptr + o_off + 3, acc3, mask=o_mask, sem="relaxed")


@triton.jit(do_not_specialize=["T", "width", "chunk"])
def _tail_down_decode_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, out_ptr, rows_ptr, w_ptr,
    T, width, chunk, stride_ot,
    HQ: tl.constexpr, GROUP: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = 4 * HQ // GROUP
    GB: tl.constexpr = GROUP // 4
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_b = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    b_mask = offs_b < HQ
    grp = offs_b // GB
    j_lo = pid_s * chunk
    j_hi = tl.minimum(j_lo + chunk, width)
    acc0 = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    acc1 = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    acc2 = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    acc3 = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_J):
        hv, w0, w1, w2, w3 = _tail_down_tile(h_ptr, q_ptr, s_ptr, z_ptr, offs_t, t_mask, j0, j_hi, width, offs_b,
                                             b_mask, grp, HQ, G, BLOCK_J)  # fmt: skip
        hv = hv[:, :, None]
        acc0 += tl.sum(hv * w0[None, :, :], axis=1)
        acc1 += tl.sum(hv * w1[None, :, :], axis=1)
        acc2 += tl.sum(hv * w2[None, :, :], axis=1)
        acc3 += tl.sum(hv * w3[None, :, :], axis=1)
    _tail_add_out(out_ptr, rows_ptr, w_ptr, acc0, acc1, acc2, acc3, offs_t, t_mask, offs_b, b_mask, stride_ot,
                  HAS_ROWS, HAS_WEIGHTS)  # fmt: skip


@triton.jit(do_not_specialize=["T", "width", "chunk"])
def _tail_down_prefill_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, out_ptr, rows_ptr, w_ptr,
    T, width, chunk, stride_ot,
    HQ: tl.constexpr, GROUP: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = 4 * HQ // GROUP
    GB: tl.constexpr = GROUP // 4
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_b = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    b_mask = offs_b < HQ
    grp = offs_b // GB
    j_lo = pid_s * chunk
    j_hi = tl.minimum(j_lo + chunk, width)
    acc0 = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    acc1 = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    acc2 = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    acc3 = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_J):
        hv, w0, w1, w2, w3 = _tail_down_tile(h_ptr, q_ptr, s_ptr, z_ptr, offs_t, t_mask, j0, j_hi, width, offs_b,
                                             b_mask, grp, HQ, G, BLOCK_J)  # fmt: skip
        acc0 = dot_acc(hv, w0, acc0, DOT_DTYPE)
        acc1 = dot_acc(hv, w1, acc1, DOT_DTYPE)
        acc2 = dot_acc(hv, w2, acc2, DOT_DTYPE)
        acc3 = dot_acc(hv, w3, acc3, DOT_DTYPE)
    _tail_add_out(out_ptr, rows_ptr, w_ptr, acc0, acc1, acc2, acc3, offs_t, t_mask, offs_b, b_mask, stride_ot,
                  HAS_ROWS, HAS_WEIGHTS)  # fmt: skip


# ----------------------------------------------------------------------------- launcher


def _check_tensor(t, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like x")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (a prefix view of a contiguous tensor is), got strides "
                         f"{t.stride()}")


def _check_args(out, x, q2, s2, z2, group_size, width, rows, weights, token_widths, out_dtypes) -> int:
    """Every argument of a tail call, with errors naming it; returns the token count T."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected shape (T, H), got {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x: expected dtype fp16, bf16 or fp32, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x: the hidden dimension must be contiguous (stride 1), got strides {x.stride()}")
    hidden, device = x.shape[1], x.device
    if hidden <= 0 or hidden % TAIL_CODES_PER_BYTE:
        raise ValueError(f"x: the hidden size H={hidden} must be a positive multiple of {TAIL_CODES_PER_BYTE} "
                         f"(4 codes per byte)")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}")
    if group_size <= 0 or group_size % TAIL_CODES_PER_BYTE or hidden % group_size:
        raise ValueError(f"group_size={group_size} must be a positive multiple of {TAIL_CODES_PER_BYTE} "
                         f"dividing H={hidden}")
    if not isinstance(q2, torch.Tensor) or q2.dim() != 3:
        shape = tuple(q2.shape) if isinstance(q2, torch.Tensor) else type(q2).__name__
        raise ValueError(f"q2: expected a tensor of shape (N, 3, H/4={hidden // 4}), got {shape}")
    n = q2.shape[0]
    groups = hidden // group_size
    _check_tensor(q2, "q2", (n, 3, hidden // TAIL_CODES_PER_BYTE), _Q_DTYPE, device)
    _check_tensor(s2, "s2", (n, 3, groups), _S_DTYPE, device)
    _check_tensor(z2, "z2", (n, 3, groups), _Z_DTYPE, device)
    if isinstance(width, bool) or not isinstance(width, int):
        raise TypeError(f"width: expected an int, got {type(width).__name__}")
    if not 0 <= width <= n:
        raise ValueError(f"width={width} must lie in [0, N={n}]")
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[1] != hidden:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out: expected shape (No, H={hidden}), got {shape}")
    if out.dtype not in out_dtypes:
        raise ValueError(f"out: expected dtype in {out_dtypes} (the accumulation buffer), got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, expected {device} like x")
    if hidden > 1 and out.stride(1) != 1:
        raise ValueError(f"out: the hidden dimension must be contiguous (stride 1), got strides {out.stride()}")
    if rows is None:
        num_tokens = x.shape[0]
        if out.shape[0] < num_tokens:
            raise ValueError(f"out: rows=None adds token t into out[t], so out needs >= T={num_tokens} rows, "
                             f"got {out.shape[0]}")
    else:
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1:
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"rows: expected a tensor of shape (T,), got {shape}")
        num_tokens = rows.shape[0]
        check_token_vector(rows, "rows", num_tokens, device, INDEX_DTYPES)
    check_token_vector(weights, "weights", num_tokens, device, (torch.float32,))
    check_token_vector(token_widths, "token_widths", num_tokens, device, INDEX_DTYPES)
    return num_tokens


def tail_mlp_accumulate_triton_(
    out: torch.Tensor,
    x: torch.Tensor,
    q2: torch.Tensor,
    s2: torch.Tensor,
    z2: torch.Tensor,
    group_size: int,
    width: int,
    rows: torch.Tensor | None,
    weights: torch.Tensor | None,
    token_widths: torch.Tensor | None,
    *,
    plan: TailLaunchPlan | None = None,
) -> None:
    """``out[rows[t]] += weights[t] * sum_{j < min(width, token_widths[t])} h[t, j] * down_j`` (module docstring).

    out (No, H) float32; x (Tx, H) fp16/bf16/fp32 with stride 1 along H; q2 / s2 / z2 the 2-bit
    neurons (N, 3, ...) contiguous; ``rows`` None means arange(Tx); ``weights`` None means 1;
    ``token_widths`` None means ``width`` for every token. ``rows`` are not range-checked (that
    would need a device sync). ``plan`` overrides :func:`select_tail_plan` (tests force paths and
    splits with it). Nothing is launched when ``width == 0`` or T == 0.
    """
    num_tokens = _check_args(out, x, q2, s2, z2, group_size, width, rows, weights, token_widths, (torch.float32,))
    if num_tokens == 0 or width == 0:
        return
    hq = x.shape[1] // TAIL_CODES_PER_BYTE
    plan = plan or select_tail_plan(num_tokens, x.shape[1], width, x.device)
    cfg = plan.config
    # Pointers that a constexpr flag switches off still need a tensor: any will do.
    rows_arg = rows if rows is not None else q2
    w_arg = weights if weights is not None else q2
    tw_arg = token_widths if token_widths is not None else q2
    h = torch.empty((num_tokens, width), dtype=torch.float32, device=x.device)
    flags = dict(HQ=hq, GROUP=group_size, HAS_ROWS=rows is not None, num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages)  # fmt: skip
    gate_up_flags = dict(HAS_TW=token_widths is not None, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
                         BLOCK_K=cfg.block_k, **flags)  # fmt: skip
    down_flags = dict(HAS_WEIGHTS=weights is not None, BLOCK_T=cfg.block_t, BLOCK_J=cfg.block_j,
                      BLOCK_H=cfg.block_h, **flags)  # fmt: skip
    gate_up_args = (x, rows_arg, tw_arg, q2, s2, z2, h, num_tokens, width, x.stride(0))
    down_args = (h, q2, s2, z2, out, rows_arg, w_arg, num_tokens, width, plan.chunk, out.stride(0))
    n_neuron_blocks = triton.cdiv(width, cfg.block_n)
    n_h_blocks = triton.cdiv(hq, cfg.block_h)
    # Triton launches on the current CUDA device: make it x's.
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        if cfg.path == "decode":
            _tail_gate_up_decode_kernel[(n_neuron_blocks,)](*gate_up_args, **gate_up_flags)
            _tail_down_decode_kernel[(n_h_blocks, plan.split)](*down_args, **down_flags)
        else:
            n_t = triton.cdiv(num_tokens, cfg.block_t)
            dot_dtype = operand_dtype(x)
            _tail_gate_up_prefill_kernel[(n_t, n_neuron_blocks)](*gate_up_args, DOT_DTYPE=dot_dtype, **gate_up_flags)
            _tail_down_prefill_kernel[(n_t, n_h_blocks, plan.split)](*down_args, DOT_DTYPE=dot_dtype, **down_flags)


# ----------------------------------------------------------------------------- reference


def tail_mlp_accumulate_ref_(
    out: torch.Tensor,
    x: torch.Tensor,
    q2: torch.Tensor,
    s2: torch.Tensor,
    z2: torch.Tensor,
    group_size: int,
    width: int,
    rows: torch.Tensor | None,
    weights: torch.Tensor | None,
    token_widths: torch.Tensor | None,
) -> None:
    """Pure-torch :func:`tail_mlp_accumulate_triton_`: the same arguments and result.

    It computes in ``out``'s dtype, which may also be float64 here (the tests' reference); it reads
    only the first ``width`` neurons of q2 / s2 / z2.
    """
    _check_args(out, x, q2, s2, z2, group_size, width, rows, weights, token_widths, (torch.float32, torch.float64))
    num_tokens = x.shape[0] if rows is None else rows.shape[0]
    if num_tokens == 0 or width == 0:
        return
    dt = out.dtype
    codes = unpack_crumbs(q2[:width]).to(dt)  # (width, 3, H)
    scales = s2[:width].to(dt).repeat_interleave(group_size, dim=-1)
    zeros = z2[:width].to(dt).repeat_interleave(group_size, dim=-1)
    w = (codes - zeros) * scales
    gate, up, down = w[:, 0], w[:, 1], w[:, 2]  # (width, H) each; down_j is an H-vector
    idx = torch.arange(num_tokens, device=x.device) if rows is None else rows.to(torch.int64)
    xt = x[idx].to(dt)
    h = torch.nn.functional.silu(xt @ gate.T) * (xt @ up.T)  # (T, width)
    if token_widths is not None:
        used = torch.arange(width, device=x.device)[None, :] < token_widths.to(torch.int64)[:, None]
        h = torch.where(used, h, torch.zeros((), dtype=dt, device=x.device))
    y = h @ down
    if weights is not None:
        y = y * weights.to(dt)[:, None]
    out.index_add_(0, idx, y)
